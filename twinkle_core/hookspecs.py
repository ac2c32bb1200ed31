"""Every Twinkle extension point, in one index: the hooks here, the behaviour seams in :mod:`twinkle_core.contracts`.

The hooks are grouped by lifecycle phase, as in pytest's ``hookspec.py``; each docstring says who calls
the hook and when.

1. **Registration** (``twinkle_register_*``), called by :class:`twinkle_core.plugins.TwinklePlugins` the first
   time a kind is looked up (``twinkle plugins``, recipe validation, a model's constructor): each returns an
   iterable of typed records that point at implementations lazily; every plugin's records are collected.
   Each belongs to a plugin kind declared in :mod:`twinkle_core.records` (the record class names its
   ``register_hook``); a new kind needs its record class there and its specification here, and
   ``tests/test_plugin_kinds.py`` fails until both exist.
2. **Selection** (``twinkle_select_*``, ``firstresult=True``): the first plugin that answers wins; the core
   answers last (``trylast``) with its built-in rule, so a plugin that returns ``None`` defers.
3. **Behaviour** (build, step, evaluate, checkpoint, export, sample): not hooks but the methods the core calls
   on a registered implementation (``Task.adapter_config``, ``Task.process_outputs``,
   ``Strategy.forward_context``, ``TorchTwinkleModel.build_network`` ...). They are listed, with who calls
   each and when and a one-line example, in :data:`twinkle_core.contracts.SEAMS`
   (``python -m twinkle_core.contracts`` prints the table as Markdown).

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
        CommandRecord,
        ConformanceTarget,
        EnvironmentRecord,
        KernelRecord,
        LossRecord,
        MetricRecord,
        ModelRecord,
        OptimizerRecord,
        PrecisionRecord,
        RewardRecord,
        RuntimeRecord,
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


# ====================================================================== 1. registration
# Called by TwinklePlugins.records(kind) the first time a kind is looked up; a hook that raises is
# reported and its plugin skipped (see twinkle_core.plugins).


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


@hookspec
def twinkle_register_accelerators() -> Iterable[AcceleratorRecord]:
    """Register accelerators (device type + collective backend).

    Example::

        @hookimpl
        def twinkle_register_accelerators():
            yield AcceleratorRecord("npu", "twinkle_backend_npu.accelerator:NPUAccelerator")
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
def twinkle_register_environments() -> Iterable[EnvironmentRecord]:
    """Register agent environments by name for multi-turn online RL (``task_options.environment.name``).

    ``impl`` is a :class:`twinkle_core.environments.Environment` subclass, built with the recipe's
    ``environment.options`` once per trajectory; it is reset with the prompt row's fields and answers each model
    turn (its parsed tool calls) with an observation, a reward and whether the episode is over.

    Example::

        @hookimpl
        def twinkle_register_environments():
            yield EnvironmentRecord("sql", "my_pkg.sql_env:SQLEnvironment", "run the model's SQL on a test db")
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


@hookspec
def twinkle_register_commands() -> Iterable[CommandRecord]:
    """Register ``twinkle`` sub-commands. The core registers its own (``train``, ``plugins``, ``plot``) the same
    way; a backend registers those that need its libraries (``twinkle-backend-hf``: ``chat``, ``export``,
    ``eval``).

    Called by the ``twinkle`` command each time it builds its parser; ``impl`` names a
    :class:`twinkle_core.commands.Command` subclass whose module imports nothing heavy at import time.

    Example::

        @hookimpl
        def twinkle_register_commands():
            yield CommandRecord("serve", "my_pkg.serve:ServeCommand", "serve a checkpoint over HTTP")
    """


@hookspec
def twinkle_register_runtimes() -> Iterable[RuntimeRecord]:
    """Register runtimes that run a training job's ranks (``twinkle train --runtime NAME``). The core registers
    ``torchrun``; ``twinkle-ray`` registers ``ray``.

    Called when ``twinkle train`` builds its parser (each runtime adds its own options) and when it launches;
    ``impl`` names a :class:`twinkle_core.launch.Runtime` subclass whose module imports nothing heavy at import
    time.

    Example::

        @hookimpl
        def twinkle_register_runtimes():
            yield RuntimeRecord("slurm", "my_pkg.slurm:SlurmRuntime", "one rank per Slurm task")
    """


# ====================================================================== 2. selection
# firstresult=True: the first non-None answer wins; the core's own answer comes last (trylast).


@hookspec(firstresult=True)
def twinkle_select_source(uri: str, sources: dict[str, SourceRecord]) -> SourceRecord | None:
    """Pick the source that resolves ``uri``; return ``None`` to let another plugin decide.

    Called by :func:`twinkle_core.sources.resolve.resolve_model` when a model's ``model_id`` (or a
    tokenizer's) is turned into a local directory, before the backend builds the network.
    The core answers last, by URI scheme (``ms://``, ``hf://``) or as a local path.

    Example::

        @hookimpl(tryfirst=True)
        def twinkle_select_source(uri, sources):
            if uri.startswith("s3://"):
                return sources["s3"]
    """


@hookspec(firstresult=True)
def twinkle_select_accelerator(accelerators: dict[str, AcceleratorRecord]) -> AcceleratorRecord | None:
    """Return the accelerator present on this machine, or ``None``. ``cpu`` answers last.

    Called by :func:`twinkle_core.accelerator.current_accelerator` (once per process, unless
    ``TWINKLE_ACCELERATOR`` forces one) and by ``twinkle plugins`` to mark the active accelerator.

    Example::

        @hookimpl
        def twinkle_select_accelerator(accelerators):
            import importlib.util
            if importlib.util.find_spec("torch_npu"):
                return accelerators["npu"]
    """


@hookspec(firstresult=True)
def twinkle_select_default_strategy(model_class: type | None, world_size: int) -> str | None:
    """The strategy a job of ``world_size`` processes gets for ``model_class`` when it names none; ``None``
    lets another plugin (and finally the core) decide.

    Called by :func:`twinkle_core.mesh.default_strategy`: in a model's constructor built without ``strategy=``,
    and when ``twinkle train`` validates a recipe without ``strategy.name``. ``model_class`` is ``None`` when
    the caller has no model class yet. The core answers last: the first of the class's declared
    ``supported_strategies``, else ``single`` for one process; with more processes and no answer it is an
    error naming the distributions to install.

    Example::

        @hookimpl
        def twinkle_select_default_strategy(model_class, world_size):
            if model_class is not None and issubclass(model_class, MyShardedModel):
                return "my_sharded"
    """
