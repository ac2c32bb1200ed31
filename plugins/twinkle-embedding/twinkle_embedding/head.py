"""Turning a backend's model into an encoder, without the backend knowing.

:func:`attach` composes with any :class:`~twinkle_core.model.torch_model.TorchTwinkleModel`: it
wraps the instance's ``_run_module`` (the one place every forward goes through) so that the
network's token states are pooled into ``outputs["embeddings"]``, and the instance's ``_export`` so
that every saved model directory also gets the sentence-transformers files. Models without those
hooks get their ``forward`` / ``forward_only`` / ``save`` wrapped instead.

The network must return its final token states: ``last_hidden_state`` (a transformers ``AutoModel``,
what the embedding task asks the HF backend for) or ``hidden_states`` (a causal LM run with
``output_hidden_states``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from twinkle_core.errors import ConfigError
from twinkle_embedding.pooling import pool

logger = logging.getLogger("twinkle.embedding")


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


def attach(model: Any, head: EmbeddingHead, on_export: Callable[[Any, str, str | None], None]) -> None:
    """Make ``model`` return ``{"embeddings": ...}`` from every forward and call ``on_export(model, directory,
    adapter_name)`` after it writes a model directory. Attaching twice replaces the head only."""
    already = getattr(model, "embedding_head", None) is not None
    model.embedding_head = head
    model._twinkle_embedding_on_export = on_export
    if already:
        return

    def finish(outputs: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
        if "embeddings" in outputs and outputs.get("last_hidden_state") is None and not outputs.get("hidden_states"):
            return outputs  # already pooled (a wrapped method called another wrapped one)
        result = model.embedding_head(outputs, inputs)
        strategy = getattr(model, "strategy", None)
        if strategy is not None:
            result["dp_size"] = getattr(strategy, "dp_size", 1)
            result["dp_group"] = getattr(strategy, "dp_group", None)
        return result

    if callable(getattr(model, "_run_module", None)):
        run = model._run_module

        @functools.wraps(run)
        def _run_module(module: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
            return finish(run(module, inputs), inputs)

        model._run_module = _run_module
    else:
        for name in ("forward", "forward_only"):
            original = getattr(model, name)

            def wrapped(*args: Any, _original: Any = original, **kwargs: Any) -> dict[str, Any]:
                return finish(_original(*args, **kwargs), kwargs.get("inputs") or {})

            setattr(model, name, wrapped)

    if callable(getattr(model, "_export", None)):
        export = model._export

        @functools.wraps(export)
        def _export(directory: str, state_dict: dict[str, Any], adapter_name: str | None) -> None:
            export(directory, state_dict, adapter_name)
            model._twinkle_embedding_on_export(model, directory, adapter_name)

        model._export = _export
    else:
        save = model.save

        @functools.wraps(save)
        def _save(name: str, **kwargs: Any) -> str:
            path = save(name, **kwargs)
            from twinkle_core import distributed

            if distributed.is_main_process():
                model._twinkle_embedding_on_export(model, str(path), kwargs.get("adapter_name"))
            return path

        model.save = _save
