"""``MultiLoraMegatronModel``: many tenants' LoRA adapters on one shared, frozen Megatron base model.

Each tenant (adapter) owns its LoRA config, optimizer, scheduler, loss, gradient-accumulation count and
step counter (the core's per-adapter ``TrainState``); tenants can be added and removed while the
process runs. The base may be sharded by TP / PP like any ``MegatronModel`` (the LoRA weights are
sharded with it, see ``lora.py``). Isolation: only the active tenant's LoRA layers run in a forward,
each optimizer holds only its tenant's parameters, gradients are synchronised and clipped over that
tenant's parameters only, and a non-finite gradient skips that tenant's step - so training, a NaN
or a bad batch of tenant A never changes tenant B.
"""

from __future__ import annotations

from typing import Any

from twinkle_backend_megatron.lora import to_lora_config
from twinkle_backend_megatron.model import MegatronModel
from twinkle_core.errors import ConfigError


class MultiLoraMegatronModel(MegatronModel):
    def __init__(self, *, max_lora_rank: int = 64, max_tenants: int | None = None, **kwargs: Any) -> None:
        self.max_lora_rank = max_lora_rank
        self.max_tenants = max_tenants
        super().__init__(**kwargs)
        for p in self.module.parameters():
            p.requires_grad_(False)

    def add_adapter_to_model(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        lora = to_lora_config(config)
        if lora.r > self.max_lora_rank:
            raise ConfigError(f"tenant {adapter_name!r} asks for LoRA rank {lora.r}, above max_lora_rank="
                              f"{self.max_lora_rank}; lower r or build the model with a larger max_lora_rank")
        if self.max_tenants is not None and len(self._adapters) >= self.max_tenants:
            raise ConfigError(f"already {len(self._adapters)} tenants (max_tenants={self.max_tenants}); "
                              f"remove one with remove_adapter first")
        super().add_adapter_to_model(adapter_name, lora, **kwargs)

    def tenants(self) -> list[str]:
        return sorted(self._adapters)

    def _remove_adapter(self, adapter_name: str) -> None:
        state = self._states[adapter_name]
        state.optimizer = state.scheduler = None  # drop the tenant's optimizer state with it
        super()._remove_adapter(adapter_name)

    def get_train_configs(self, *, adapter_name: str | None = None) -> dict[str, Any]:
        return {**super().get_train_configs(adapter_name=adapter_name), "tenants": self.tenants(),
                "max_lora_rank": self.max_lora_rank}
