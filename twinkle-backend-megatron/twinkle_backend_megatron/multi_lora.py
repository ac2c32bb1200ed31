"""``MultiLoraMegatronModel``: many tenants' LoRA adapters on one shared, frozen Megatron base model.

Each tenant (adapter) owns its LoRA config, optimizer, scheduler, loss, gradient-accumulation count and
step counter (the core's per-adapter ``TrainState``); tenants can be added and removed while the
process runs. The base may be sharded by TP / PP like any ``MegatronModel`` (the LoRA weights are
sharded with it, see ``lora.py``). Isolation: only the active tenant's LoRA layers run in a forward,
each optimizer holds only its tenant's parameters, gradients are synchronised and clipped over that
tenant's parameters only, and a non-finite gradient skips that tenant's step - so training, a NaN
or a bad batch of tenant A never changes tenant B.

The tenant policy (rank and tenant limits, removal, ``tenants()``) is the core's
:class:`~twinkle_core.model.multi_tenant.MultiTenantMixin`; this class adds the Megatron LoRA config.
"""

from __future__ import annotations

from typing import Any

from twinkle_backend_megatron.lora import to_lora_config
from twinkle_backend_megatron.model import MegatronModel
from twinkle_core.model.multi_tenant import MultiTenantMixin


class MultiLoraMegatronModel(MultiTenantMixin, MegatronModel):
    def tenant_lora_config(self, config: Any) -> Any:
        return to_lora_config(config)

    def lora_rank(self, lora_config: Any) -> int:
        return lora_config.r
