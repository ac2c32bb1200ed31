"""Whole-sequence sums for per-sequence losses when each sequence is split over ranks (sequence / context parallelism).

Under sequence parallelism (the HF backend's ``ulysses`` strategy: Ulysses, ring attention or both) every rank of a
*sequence group* holds the same rows but only a slice of each sequence: the batch carries ``shift_labels``
``[B, L]`` aligned with the local logits and no ``labels``, and per-token inputs (``old_logps``, per-token
``advantages`` ...) arrive sliced the same way; per-sequence inputs (``[B]`` advantages, DPO's ``[S]``
``ref_logps``) arrive whole. A token-sum loss needs nothing more: its sums and counts add up over the ranks. A
per-sequence loss (DPO's answer log-probabilities, GRPO's per-sequence token means, GSPO's sequence ratios) needs
sums over whole sequences: :meth:`SequenceReduction.sum` takes this rank's per-row sums and all-reduces them over
``LossContext.sp_group``, so that every rank of the group computes the same whole-sequence loss ``F``.

Gradients, and counting every sequence once. The model sums the gradients of every rank (the data-parallel
wrapper over the whole world) and divides by the global ``num_tokens``, the sum of every rank's. So each rank
reports ``F * share`` and ``num_tokens * share``, ``share = 1 / sp_size`` (:attr:`SequenceReduction.share`): the
loss, the metrics' weights and the divisor count each sequence once over the group. The all-reduce's backward is
an all-reduce too: each rank receives ``share * dF/dsum`` from its own copy of the loss, the sum over the group's
``sp_size`` ranks is ``dF/dsum``, which then flows into this rank's slice only. Summing the ranks' gradients gives
``sum_r dF/dsum * dsum_r/dtheta = dF/dtheta``: exactly the single-process gradient.

Whole rows (no ``shift_labels``-only slice, or a group of one) get the identity reduction with ``share = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from twinkle_core.data.collate import is_packed_batch

if TYPE_CHECKING:
    from twinkle_core.loss.base import LossContext

__all__ = ["SequenceReduction", "is_sequence_slice", "sequence_reduction"]


def is_sequence_slice(inputs: dict[str, Any]) -> bool:
    """Whether the batch holds slices of its sequences: the core marks them with ``shift_labels`` and no
    ``labels`` (a sequence-parallel strategy shifts the labels before it splits the sequence)."""
    return inputs.get("shift_labels") is not None and inputs.get("labels") is None


class _GroupSum(torch.autograd.Function):
    """All-reduce (sum) over ``group`` in forward and in backward (see the module docstring for why)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        out = x.detach().clone().contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.detach().clone().contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


@dataclass(frozen=True)
class SequenceReduction:
    """How a per-sequence loss turns this rank's per-row values into whole-sequence ones (:func:`sequence_reduction`).

    ``size`` ranks split every sequence (1: each rank holds whole rows); ``group`` is their process group."""

    group: Any = None
    size: int = 1

    @property
    def sliced(self) -> bool:
        return self.size > 1

    @property
    def share(self) -> float:
        """The part of a whole-sequence loss (and of its ``num_tokens``) this rank reports: ``1 / size``."""
        return 1.0 / self.size

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (per row, any shape) summed over the group, differentiably; the identity for whole rows."""
        if not self.sliced:
            return values
        return _GroupSum.apply(values, self.group)

    def count(self, values: torch.Tensor) -> torch.Tensor:
        """Like :meth:`sum`, for values that carry no gradient (token counts)."""
        return self.sum(values.detach())

    def row_sums(self, per_token: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``([B] sum of per_token * weights, [B] sum of weights)`` of every whole row (``[B, L]`` local inputs)."""
        return self.sum((per_token * weights).sum(-1)), self.count(weights.sum(-1))

    def rows_are_packed(self, inputs: dict[str, Any]) -> bool:
        """Whether the batch packs several sequences into a row. Whole rows: the padding-free layout
        (:func:`~twinkle_core.data.collate.is_packed_batch`). Slices (which always carry ``position_ids`` and no
        mask): a row of the whole group holds position 0 more than once (each packed sequence restarts there; left
        padding sits at negative positions, the alignment padding continues the last sequence). Collective over
        the group for slices."""
        if not is_sequence_slice(inputs):
            return is_packed_batch(inputs)
        positions = inputs.get("position_ids")
        if positions is None:
            return False
        starts = self.count((torch.as_tensor(positions) == 0).sum(-1).to(torch.float64))
        return bool((starts > 1).any())


def sequence_reduction(inputs: dict[str, Any], context: LossContext | None) -> SequenceReduction:
    """The reduction a per-sequence loss uses on ``inputs``: over the context's sequence group when the batch holds
    slices of its sequences (:func:`is_sequence_slice`), else the identity.

    A slice with no sequence group (no context, or ``sp_size == 1``) is a whole sequence in the sliced layout (a
    sequence-parallel strategy on one rank): the identity too."""
    if not is_sequence_slice(inputs) or context is None or context.sp_size <= 1:
        return SequenceReduction()
    return SequenceReduction(group=context.sp_group, size=int(context.sp_size))
