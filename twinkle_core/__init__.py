"""Twinkle core: contracts, hook specifications, losses, data and the training loop.

Importing this package is cheap: it imports neither torch nor any backend.
"""

from twinkle_core.hookspecs import hookimpl, hookspec
from twinkle_core.records import (
    AcceleratorRecord,
    ConformanceTarget,
    LossRecord,
    MetricRecord,
    ModelRecord,
    OptimizerRecord,
    PrecisionRecord,
    SchedulerRecord,
    SourceRecord,
    StrategyRecord,
    TaskRecord,
)

__version__ = "0.1.0"

__all__ = [
    "AcceleratorRecord",
    "ConformanceTarget",
    "LossRecord",
    "MetricRecord",
    "ModelRecord",
    "OptimizerRecord",
    "PrecisionRecord",
    "SchedulerRecord",
    "SourceRecord",
    "StrategyRecord",
    "TaskRecord",
    "hookimpl",
    "hookspec",
]
