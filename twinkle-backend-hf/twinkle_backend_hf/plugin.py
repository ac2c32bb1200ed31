"""Registrations of the Hugging Face backend (entry point ``twinkle: hf``)."""

from __future__ import annotations

from twinkle_core import ConformanceTarget, ModelRecord, StrategyRecord, hookimpl

_PKG = "twinkle_backend_hf"


@hookimpl
def twinkle_register_models():
    yield ModelRecord("TransformersModel", f"{_PKG}.model:TransformersModel", "any HF causal LM / encoder")
    yield ModelRecord("MultiLoraTransformersModel", f"{_PKG}.multi_lora:MultiLoraTransformersModel",
                      "many tenants' LoRA adapters on one base")


@hookimpl
def twinkle_register_strategies():
    yield StrategyRecord("ddp", f"{_PKG}.strategies.ddp:DDPStrategy", "torch DistributedDataParallel")
    yield StrategyRecord("native_fsdp", f"{_PKG}.strategies.fsdp:NativeFSDPStrategy", "FSDP2 fully_shard + DCP")
    yield StrategyRecord("accelerate", f"{_PKG}.strategies.accelerate:AccelerateStrategy", "FSDP via Accelerate")
    yield StrategyRecord("deepspeed", f"{_PKG}.strategies.deepspeed:DeepSpeedStrategy", "DeepSpeed ZeRO 1/2/3")
    yield StrategyRecord("ulysses", f"{_PKG}.sequence_parallel.strategy:SequenceParallelStrategy",
                         "Ulysses sequence parallel (mesh.sp) over DDP (mesh.dp)")


@hookimpl
def twinkle_register_conformance_targets():
    factory = f"{_PKG}.testing:make_tiny_model"
    yield ConformanceTarget("hf", factory)
    yield ConformanceTarget("hf-ddp", factory, options={"strategy": "ddp"}, world_size=2)
    yield ConformanceTarget("hf-fsdp", factory, options={"strategy": "native_fsdp"}, world_size=2)
    yield ConformanceTarget("hf-zero2", factory, options={"strategy": "deepspeed",
                                                          "strategy_options": {"stage": 2}}, world_size=2)
    # the persistence threshold 0 makes ZeRO-3 partition even the tiny model's small weights
    zero3 = {"stage": 3, "config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}
    yield ConformanceTarget("hf-zero3", factory, options={"strategy": "deepspeed", "strategy_options": zero3},
                            world_size=2)
