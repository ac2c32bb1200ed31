"""The multi-tenant policy of ``MultiTenantMixin``, checked on the core's reference backend."""

from __future__ import annotations

from typing import Any

import pytest

from twinkle_core.errors import ConfigError
from twinkle_core.model.multi_tenant import MultiTenantMixin
from twinkle_core.testing.conformance import LORA_CONFIG, make_batch
from twinkle_core.testing.reference import ReferenceModel


class MultiTenantReference(MultiTenantMixin, ReferenceModel):
    """The two backend hooks, as a backend would write them."""

    def tenant_lora_config(self, config: Any) -> dict[str, Any]:
        return dict(config)

    def lora_rank(self, lora_config: dict[str, Any]) -> int:
        return int(lora_config.get("r", 4))


def lora(r: int = 4) -> dict[str, Any]:
    return {**LORA_CONFIG, "r": r, "lora_alpha": 2 * r}


def make(**options: Any) -> MultiTenantReference:
    return MultiTenantReference(seed=0, max_lora_rank=8, **options)


def test_the_shared_base_is_frozen():
    model = make()
    assert not any(p.requires_grad for p in model.module.parameters())


def test_rank_limit_counts_the_largest_rank():
    model = make()
    model.add_adapter_to_model("at_limit", lora(8))
    with pytest.raises(ConfigError, match=r"tenant 'big' asks for LoRA rank 16, above max_lora_rank=8"):
        model.add_adapter_to_model("big", lora(16))
    assert model.tenants() == ["at_limit"]


def test_tenant_limit_until_one_is_removed():
    model = make(max_tenants=2)
    model.add_adapter_to_model("a", lora())
    model.add_adapter_to_model("b", lora())
    with pytest.raises(ConfigError, match=r"already 2 tenants \(max_tenants=2\)"):
        model.add_adapter_to_model("c", lora())
    model.remove_adapter("a")
    model.add_adapter_to_model("c", lora())
    assert model.tenants() == ["b", "c"]


def test_no_tenant_limit_by_default():
    model = make()
    for i in range(5):
        model.add_adapter_to_model(f"t{i}", lora())
    assert model.tenants() == [f"t{i}" for i in range(5)]


def test_removal_drops_the_tenant_its_weights_and_its_optimizer():
    model = make()
    model.add_adapter_to_model("a", lora())
    model.add_adapter_to_model("b", lora())
    model.set_optimizer("AdamW", lr=1e-2, adapter_name="a")
    model.set_lr_scheduler("cosine", num_training_steps=4, adapter_name="a")
    model.forward_backward(inputs=make_batch(0), adapter_name="a")
    model.clip_grad_and_step(adapter_name="a")
    state = model._states["a"]
    model.remove_adapter("a")
    assert state.optimizer is None and state.scheduler is None
    assert model.tenants() == ["b"]
    names = [name for name, _ in model.module.named_parameters()]
    assert not [n for n in names if n.endswith((".lora_A.a", ".lora_B.a"))]
    assert [n for n in names if n.endswith((".lora_A.b", ".lora_B.b"))]
    with pytest.raises(ConfigError, match="no adapter named 'a'"):
        model.remove_adapter("a")


def test_train_configs_list_tenants_and_rank_limit():
    model = make()
    model.add_adapter_to_model("b", lora())
    model.add_adapter_to_model("a", lora())
    configs = model.get_train_configs(adapter_name="a")
    assert configs["tenants"] == ["a", "b"] and configs["max_lora_rank"] == 8
    assert configs["adapter_name"] == "a"


def test_a_backend_without_the_hooks_cannot_be_built():
    class Incomplete(MultiTenantMixin, ReferenceModel):
        pass

    with pytest.raises(TypeError, match="lora_rank"):
        Incomplete(seed=0)
