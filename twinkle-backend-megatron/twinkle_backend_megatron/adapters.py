"""LoRA adapters on a ``MegatronModel``: adding, removing, activating and gathering them.

The adapter layers themselves (sharded like the base layers they hang under) are ``lora.py``'s ``MegatronLora``;
this is the model side the core's per-adapter training state calls.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from twinkle_core.errors import ConfigError


class MegatronAdaptersMixin:
    """The core's adapter hooks of a ``MegatronModel``, on ``lora.py``'s ``MegatronLora``."""

    def attach_adapter(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        from twinkle_backend_megatron.lora import MegatronLora

        if self.strategy.options["sequence_parallel"]:
            raise ConfigError("LoRA adapters with sequence_parallel=True are not supported yet")
        if self._lora is None:
            for p in self.module.parameters():  # the base is frozen once it carries adapters (as PEFT does)
                p.requires_grad_(False)
            self._lora = MegatronLora(self.chunks, self.spec, self.seed)
        self._adapters_config[adapter_name] = self._lora.add(adapter_name, config)
        self.module.to(self.device)

    def detach_adapter(self, adapter_name: str) -> None:
        self._lora.remove(adapter_name)
        self._adapters_config.pop(adapter_name, None)

    @contextlib.contextmanager
    def activate_adapter(self, adapter_name: str | None) -> Any:
        if self._lora is None:
            yield
            return
        previous = self._lora.active.name
        self._lora.active.name = adapter_name
        try:
            yield
        finally:
            self._lora.active.name = previous

    def deactivate_adapters(self) -> Any:
        # the LoRA hooks (lora.py) add nothing while no adapter is active; the previous one is restored after
        return self.activate_adapter(None)

    def adapter_parameter_names(self, adapter_name: str) -> list[str]:
        return self._lora.parameter_names(adapter_name)

    def _adapter_state_dict(self, adapter_name: str) -> dict[str, torch.Tensor]:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        out = self._lora.full_state_dict(adapter_name)
        if self.pp_size > 1:
            gathered: list[Any] = [None] * self.pp_size
            dist.all_gather_object(gathered, out, group=ps.get_pipeline_model_parallel_group())
            out = {k: v for part in gathered for k, v in part.items()}
        return dict(sorted(out.items()))
