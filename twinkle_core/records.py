"""Typed records that plugins yield from registration hooks.

A record names an implementation by reference (``"package.module:Class"``) so that listing
plugins never imports torch or a backend. ``record.load()`` imports it on first use.
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

    def load(self) -> Any:
        return import_object(self.impl)


@dataclass(frozen=True)
class ModelRecord(PluginRecord):
    """A ``TwinkleModel`` implementation, e.g. ``TransformersModel``."""

    kind: ClassVar[str] = "model"


@dataclass(frozen=True)
class StrategyRecord(PluginRecord):
    """A parallel ``Strategy`` (``ddp``, ``native_fsdp``, ``deepspeed`` ...)."""

    kind: ClassVar[str] = "strategy"


@dataclass(frozen=True)
class PrecisionRecord(PluginRecord):
    """A ``Precision`` mode: ``no``, ``bf16``, ``fp16``, ``fp8``."""

    kind: ClassVar[str] = "precision"


@dataclass(frozen=True)
class LossRecord(PluginRecord):
    """A ``Loss`` class."""

    kind: ClassVar[str] = "loss"


@dataclass(frozen=True)
class TaskRecord(PluginRecord):
    """A ``Task``: how rows become model inputs, which loss and metrics apply."""

    kind: ClassVar[str] = "task"


@dataclass(frozen=True)
class SourceRecord(PluginRecord):
    """A ``ModelSource`` handling URIs of one scheme (``ms://``, ``hf://``, ``local``)."""

    kind: ClassVar[str] = "source"


@dataclass(frozen=True)
class AcceleratorRecord(PluginRecord):
    """An ``Accelerator`` (``cpu``, ``cuda``, ``npu``): device type and collective backend."""

    kind: ClassVar[str] = "accelerator"


@dataclass(frozen=True)
class OptimizerRecord(PluginRecord):
    """An optimizer class usable by name in ``set_optimizer("AdamW", lr=...)``."""

    kind: ClassVar[str] = "optimizer"


@dataclass(frozen=True)
class SchedulerRecord(PluginRecord):
    """A learning-rate scheduler factory usable by name in ``set_lr_scheduler``."""

    kind: ClassVar[str] = "scheduler"


@dataclass(frozen=True)
class MetricRecord(PluginRecord):
    """A ``Metric`` usable by name in ``add_metric``."""

    kind: ClassVar[str] = "metric"


@dataclass(frozen=True)
class ConformanceTarget(PluginRecord):
    """A factory the conformance suite calls to build a tiny model of one backend.

    ``impl`` points at ``factory(**options) -> TwinkleModel``; ``options`` are passed to it
    (e.g. ``{"strategy": "ddp"}``) and ``world_size`` is how many ranks it needs.
    """

    options: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    kind: ClassVar[str] = "conformance"


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
    ConformanceTarget,
)
KINDS: dict[str, type[PluginRecord]] = {r.kind: r for r in RECORD_TYPES}
