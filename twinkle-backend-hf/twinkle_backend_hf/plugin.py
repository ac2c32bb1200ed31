"""Registrations of the Hugging Face backend (entry point ``twinkle: hf``)."""

from __future__ import annotations

from twinkle_core import ConformanceTarget, ModelRecord, StrategyRecord, hookimpl
from twinkle_core.records import CommandRecord

_PKG = "twinkle_backend_hf"


@hookimpl
def twinkle_register_models():
    yield ModelRecord("TransformersModel", f"{_PKG}.model:TransformersModel", "any HF causal LM / encoder")
    yield ModelRecord("MultiLoraTransformersModel", f"{_PKG}.multi_lora:MultiLoraTransformersModel",
                      "many tenants' LoRA adapters on one base")


@hookimpl
def twinkle_register_strategies():
    yield StrategyRecord("ddp", f"{_PKG}.strategies.ddp:DDPStrategy", "torch DistributedDataParallel")
    yield StrategyRecord("grad_allreduce", f"{_PKG}.strategies.grad_allreduce:GradAllReduceStrategy",
                         "data parallel without a wrapper: gradients summed over the ranks once per step")
    yield StrategyRecord("native_fsdp", f"{_PKG}.strategies.fsdp:NativeFSDPStrategy", "FSDP2 fully_shard + DCP")
    yield StrategyRecord("accelerate", f"{_PKG}.strategies.accelerate:AccelerateStrategy", "FSDP via Accelerate")
    yield StrategyRecord("deepspeed", f"{_PKG}.strategies.deepspeed:DeepSpeedStrategy", "DeepSpeed ZeRO 1/2/3")
    yield StrategyRecord("ulysses", f"{_PKG}.sequence_parallel.strategy:SequenceParallelStrategy",
                         "Ulysses (mesh.sp) x ring (mesh.cp) context parallel over DDP or FSDP2 (mesh.dp / mesh.fsdp)")


@hookimpl
def twinkle_select_default_strategy(model_class, world_size):
    # the spec's default for more than one process is Accelerate-managed FSDP; it wraps any torch network, so it
    # answers for every model class that does not name its own strategies (those the core answers for)
    if world_size > 1 and not getattr(model_class, "supported_strategies", None):
        return "accelerate"
    return None


@hookimpl
def twinkle_register_commands():
    # these load checkpoints with transformers and peft, which this distribution depends on
    yield CommandRecord("chat", f"{_PKG}.commands.chat:ChatCommand", "chat with a checkpoint in the terminal")
    yield CommandRecord("export", f"{_PKG}.commands.export:ExportCommand",
                        "write a plain Hugging Face model directory (merging a LoRA adapter), optionally push it "
                        "to the Hub")
    yield CommandRecord("eval", f"{_PKG}.commands.evaluate:EvalCommand",
                        "loss / perplexity / exact match on a data set (and lm-eval tasks with --tasks)")
    yield CommandRecord("serve-model", f"{_PKG}.commands.serve_model:ServeModelCommand",
                        "serve a checkpoint over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions)")


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
