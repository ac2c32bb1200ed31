"""The Strategy base: the precision it owns (forward context, loss scaling, unscaling, step) and the spec options
it declares."""

from __future__ import annotations

import math

import pytest
import torch

from twinkle_core.precision import BF16Precision, FP16Precision, FullPrecision
from twinkle_core.strategy import OptimizerHandle, SingleProcessStrategy, Strategy


def test_strategies_take_no_spec_option_unless_they_declare_it():
    assert Strategy.spec_options == frozenset()
    assert SingleProcessStrategy.spec_options == frozenset()
    assert isinstance(SingleProcessStrategy.spec_options, frozenset)


def test_forward_context_is_the_precisions_autocast():
    with SingleProcessStrategy(precision=BF16Precision()).forward_context("cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with SingleProcessStrategy(precision=FullPrecision()).forward_context("cpu"):
        assert not torch.is_autocast_enabled("cpu")


def _handle() -> tuple[torch.nn.Parameter, OptimizerHandle]:
    weight = torch.nn.Parameter(torch.ones(2))
    return weight, OptimizerHandle(torch.optim.SGD([weight], lr=1.0), [weight])


def test_fp16_scaling_unscaling_and_step_go_through_the_strategy():
    strategy = SingleProcessStrategy(precision=FP16Precision(init_scale=4.0))
    assert float(strategy.scale_loss(torch.tensor(1.5))) == 6.0
    weight, handle = _handle()
    weight.grad = torch.full((2,), 4.0)
    strategy.unscale_gradients(handle)
    torch.testing.assert_close(weight.grad, torch.ones(2))
    assert strategy.optimizer_step(torch.nn.Linear(1, 1), handle) is True
    torch.testing.assert_close(weight.detach(), torch.zeros(2))


def test_a_non_finite_fp16_step_is_skipped_by_the_strategy():
    strategy = SingleProcessStrategy(precision=FP16Precision(init_scale=4.0))
    strategy.scale_loss(torch.tensor(1.0))
    weight, handle = _handle()
    weight.grad = torch.tensor([math.inf, 1.0])
    strategy.unscale_gradients(handle)
    assert strategy.optimizer_step(torch.nn.Linear(1, 1), handle) is False
    torch.testing.assert_close(weight.detach(), torch.ones(2))


@pytest.mark.parametrize("precision", [FullPrecision(), BF16Precision()], ids=lambda p: p.name)
def test_without_a_loss_scaler_the_loss_and_gradients_pass_unchanged(precision):
    strategy = SingleProcessStrategy(precision=precision)
    loss = torch.tensor(2.5)
    assert strategy.scale_loss(loss) is loss
    weight, handle = _handle()
    weight.grad = torch.full((2,), 3.0)
    strategy.unscale_gradients(handle)
    torch.testing.assert_close(weight.grad, torch.full((2,), 3.0))


def test_the_precision_state_is_kept_through_the_strategy():
    strategy = SingleProcessStrategy(precision=FP16Precision(init_scale=4.0))
    strategy.scale_loss(torch.tensor(1.0))
    state = strategy.precision_state()
    assert state["scaler"]["scale"] == 4.0
    fresh = SingleProcessStrategy(precision=FP16Precision(init_scale=1024.0))
    fresh.load_precision_state(state)
    assert fresh.precision_state()["scaler"]["scale"] == 4.0
    assert SingleProcessStrategy(precision=BF16Precision()).precision_state() == {}


def test_the_network_is_prepared_for_the_precision_through_the_strategy():
    module = torch.nn.Linear(2, 2)
    assert SingleProcessStrategy(precision=FullPrecision()).prepare_precision(module) is module
