"""An adapter's metrics: built from what ``add_metric`` was given, and aggregated over the data-parallel ranks.

Each metric keeps per-rank totals (sums and counts); :func:`aggregate` sums every metric's totals in one
collective, then lets each metric compute its values from the global totals.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from twinkle_core.errors import ConfigError
from twinkle_core.metrics import Metric
from twinkle_core.plugins import get_plugins


def build_metric(metric: Any, **kwargs: Any) -> Metric:
    """A registered name, a ``Metric`` class (built with ``kwargs``) or an instance, as a ``Metric``."""
    if isinstance(metric, str):
        metric = get_plugins().load("metric", metric)
    if inspect.isclass(metric):
        metric = metric(**kwargs)
    if not isinstance(metric, Metric):
        raise ConfigError(f"cannot use {metric!r} as a metric: pass a registered name, a Metric class or instance")
    return metric


def aggregate(metrics: list[Metric], global_sum: Any, device: Any, *, reset: bool) -> dict[str, float]:
    """The values of ``metrics`` over every data-parallel rank; ``global_sum`` is the strategy's all-reduce
    (a tensor in, its sum over the ranks out). With ``reset`` each metric starts again from zero."""
    keys, values = [], []
    for i, metric in enumerate(metrics):
        for key, value in metric.totals().items():
            keys.append((i, key))
            values.append(value)
    summed = global_sum(torch.tensor(values, dtype=torch.float64, device=device)).tolist()
    per_metric: list[dict[str, float]] = [{} for _ in metrics]
    for (i, key), value in zip(keys, summed):
        per_metric[i][key] = value
    result: dict[str, float] = {}
    for metric, totals in zip(metrics, per_metric):
        result.update(metric.compute(totals))
        if reset:
            metric.reset()
    return result
