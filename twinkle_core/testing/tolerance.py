"""Parity tolerances derived from the arithmetic, so a parity test passes on any CPU and thread count.

Two kinds of comparison, two sources of a bound:

* **One-shot computations** (a forward pass, one gradient): the results differ only in the order
  of their float sums. Summing ``n`` terms in any order is off by at most ``gamma(n) * sum|x|``
  (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 4.4), with
  ``gamma(n) = n u / (1 - n u)`` and ``u`` the unit roundoff of the dtype. That worst case grows
  with ``n`` and is far from what rounding does; Higham & Mary (SIAM J. Sci. Comput. 41(5), 2019,
  Theorem 3.1) bound the error by ``lambda sqrt(n) u sum|x|`` with probability at least
  ``1 - 2n exp(-lambda^2 (1 - u)^2 / 2)``. With ``lambda = 10`` (:data:`LAMBDA`) that fails less than
  once in 10^16 for a million terms. Two orders differ by at most twice the bound: :func:`sum_tolerance`.
* **Training runs** (several optimizer steps): Adam divides by the root of the second moment, so a
  gradient entry near zero turns rounding noise into an update of up to ``lr``. No useful a-priori
  bound exists; instead the single-process reference is run a second time with only its reduction
  order changed (its batch rows reversed: the same mathematics). The distance between the two
  references is the float noise of *this* computation on *this* machine and thread count; a
  distributed run reorders the same sums, so it must agree within :data:`SPREAD_FACTOR` times that
  spread, and never less than the one-shot floor: :func:`spread_tolerance`.

  A row reversal reorders the sums over rows (gradients, losses) but not the inner sums of each
  matrix product, which a tensor-parallel split or another CPU's GEMM kernel does reorder. Where a
  test can, it therefore also runs the reference in float64 (``exact_reference``): the float32
  reference's distance from it is the rounding noise of *all* its sums, and the spread is the larger
  of the two distances. (Measured: Megatron LoRA at TP=2 against the HF backend, final logits after 10
  AdamW steps: reversal spread 3.1e-6, float64 distance 1.2e-5, the TP run 3.9e-5 from the reference.)

Example::

    from twinkle_core.testing.tolerance import assert_within_spread, sum_tolerance

    floor = sum_tolerance(terms=rows * length, magnitude=max(reference["losses"]))
    assert_within_spread("losses", run["losses"], reference["losses"], reversed_reference["losses"], floor=floor)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

#: how many times the reference's own reduction-order spread a reordered run may differ by. Both the
#: distributed run and the reversed reference are "the reference with its sums reordered", so their
#: distances to the reference are draws of the same size; 10 leaves room for the distributed run
#: reordering more sums (across ranks as well as within a batch) than a row reversal does.
SPREAD_FACTOR = 10.0
#: Higham & Mary's lambda: the probabilistic bound holds with probability >= 1 - 2n exp(-lambda^2 / 2)
LAMBDA = 10.0


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """``u``: half the distance from 1.0 to the next representable number (5.96e-8 for float32)."""
    return torch.finfo(dtype).eps / 2


def gamma(terms: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error bound of an ``n``-term float sum."""
    nu = terms * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"{terms} terms of {dtype} have no rounding bound (n*u >= 1)")
    return nu / (1 - nu)


def sum_tolerance(terms: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """How far two summation orders of ``terms`` numbers whose absolute sum is ``magnitude`` can differ.

    Twice the smaller of the worst-case bound ``gamma(n)`` and the probabilistic ``LAMBDA sqrt(n) u``."""
    if terms < 1:
        raise ValueError(f"terms must be >= 1, got {terms}")
    u = unit_roundoff(dtype)
    relative = LAMBDA * math.sqrt(terms) * u
    if terms * u < 1:
        relative = min(relative, gamma(terms, dtype))
    return 2 * relative * abs(magnitude)


def forward_tolerance(magnitude: float, *, width: int, depth: int, dtype: torch.dtype = torch.float32) -> float:
    """How far two implementations of one forward pass with the same weights may differ.

    ``depth`` layers, each ending in reductions of at most ``width`` terms, plus the output
    projection: ``depth + 1`` stages whose rounding adds up (layer norms keep activations of order
    one, so the errors do not compound multiplicatively), on outputs of size ``magnitude``."""
    return (depth + 1) * sum_tolerance(width, magnitude, dtype)


def max_abs_diff(got: Any, want: Any) -> float:
    """The largest absolute elementwise difference of two tensors or (nested) number sequences."""
    a = torch.as_tensor(got, dtype=torch.float64)
    b = torch.as_tensor(want, dtype=torch.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return float((a - b).abs().max()) if a.numel() else 0.0


def reference_spread(reference: Any, reordered_reference: Any, exact_reference: Any = None) -> float:
    """The reference's own float noise: its distance from the reordered run, or from the float64 run
    (``exact_reference``) where that is larger (see the module docstring)."""
    spread = max_abs_diff(reference, reordered_reference)
    if exact_reference is not None:
        spread = max(spread, max_abs_diff(reference, exact_reference))
    return spread


def spread_tolerance(reference: Any, reordered_reference: Any, *, floor: float,
                     factor: float = SPREAD_FACTOR, exact_reference: Any = None) -> float:
    """``max(floor, factor * reference_spread(...))``: see the module docstring."""
    return max(floor, factor * reference_spread(reference, reordered_reference, exact_reference))


def assert_within_spread(what: str, got: Any, reference: Any, reordered_reference: Any, *, floor: float,
                         factor: float = SPREAD_FACTOR, exact_reference: Any = None) -> float:
    """Assert ``got`` is within :func:`spread_tolerance` of ``reference``; return the distance."""
    tolerance = spread_tolerance(reference, reordered_reference, floor=floor, factor=factor,
                                 exact_reference=exact_reference)
    delta = max_abs_diff(got, reference)
    noise = f"reduction-order spread {max_abs_diff(reference, reordered_reference):.3g}"
    if exact_reference is not None:
        noise += f", float64 distance {max_abs_diff(reference, exact_reference):.3g}"
    assert delta <= tolerance, (
        f"{what}: max |got - reference| = {delta:.3g} exceeds {tolerance:.3g} = max(floor {floor:.3g}, "
        f"{factor:g} x the reference's own float noise: {noise})"
        f"\n got:       {_short(got)}\n reference: {_short(reference)}")
    return delta


def _short(values: Any) -> str:
    text = repr(values.tolist() if isinstance(values, torch.Tensor) else values)
    return text if len(text) < 400 else text[:400] + " ..."


__all__: Sequence[str] = ("LAMBDA", "SPREAD_FACTOR", "assert_within_spread", "forward_tolerance", "gamma", "max_abs_diff", "reference_spread", "spread_tolerance",
                          "sum_tolerance", "unit_roundoff")
