"""Typed records that plugins yield from registration hooks.

A record names an implementation by reference (``"package.module:Class"``) so that listing
plugins never imports torch or a backend. ``record.load()`` imports it on first use.

This module is the one declaration of the plugin kinds: each record class carries its ``kind`` and
the ``register_hook`` that yields it, and ``RECORD_TYPES`` lists them. ``KINDS``, the plugin
manager's look-ups and ``twinkle plugins`` are derived from it; ``hookspecs.py`` holds the matching
(documented) hook specifications, and ``tests/test_plugin_kinds.py`` keeps the two in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from twinkle_core.lazy import import_object


@dataclass(frozen=True)
class PluginRecord:
    name: str
    impl: str
    description: str = ""
    kind: ClassVar[str] = "plugin"
    register_hook: ClassVar[str] = ""  # the ``twinkle_register_*`` hook that yields records of this kind

    def load(self) -> Any:
        return import_object(self.impl)


@dataclass(frozen=True)
class ModelRecord(PluginRecord):
    """A ``TwinkleModel`` implementation, e.g. ``TransformersModel``."""

    kind: ClassVar[str] = "model"
    register_hook: ClassVar[str] = "twinkle_register_models"


@dataclass(frozen=True)
class StrategyRecord(PluginRecord):
    """A parallel ``Strategy`` (``ddp``, ``native_fsdp``, ``deepspeed`` ...)."""

    kind: ClassVar[str] = "strategy"
    register_hook: ClassVar[str] = "twinkle_register_strategies"


@dataclass(frozen=True)
class PrecisionRecord(PluginRecord):
    """A ``Precision`` mode: ``no``, ``bf16``, ``fp16``, ``fp8``."""

    kind: ClassVar[str] = "precision"
    register_hook: ClassVar[str] = "twinkle_register_precisions"


@dataclass(frozen=True)
class LossRecord(PluginRecord):
    """A ``Loss`` class."""

    kind: ClassVar[str] = "loss"
    register_hook: ClassVar[str] = "twinkle_register_losses"


@dataclass(frozen=True)
class TaskRecord(PluginRecord):
    """A ``Task``: how rows become model inputs, which loss and metrics apply."""

    kind: ClassVar[str] = "task"
    register_hook: ClassVar[str] = "twinkle_register_tasks"


@dataclass(frozen=True)
class SourceRecord(PluginRecord):
    """A ``ModelSource`` handling URIs of one scheme (``ms://``, ``hf://``, ``local``)."""

    kind: ClassVar[str] = "source"
    register_hook: ClassVar[str] = "twinkle_register_sources"


@dataclass(frozen=True)
class AcceleratorRecord(PluginRecord):
    """An ``Accelerator`` (``cpu``, ``cuda``, ``npu``): device type and collective backend."""

    kind: ClassVar[str] = "accelerator"
    register_hook: ClassVar[str] = "twinkle_register_accelerators"


@dataclass(frozen=True)
class OptimizerRecord(PluginRecord):
    """An optimizer class usable by name in ``set_optimizer("AdamW", lr=...)``."""

    kind: ClassVar[str] = "optimizer"
    register_hook: ClassVar[str] = "twinkle_register_optimizers"


@dataclass(frozen=True)
class SchedulerRecord(PluginRecord):
    """A learning-rate scheduler factory usable by name in ``set_lr_scheduler``."""

    kind: ClassVar[str] = "scheduler"
    register_hook: ClassVar[str] = "twinkle_register_schedulers"


@dataclass(frozen=True)
class MetricRecord(PluginRecord):
    """A ``Metric`` usable by name in ``add_metric``."""

    kind: ClassVar[str] = "metric"
    register_hook: ClassVar[str] = "twinkle_register_metrics"


@dataclass(frozen=True)
class SamplerRecord(PluginRecord):
    """A ``Sampler`` (``twinkle_core.sampling``) that generates completions for online RL."""

    kind: ClassVar[str] = "sampler"
    register_hook: ClassVar[str] = "twinkle_register_samplers"


@dataclass(frozen=True)
class RewardRecord(PluginRecord):
    """A reward function ``(prompts, completions, **row fields) -> list[float]`` (``twinkle_core.rewards``)."""

    kind: ClassVar[str] = "reward"
    register_hook: ClassVar[str] = "twinkle_register_rewards"


@dataclass(frozen=True)
class EnvironmentRecord(PluginRecord):
    """An agent ``Environment`` (``twinkle_core.environments``) for multi-turn online RL: reset with a prompt
    row's fields, then one step per model turn (observation, reward, done)."""

    kind: ClassVar[str] = "environment"
    register_hook: ClassVar[str] = "twinkle_register_environments"


@dataclass(frozen=True)
class TrackerRecord(PluginRecord):
    """An experiment tracker (``twinkle_core.trackers.Tracker``): ``tensorboard``, ``wandb``, ``mlflow`` ...,
    chosen by ``train.report_to`` in a recipe."""

    kind: ClassVar[str] = "tracker"
    register_hook: ClassVar[str] = "twinkle_register_trackers"


@dataclass(frozen=True)
class KernelRecord(PluginRecord):
    """A device-conditional replacement applied to the network when it is built (:mod:`twinkle_core.kernels`).

    ``accelerators``: the accelerator names it applies to (``("npu",)``); ``replaces``: what it replaces, as
    ``"module:<pkg.mod>:<Class>"`` (``impl`` is a ``forward`` bound onto every instance of that class),
    ``"function:<pkg.mod>:<name>"`` (``impl`` takes the function's place while the model runs),
    ``"model"`` (``impl`` is ``apply(network) -> int``, e.g. an attention function) or
    ``"optimizer:<Name>"`` (``impl`` is the ``Optimizer`` class ``set_optimizer("<Name>")`` builds).
    """

    accelerators: tuple[str, ...] = ()
    replaces: tuple[str, ...] = ()
    kind: ClassVar[str] = "kernel"
    register_hook: ClassVar[str] = "twinkle_register_kernels"


@dataclass(frozen=True)
class ConformanceTarget(PluginRecord):
    """A factory the conformance suite calls to build a tiny model of one backend.

    ``impl`` points at ``factory(**options) -> TwinkleModel``; ``options`` are passed to it
    (e.g. ``{"strategy": "ddp"}``) and ``world_size`` is how many ranks it needs.
    """

    options: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    kind: ClassVar[str] = "conformance"
    register_hook: ClassVar[str] = "twinkle_register_conformance_targets"


@dataclass(frozen=True)
class CommandRecord(PluginRecord):
    """A ``twinkle`` sub-command: ``name`` is the word typed after ``twinkle``, ``description`` its line in
    ``twinkle --help``, and ``impl`` a :class:`twinkle_core.commands.Command` subclass (built with no arguments).

    The command's module is imported when the parser is built, so it imports torch and its other heavy
    dependencies inside ``run`` only.
    """

    kind: ClassVar[str] = "command"
    register_hook: ClassVar[str] = "twinkle_register_commands"


@dataclass(frozen=True)
class RuntimeRecord(PluginRecord):
    """A runtime that runs a training job's ranks: ``twinkle train --runtime NAME``. ``impl`` is a
    :class:`twinkle_core.launch.Runtime` subclass (built with no arguments) whose module imports its heavy
    dependencies (e.g. Ray) only when it launches. The core registers ``torchrun``."""

    kind: ClassVar[str] = "runtime"
    register_hook: ClassVar[str] = "twinkle_register_runtimes"


# every plugin kind, in the order ``twinkle plugins`` lists them
RECORD_TYPES: tuple[type[PluginRecord], ...] = (
    ModelRecord,
    StrategyRecord,
    PrecisionRecord,
    LossRecord,
    TaskRecord,
    SourceRecord,
    AcceleratorRecord,
    OptimizerRecord,
    SchedulerRecord,
    MetricRecord,
    SamplerRecord,
    RewardRecord,
    EnvironmentRecord,
    TrackerRecord,
    KernelRecord,
    ConformanceTarget,
    CommandRecord,
    RuntimeRecord,
)
KINDS: dict[str, type[PluginRecord]] = {r.kind: r for r in RECORD_TYPES}
