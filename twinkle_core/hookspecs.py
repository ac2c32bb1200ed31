"""Every Twinkle extension point, as pluggy hook specifications.

Registration hooks (``twinkle_register_*``) return an iterable of typed records that point at
implementations lazily; every plugin's records are collected. Each one belongs to a plugin kind
declared in :mod:`twinkle_core.records` (the record class names its ``register_hook``); a new kind
needs its record class there and its specification here, and ``tests/test_plugin_kinds.py`` fails
until both exist. Selection hooks (``twinkle_select_*``) use ``firstresult=True``: the first plugin
that answers wins.

A plugin is a module (or object) with functions marked ``@twinkle_core.hookimpl``, exposed
through the ``twinkle`` entry-point group::

    [project.entry-points.twinkle]
    my_plugin = "my_package.twinkle_plugin"
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from twinkle_core.records import (
        AcceleratorRecord,
        ConformanceTarget,
        KernelRecord,
        LossRecord,
        MetricRecord,
        ModelRecord,
        OptimizerRecord,
        PrecisionRecord,
        RewardRecord,
        SamplerRecord,
        SchedulerRecord,
        SourceRecord,
        StrategyRecord,
        TaskRecord,
        TrackerRecord,
    )

PROJECT_NAME = "twinkle"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def twinkle_register_models() -> Iterable[ModelRecord]:
    """Register ``TwinkleModel`` classes.

    Example::

        @hookimpl
        def twinkle_register_models():
            yield ModelRecord("TransformersModel", "twinkle_backend_hf.model:TransformersModel")
    """


@hookspec
def twinkle_register_strategies() -> Iterable[StrategyRecord]:
    """Register parallel strategies by name.

    Example::

        @hookimpl
        def twinkle_register_strategies():
            yield StrategyRecord("ddp", "twinkle_backend_hf.strategies.ddp:DDPStrategy")
    """


@hookspec
def twinkle_register_precisions() -> Iterable[PrecisionRecord]:
    """Register precision modes (``no``, ``bf16``, ``fp16``, ``fp8``).

    Example::

        @hookimpl
        def twinkle_register_precisions():
            yield PrecisionRecord("fp8", "my_pkg.precision:TransformerEngineFP8")
    """


@hookspec
def twinkle_register_losses() -> Iterable[LossRecord]:
    """Register losses.

    Example::

        @hookimpl
        def twinkle_register_losses():
            yield LossRecord("infonce", "twinkle_embedding.loss:InfoNCELoss")
    """


@hookspec
def twinkle_register_tasks() -> Iterable[TaskRecord]:
    """Register tasks (``causal_lm``, ``embedding``, ``vlm`` ...).

    Example::

        @hookimpl
        def twinkle_register_tasks():
            yield TaskRecord("embedding", "twinkle_embedding.task:EmbeddingTask")
    """


@hookspec
def twinkle_register_sources() -> Iterable[SourceRecord]:
    """Register model sources; ``name`` is the URI scheme they handle (``ms``, ``hf``).

    Example::

        @hookimpl
        def twinkle_register_sources():
            yield SourceRecord("s3", "my_pkg.sources:S3Source")
    """


@hookspec(firstresult=True)
def twinkle_select_source(uri: str, sources: dict[str, SourceRecord]) -> SourceRecord | None:
    """Pick the source that resolves ``uri``; return ``None`` to let another plugin decide.

    The core answers last, by URI scheme (``ms://``, ``hf://``) or as a local path.

    Example::

        @hookimpl(tryfirst=True)
        def twinkle_select_source(uri, sources):
            if uri.startswith("s3://"):
                return sources["s3"]
    """


@hookspec
def twinkle_register_accelerators() -> Iterable[AcceleratorRecord]:
    """Register accelerators (device type + collective backend).

    Example::

        @hookimpl
        def twinkle_register_accelerators():
            yield AcceleratorRecord("npu", "twinkle_backend_npu.accelerator:NPUAccelerator")
    """


@hookspec(firstresult=True)
def twinkle_select_accelerator(accelerators: dict[str, AcceleratorRecord]) -> AcceleratorRecord | None:
    """Return the accelerator present on this machine, or ``None``. ``cpu`` answers last.

    Example::

        @hookimpl
        def twinkle_select_accelerator(accelerators):
            import importlib.util
            if importlib.util.find_spec("torch_npu"):
                return accelerators["npu"]
    """


@hookspec
def twinkle_register_optimizers() -> Iterable[OptimizerRecord]:
    """Register optimizers by name for ``set_optimizer("AdamW", lr=...)``.

    Example::

        @hookimpl
        def twinkle_register_optimizers():
            yield OptimizerRecord("Lion", "my_pkg.optim:Lion")
    """


@hookspec
def twinkle_register_schedulers() -> Iterable[SchedulerRecord]:
    """Register learning-rate schedulers by name for ``set_lr_scheduler("cosine", ...)``.

    ``impl`` is a callable ``(optimizer, **kwargs) -> torch.optim.lr_scheduler.LRScheduler``.

    Example::

        @hookimpl
        def twinkle_register_schedulers():
            yield SchedulerRecord("wsd", "my_pkg.sched:warmup_stable_decay")
    """


@hookspec
def twinkle_register_metrics() -> Iterable[MetricRecord]:
    """Register metrics by name for ``add_metric("accuracy")``.

    Example::

        @hookimpl
        def twinkle_register_metrics():
            yield MetricRecord("perplexity", "my_pkg.metrics:Perplexity")
    """


@hookspec
def twinkle_register_samplers() -> Iterable[SamplerRecord]:
    """Register samplers for online RL: ``impl`` is a :class:`twinkle_core.sampling.Sampler` subclass.

    A sampler generates ``n`` completions per prompt with per-token log-probs and declares how the
    trainer's new weights reach it (``weight_sync``: read in process, or pushed to it).

    Example::

        @hookimpl
        def twinkle_register_samplers():
            yield SamplerRecord("vllm", "my_pkg.vllm_sampler:VLLMSampler")
    """


@hookspec
def twinkle_register_rewards() -> Iterable[RewardRecord]:
    """Register reward functions by name for online RL (``task_options.rewards`` in a recipe).

    ``impl`` is a callable ``(prompts, completions, **row_fields) -> list[float]`` or a
    :class:`twinkle_core.rewards.Reward` subclass (constructed with the recipe's options).

    Example::

        @hookimpl
        def twinkle_register_rewards():
            yield RewardRecord("json_valid", "my_pkg.rewards:json_valid")
    """


@hookspec
def twinkle_register_trackers() -> Iterable[TrackerRecord]:
    """Register experiment trackers by name for ``train.report_to`` in a recipe.

    ``impl`` is a :class:`twinkle_core.trackers.Tracker` subclass, constructed with the recipe's
    ``train.tracker_options[name]``; it runs on the main process only. Import the tracking library
    inside its methods (not at module level) and list it in ``requires`` so a missing install is
    reported when the recipe is validated.

    Example::

        @hookimpl
        def twinkle_register_trackers():
            yield TrackerRecord("comet", "my_pkg.tracking:CometTracker", "Comet ML (pip install comet_ml)")
    """


@hookspec
def twinkle_register_kernels() -> Iterable[KernelRecord]:
    """Register fused kernels: replacements the model applies for the active accelerator when it is built.

    A recipe turns one off with ``model.options.kernels: {npu_rms_norm: false}`` (all: ``kernels: false``);
    :mod:`twinkle_core.kernels` describes the ``replaces`` forms and how a CUDA plugin registers the same way.

    Example::

        @hookimpl
        def twinkle_register_kernels():
            yield KernelRecord("npu_rms_norm", "twinkle_backend_npu.kernels.rms_norm:forward",
                               accelerators=("npu",),
                               replaces=("module:transformers.models.llama.modeling_llama:LlamaRMSNorm",))
    """


@hookspec
def twinkle_register_conformance_targets() -> Iterable[ConformanceTarget]:
    """Register factories the conformance suite (``pytest --twinkle-backend NAME``) runs against.

    Example::

        @hookimpl
        def twinkle_register_conformance_targets():
            yield ConformanceTarget("hf", "twinkle_backend_hf.testing:make_tiny_model")
            yield ConformanceTarget("hf-ddp", "twinkle_backend_hf.testing:make_tiny_model",
                                    options={"strategy": "ddp"}, world_size=2)
    """
