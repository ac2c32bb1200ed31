"""Registrations of the Megatron backend (entry point ``twinkle: megatron``)."""

from __future__ import annotations

import sys

from twinkle_core import ConformanceTarget, ModelRecord, StrategyRecord, hookimpl

_PKG = "twinkle_backend_megatron"


@hookimpl
def twinkle_register_models():
    yield ModelRecord("MegatronModel", f"{_PKG}.model:MegatronModel",
                      "Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE on megatron-core (TP / PP / VPP / DP / EP)")
    yield ModelRecord("MultiLoraMegatronModel", f"{_PKG}.multi_lora:MultiLoraMegatronModel",
                      "many tenants' LoRA adapters on one (TP / PP sharded) Megatron base")


@hookimpl
def twinkle_register_strategies():
    yield StrategyRecord("megatron", f"{_PKG}.strategy:MegatronStrategy",
                         "megatron-core tensor / pipeline / expert parallelism + data parallelism")


@hookimpl
def twinkle_select_default_strategy(model_class, world_size):
    # a MegatronModel runs on megatron-core's parallelism only, on one process as on many; the check reads the
    # class without importing megatron-core (a subclass exists only once its module is imported)
    module = sys.modules.get(f"{_PKG}.model")
    if module is not None and isinstance(model_class, type) and issubclass(model_class, module.MegatronModel):
        return "megatron"
    return None


@hookimpl
def twinkle_register_conformance_targets():
    factory = f"{_PKG}.testing:make_tiny_model"
    yield ConformanceTarget("megatron", factory)
    yield ConformanceTarget("megatron-tp2", factory, options={"mesh": {"tp": 2}}, world_size=2)
    yield ConformanceTarget("megatron-dp2", factory, options={"mesh": {"dp": 2}}, world_size=2)
    # Adam / AdamW, full fine-tuning only: run the suite's tests of that (see tests/test_distributed.py)
    yield ConformanceTarget("megatron-dp2-distopt", factory, world_size=2,
                            options={"mesh": {"dp": 2}, "strategy_options": {"distributed_optimizer": True}})
