"""``MultiLoraTransformersModel``: many tenants' LoRA adapters on one shared, frozen base model.

Each tenant (adapter) owns its LoRA config, optimizer, scheduler, loss, gradient-accumulation count
and step counter (the core's per-adapter ``TrainState``). Tenants can be added and removed while
the process runs. Isolation: only the active tenant's weights receive gradients, each optimizer
holds only its tenant's parameters, and a non-finite gradient skips that tenant's step — so
training, a NaN or a bad batch of tenant A never changes tenant B.

The tenant policy (rank and tenant limits, removal, ``tenants()``) is the core's
:class:`~twinkle_core.model.multi_tenant.MultiTenantMixin`; this class adds PEFT's LoRA config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from twinkle_backend_hf import adapters
from twinkle_backend_hf.model import TransformersModel
from twinkle_core.model.multi_tenant import MultiTenantMixin


class MultiLoraTransformersModel(MultiTenantMixin, TransformersModel):
    supported_strategies = ("single", "grad_allreduce")
    strategy_note = ("Tenants come and go at run time, while a data-parallel wrapper (ddp, fsdp) captures the parameter "
                     "set once: on several processes use 'grad_allreduce', which sums each step's gradients over the "
                     "ranks without wrapping the model.")

    _switch: adapters.AdapterSwitch | None = None
    _switch_wrapped: Any = None  # the wrapped module the switch was built for

    def tenant_lora_config(self, config: Any) -> Any:
        return adapters.to_peft_config(config)

    def lora_rank(self, lora_config: Any) -> int:
        return max([lora_config.r, *getattr(lora_config, "rank_pattern", {}).values()])

    # ------------------------------------------------------------------ tenant switching
    # Every tenant step switches adapters, so the switch must not walk the model (see AdapterSwitch).
    def attach_adapter(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        self._switch = None
        super().attach_adapter(adapter_name, config, **kwargs)

    def detach_adapter(self, adapter_name: str) -> None:
        self._switch = None
        super().detach_adapter(adapter_name)

    @contextlib.contextmanager
    def activate_adapter(self, adapter_name: str | None) -> Iterator[None]:
        if adapter_name is not None:
            wrapped = self.wrapped  # wrap first: a strategy may replace the parameters the switch records
            switch = self._switch
            if switch is None or self._switch_wrapped is not wrapped or not switch.is_current(self.module):
                switch = self._switch = adapters.AdapterSwitch(self.module)
                self._switch_wrapped = wrapped
            switch.activate(adapter_name)
        yield
