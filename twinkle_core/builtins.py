"""The core's own plugin: built-ins registered through the same hooks as any third-party plugin."""

from __future__ import annotations

from twinkle_core.hookspecs import hookimpl
from twinkle_core.records import (
    AcceleratorRecord,
    CommandRecord,
    LossRecord,
    MetricRecord,
    OptimizerRecord,
    PrecisionRecord,
    RuntimeRecord,
    SchedulerRecord,
    SourceRecord,
    StrategyRecord,
    TaskRecord,
    TrackerRecord,
)
from twinkle_core.sources.base import split_uri


@hookimpl
def twinkle_register_strategies():
    yield StrategyRecord("single", "twinkle_core.strategy:SingleProcessStrategy", "one process, no parallelism")


@hookimpl
def twinkle_register_precisions():
    yield PrecisionRecord("no", "twinkle_core.precision:FullPrecision", "fp32")
    yield PrecisionRecord("bf16", "twinkle_core.precision:BF16Precision", "bfloat16 autocast")
    yield PrecisionRecord("fp16", "twinkle_core.precision:FP16Precision", "float16 autocast + loss scaling")
    yield PrecisionRecord("fp8", "twinkle_core.precision:FP8Precision", "float8 linears (torchao), GPUs sm89+")


@hookimpl
def twinkle_register_losses():
    yield LossRecord("cross_entropy", "twinkle_core.loss.cross_entropy:CrossEntropyLoss")
    yield LossRecord("chunked_cross_entropy", "twinkle_core.loss.cross_entropy:ChunkedCrossEntropyLoss")
    yield LossRecord("gkd", "twinkle_core.loss.gkd:GKDLoss", "generalised JSD against a teacher")
    yield LossRecord("mse", "twinkle_core.loss.mse:MSELoss")


@hookimpl
def twinkle_register_tasks():
    yield TaskRecord("causal_lm", "twinkle_core.tasks.causal_lm:CausalLMTask", "pre-training and (multi-turn) SFT")


@hookimpl
def twinkle_register_sources():
    yield SourceRecord("local", "twinkle_core.sources.local:LocalSource", "a directory on disk")
    yield SourceRecord("hf", "twinkle_core.sources.hub:HuggingFaceSource", "hf://org/name (huggingface_hub)")
    yield SourceRecord("ms", "twinkle_core.sources.modelscope:ModelScopeSource", "ms://org/name (modelscope)")


@hookimpl(trylast=True)
def twinkle_select_source(uri, sources):
    return sources.get(split_uri(uri)[0])


@hookimpl
def twinkle_register_accelerators():
    yield AcceleratorRecord("cpu", "twinkle_core.accelerator:CPUAccelerator")
    yield AcceleratorRecord("cuda", "twinkle_core.accelerator:CUDAAccelerator")


@hookimpl(trylast=True)
def twinkle_select_accelerator(accelerators):
    for name in ("cuda", "cpu"):
        record = accelerators.get(name)
        if record is not None and record.load().is_available():
            return record
    return None


@hookimpl(trylast=True)
def twinkle_select_default_strategy(model_class, world_size):
    # a class that runs on named strategies only gets the first of them; one process needs no wrapper; the
    # distributed default belongs to a backend's plugin (twinkle-backend-hf answers "accelerate")
    declared = getattr(model_class, "supported_strategies", None)
    if declared:
        return declared[0]
    return "single" if world_size <= 1 else None


@hookimpl
def twinkle_register_optimizers():
    for name in ("AdamW", "Adam", "SGD", "Adagrad", "RMSprop"):
        yield OptimizerRecord(name, f"torch.optim:{name}")


@hookimpl
def twinkle_register_schedulers():
    for name in ("constant", "linear", "cosine"):
        yield SchedulerRecord(name, f"twinkle_core.optim:{name}")


@hookimpl
def twinkle_register_metrics():
    yield MetricRecord("loss", "twinkle_core.metrics:LossMetric")
    yield MetricRecord("accuracy", "twinkle_core.metrics:TokenAccuracy")


@hookimpl
def twinkle_register_trackers():
    yield TrackerRecord("tensorboard", "twinkle_core.trackers.tensorboard:TensorBoardTracker",
                        "TensorBoard scalars in output_dir/tensorboard (pip install tensorboard)")
    yield TrackerRecord("wandb", "twinkle_core.trackers.wandb:WandbTracker", "Weights & Biases (pip install wandb)")
    yield TrackerRecord("mlflow", "twinkle_core.trackers.mlflow:MLflowTracker", "MLflow (pip install mlflow)")
    yield TrackerRecord("swanlab", "twinkle_core.trackers.swanlab:SwanLabTracker", "SwanLab (pip install swanlab)")


@hookimpl
def twinkle_register_commands():
    # the core's commands need nothing but twinkle-core; chat / export / eval come with twinkle-backend-hf
    yield CommandRecord("plugins", "twinkle_core.commands.plugins:PluginsCommand",
                        "list installed plugins and what they register")
    yield CommandRecord("train", "twinkle_core.commands.train:TrainCommand", "train from a YAML recipe")
    yield CommandRecord("plot", "twinkle_core.commands.plot:PlotCommand",
                        "draw a run's loss curves (logs.jsonl) as a PNG")
    yield CommandRecord("data", "twinkle_core.commands.data:DataCommand",
                        "preview a recipe's samples and trained tokens")


@hookimpl
def twinkle_register_runtimes():
    yield RuntimeRecord("torchrun", "twinkle_core.launch:TorchrunRuntime",
                        "torch.distributed.run: --nproc-per-node processes on this node, --nnodes nodes")
