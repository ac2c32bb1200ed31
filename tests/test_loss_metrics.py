"""A loss's own metrics (``LossOutput.metrics``) are averaged like the loss: weighted by ``num_tokens``."""

from __future__ import annotations

import pytest
import torch

from twinkle_core.loss.base import LossOutput
from twinkle_core.metrics import LossMetric


def test_loss_metrics_are_weighted_by_the_units_they_average_over():
    metric = LossMetric()
    metric.update({}, {}, LossOutput(loss=torch.tensor(2.0), num_tokens=2, metrics={"rewards/accuracies": 1.0}))
    metric.update({}, {}, LossOutput(loss=torch.tensor(6.0), num_tokens=6, metrics={"rewards/accuracies": 0.5,
                                                                                     "flag": True}))
    totals = metric.totals()
    assert list(totals) == ["loss_sum", "tokens", "loss_metric:rewards/accuracies"]  # a fixed order for all-reduce
    result = metric.compute(totals)
    assert result["loss"] == 1.0 and result["tokens"] == 8
    assert result["rewards/accuracies"] == pytest.approx((1.0 * 2 + 0.5 * 6) / 8)
    metric.reset()
    assert metric.compute(metric.totals()) == {"loss": pytest.approx(float("nan"), nan_ok=True), "tokens": 0.0}
