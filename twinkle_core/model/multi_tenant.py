"""``MultiTenantMixin``: the multi-tenant LoRA policy, written once for every backend.

Many tenants (adapters) share one frozen base model. Each owns its LoRA config and the core's
per-adapter ``TrainState`` (optimizer, scheduler, loss, accumulation and step counters); tenants come
and go while the process runs. The mixin holds the policy: the base is frozen, a tenant's LoRA rank
may not exceed ``max_lora_rank``, at most ``max_tenants`` tenants exist at once, removing a tenant
drops its optimizer and scheduler, ``tenants()`` lists them, and ``get_train_configs`` reports both.

A backend supplies only what is its own: turning a user's config into its LoRA config, and reading
the largest rank from it. Deleting an adapter from the network is the backend's ``detach_adapter``,
which the mixin calls. Put the mixin first, so that its methods wrap the backend's::

    class MultiLoraMyModel(MultiTenantMixin, MyModel):
        def tenant_lora_config(self, config):
            return to_my_lora_config(config)

        def lora_rank(self, lora_config):
            return max([lora_config.r, *lora_config.rank_pattern.values()])

    model = MultiLoraMyModel(config=..., max_lora_rank=16, max_tenants=8)
    model.add_adapter_to_model("alice", {"r": 8, "target_modules": ["q_proj", "v_proj"]})
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import TYPE_CHECKING, Any

from twinkle_core.errors import ConfigError

if TYPE_CHECKING:
    from twinkle_core.model.torch_model import TorchTwinkleModel

    _TenantBase = TorchTwinkleModel
else:
    _TenantBase = object


class MultiTenantMixin(_TenantBase, metaclass=ABCMeta):
    """Mix into a :class:`~twinkle_core.model.torch_model.TorchTwinkleModel` backend (listed first).

    ABCMeta makes a backend that forgets one of the two hooks fail when built, not when a tenant arrives.
    """

    def __init__(self, *, max_lora_rank: int = 64, max_tenants: int | None = None, **kwargs: Any) -> None:
        self.max_lora_rank = max_lora_rank
        self.max_tenants = max_tenants
        super().__init__(**kwargs)
        # the base is shared by every tenant, so no tenant may change it
        for p in self.module.parameters():
            p.requires_grad_(False)

    # ------------------------------------------------------------------ backend extension (public, abstract)
    @abstractmethod
    def tenant_lora_config(self, config: Any) -> Any:
        """The backend's LoRA config for a user's ``config`` (a dict or the backend's own config)."""

    @abstractmethod
    def lora_rank(self, lora_config: Any) -> int:
        """The largest rank ``lora_config`` asks for (per-module ranks included)."""

    # ------------------------------------------------------------------ policy
    def add_adapter_to_model(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        lora_config = self.tenant_lora_config(config)
        rank = self.lora_rank(lora_config)
        if rank > self.max_lora_rank:
            raise ConfigError(f"tenant {adapter_name!r} asks for LoRA rank {rank}, above max_lora_rank="
                              f"{self.max_lora_rank}; lower r or build the model with a larger max_lora_rank")
        if self.max_tenants is not None and len(self.adapter_states.configs) >= self.max_tenants:
            raise ConfigError(f"already {len(self.adapter_states.configs)} tenants (max_tenants={self.max_tenants}); "
                              f"remove one with remove_adapter first")
        super().add_adapter_to_model(adapter_name, lora_config, **kwargs)

    def tenants(self) -> list[str]:
        return sorted(self.adapter_states.configs)

    def detach_adapter(self, adapter_name: str) -> None:
        state = self.adapter_states.states[adapter_name]
        state.handle = state.scheduler = None  # drop the tenant's optimizer state with it
        super().detach_adapter(adapter_name)

    def get_train_configs(self, *, adapter_name: str | None = None) -> dict[str, Any]:
        return {**super().get_train_configs(adapter_name=adapter_name), "tenants": self.tenants(),
                "max_lora_rank": self.max_lora_rank}
