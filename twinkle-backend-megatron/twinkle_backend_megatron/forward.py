"""Running a ``MegatronModel``'s chunks: Megatron's inputs from Twinkle's, and the entry points.

With ``pp == 1`` the core's forward / backward / loss run unchanged on the one chunk; with ``pp > 1`` only
``forward_backward`` / ``forward_only`` can run (they go to the pipeline schedule in ``pipeline.py``) and the
others raise one error that says so.
"""

from __future__ import annotations

from typing import Any

import torch

from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import LossOutput
from twinkle_core.model.frozen import trains


def _pipeline_error(method: str, pp: int) -> ConfigError:
    return ConfigError(
        f"MegatronModel.{method}() cannot run on its own with pipeline parallelism (mesh.pp={pp}): the forward "
        f"graph spans several ranks and megatron-core runs forward and backward together in its pipeline "
        f"schedule. Call forward_backward(inputs=...) for training (then clip_grad_and_step as usual) and "
        f"forward_only(inputs=...) for evaluation.")



class MegatronForwardMixin:
    """How a ``MegatronModel`` calls megatron-core's ``GPTModel`` and which entry points pipelining allows."""

    def _megatron_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """``GPTModel.forward`` arguments: the attention mask Megatron wants (True = masked) and positions."""
        input_ids = inputs["input_ids"]
        b, s = input_ids.shape
        device = input_ids.device
        arange = torch.arange(s, device=device)
        position_ids = inputs.get("position_ids")
        attention_mask = inputs.get("attention_mask")
        packed = position_ids is not None and not bool((position_ids == arange).all())
        mask = None
        if packed or (attention_mask is not None and not bool(attention_mask.bool().all())):
            allowed = torch.ones(s, s, dtype=torch.bool, device=device).tril()[None].expand(b, s, s)
            if packed:
                first = position_ids[:, :1] - 1
                segment = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
                allowed = allowed & (segment[:, :, None] == segment[:, None, :])
            if attention_mask is not None:
                allowed = allowed & attention_mask.bool()[:, None, :]
            mask = ~allowed[:, None]
        return {"input_ids": input_ids, "position_ids": position_ids if packed else None, "attention_mask": mask}

    def _call_chunk(self, chunk: Any, inputs: dict[str, Any]) -> torch.Tensor:
        kw = self._megatron_inputs(inputs)
        inner = self.strategy.unwrap_module(chunk)  # the GPTModel inside megatron-core's DDP wrapper
        inner._twinkle_positions = kw.pop("position_ids")
        try:
            return chunk(input_ids=kw["input_ids"], position_ids=None, attention_mask=kw["attention_mask"])
        finally:
            inner._twinkle_positions = None

    def run_network(self, module: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        if self.pp_size > 1:
            raise _pipeline_error("forward", self.pp_size)
        logits = self._call_chunk(module, inputs)
        return {"logits": logits[..., : self.spec.vocab_size]}

    def forward(self, *, inputs: dict[str, Any], adapter_name: str | None = None, **kwargs: Any) -> dict[str, Any]:
        if self.pp_size > 1:
            raise _pipeline_error("forward", self.pp_size)
        return super().forward(inputs=inputs, adapter_name=adapter_name, **kwargs)

    def backward(self, *, loss: Any = None, adapter_name: str | None = None, **kwargs: Any) -> None:
        if self.pp_size > 1:
            raise _pipeline_error("backward", self.pp_size)
        super().backward(loss=loss, adapter_name=adapter_name, **kwargs)

    def calculate_loss(self, *, inputs: dict[str, Any] | None = None, outputs: dict[str, Any] | None = None,
                       adapter_name: str | None = None, **kwargs: Any) -> LossOutput:
        if self.pp_size > 1 and (inputs is None or outputs is None):
            raise _pipeline_error("calculate_loss", self.pp_size)
        return super().calculate_loss(inputs=inputs, outputs=outputs, adapter_name=adapter_name, **kwargs)

    @trains  # the pipeline path below trains without going through the core's forward_backward
    def forward_backward(self, *, inputs: dict[str, Any], adapter_name: str | None = None,
                         **kwargs: Any) -> dict[str, Any]:
        if self.pp_size == 1:
            return super().forward_backward(inputs=inputs, adapter_name=adapter_name, **kwargs)
        return self._pipeline(inputs, adapter_name, forward_only=False)

    def forward_only(self, *, inputs: dict[str, Any], adapter_name: str | None = None,
                     disable_adapters: bool = False, **kwargs: Any) -> dict[str, Any]:
        if self.pp_size == 1:
            return super().forward_only(inputs=inputs, adapter_name=adapter_name, disable_adapters=disable_adapters,
                                        **kwargs)
        return self._pipeline(inputs, adapter_name, forward_only=True, disable_adapters=disable_adapters)
