"""The embedding head: what the embedding task's ``process_outputs`` makes of the network's outputs.

The model hands every forward's outputs to its task (``Task.process_outputs``); the task applies an
:class:`EmbeddingHead` there, so the pooled ``{"embeddings": ...}`` is what the loss and evaluation
read. No backend method is replaced.

The network must return its final token states: ``last_hidden_state`` (a transformers ``AutoModel``,
what the embedding task asks the HF backend for) or ``hidden_states`` (a causal LM run with
``output_hidden_states``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from twinkle_core.errors import ConfigError
from twinkle_embedding.pooling import pool


class EmbeddingHead:
    """Pooling (+ optional L2 normalisation) applied to the network's outputs."""

    def __init__(self, pooling: str, normalize: bool) -> None:
        self.pooling = pooling
        self.normalize = bool(normalize)
        self.dimension: int | None = None

    def __repr__(self) -> str:
        return f"EmbeddingHead(pooling={self.pooling!r}, normalize={self.normalize})"

    def hidden_states(self, outputs: dict[str, Any]) -> tuple[torch.Tensor, str]:
        hidden = outputs.get("last_hidden_state")
        if hidden is not None:
            return hidden, "last_hidden_state"
        states = outputs.get("hidden_states")
        if states is not None and len(states):
            return states[-1], "hidden_states"
        raise ConfigError(
            f"the embedding task needs the network's final token states (last_hidden_state or hidden_states), but "
            f"the model returned only {sorted(outputs)}; with the HF backend keep task_options.model_kind: encoder "
            f"(AutoModel). Backends that return logits only (e.g. MegatronModel) are not supported yet")

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
        hidden, used = self.hidden_states(outputs)
        embeddings = pool(hidden, inputs.get("attention_mask"), self.pooling)
        if self.normalize:
            embeddings = F.normalize(embeddings, p=2, dim=-1)
        self.dimension = int(embeddings.shape[-1])
        if embeddings.requires_grad:
            # Outputs the embedding does not use (BERT's pooler_output, a causal LM's logits) would leave
            # parameters without a gradient, which DistributedDataParallel rejects; a zero-weighted touch gives
            # them an exact zero gradient instead.
            for key, value in outputs.items():
                if key != used and isinstance(value, torch.Tensor) and value.requires_grad:
                    embeddings = embeddings + _ZeroTouch.apply(value).to(embeddings.dtype)
        return {"embeddings": embeddings}


class _ZeroTouch(torch.autograd.Function):
    """A scalar 0 that depends on ``value``: its backward hands ``value`` an exact zero gradient (no NaN from
    ``inf * 0`` as ``value.sum() * 0`` could give)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype = value.shape, value.dtype
        return value.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.new_zeros(ctx.shape, dtype=ctx.dtype)

