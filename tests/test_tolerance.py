"""twinkle_core.testing.tolerance: the bounds hold for real float32 arithmetic and the assertions name what failed."""

from __future__ import annotations

import numpy
import pytest
import torch

from twinkle_core.testing.tolerance import (
    assert_within_spread,
    forward_tolerance,
    gamma,
    max_abs_diff,
    reference_spread,
    spread_tolerance,
    sum_tolerance,
    unit_roundoff,
)
from twinkle_core.testing.torchrun import thread_env


def test_unit_roundoff_and_gamma():
    assert unit_roundoff(torch.float32) == 2.0 ** -24
    assert unit_roundoff(torch.bfloat16) == 2.0 ** -8
    assert gamma(1000) == pytest.approx(1000 * 2.0 ** -24, rel=1e-4)
    with pytest.raises(ValueError, match="no rounding bound"):
        gamma(2 ** 8, torch.bfloat16)


@pytest.mark.parametrize("terms", [16, 1024, 65536])
def test_two_summation_orders_stay_within_sum_tolerance(terms):
    generator = torch.Generator().manual_seed(terms)
    worst_ratio = 0.0
    for _ in range(20):
        values = torch.rand(terms, generator=generator, dtype=torch.float32)  # positive: the hardest case
        # numpy's float32 cumsum adds strictly left to right, in float32
        forward = numpy.cumsum(values.numpy(), dtype=numpy.float32)[-1]
        shuffled = numpy.cumsum(values[torch.randperm(terms, generator=generator)].numpy(), dtype=numpy.float32)[-1]
        tolerance = sum_tolerance(terms, float(values.abs().sum()))
        difference = abs(float(forward) - float(shuffled))
        assert difference <= tolerance
        worst_ratio = max(worst_ratio, difference / tolerance)
    # the bound is not vacuous either: real reorderings use a visible part of it
    assert worst_ratio > 1e-2, worst_ratio


def test_forward_tolerance_covers_a_reordered_forward_pass():
    generator = torch.Generator().manual_seed(0)
    width, depth = 64, 2
    x = torch.randn(8, width, generator=generator)
    layers = [torch.randn(width, width, generator=generator) / width ** 0.5 for _ in range(depth + 1)]
    permutation = torch.randperm(width, generator=generator)

    def forward(h, permute):
        for weight in layers:
            # the same products, summed in another order when the reduction dimension is permuted
            h = h[:, permutation] @ weight[permutation] if permute else h @ weight
            h = torch.nn.functional.layer_norm(h, (width,))
        return h

    plain, permuted = forward(x, False), forward(x, True)
    assert max_abs_diff(plain, permuted) <= forward_tolerance(float(plain.abs().max()), width=width, depth=depth)


def test_spread_tolerance_never_goes_below_its_floor():
    assert spread_tolerance([1.0, 2.0], [1.0, 2.0], floor=1e-6) == 1e-6
    assert spread_tolerance([1.0, 2.0], [1.0, 2.001], floor=1e-6) == pytest.approx(1e-2)
    with pytest.raises(AssertionError, match="shapes differ"):
        max_abs_diff([1.0], [1.0, 2.0])


def test_assert_within_spread_names_the_quantity_and_the_bound():
    assert assert_within_spread("losses", [1.0, 2.0005], [1.0, 2.0], [1.0, 2.0001], floor=1e-6) == pytest.approx(5e-4)
    with pytest.raises(AssertionError, match=r"losses: max \|got - reference\| = 0.002 exceeds 0.001"):
        assert_within_spread("losses", [1.0, 2.002], [1.0, 2.0], [1.0, 2.0001], floor=1e-6)


def test_the_float64_reference_widens_the_spread_to_all_the_rounding_of_the_reference():
    """A row reversal leaves the inner sums of matrix products in place; the float64 run's distance covers them."""
    reference, reordered, exact = [1.0, 2.0], [1.0, 2.0001], [1.0, 2.0004]
    assert reference_spread(reference, reordered) == pytest.approx(1e-4)
    assert reference_spread(reference, reordered, exact) == pytest.approx(4e-4)
    assert reference_spread(reference, exact, reordered) == pytest.approx(4e-4)  # the larger, whichever it is
    assert spread_tolerance(reference, reordered, floor=1e-6, exact_reference=exact) == pytest.approx(4e-3)
    assert assert_within_spread("logits", [1.0, 2.003], reference, reordered, floor=1e-6,
                                exact_reference=exact) == pytest.approx(3e-3)
    with pytest.raises(AssertionError, match=r"logits: .* exceeds 0\.004 .*spread 0\.0001, float64 distance 0\.0004"):
        assert_within_spread("logits", [1.0, 2.005], reference, reordered, floor=1e-6, exact_reference=exact)


def test_thread_env(monkeypatch):
    monkeypatch.delenv("TWINKLE_TEST_THREADS", raising=False)
    assert thread_env() == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    monkeypatch.setenv("TWINKLE_TEST_THREADS", "2")
    assert thread_env() == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.setenv("TWINKLE_TEST_THREADS", "two")
    with pytest.raises(ValueError, match="positive integer"):
        thread_env()
