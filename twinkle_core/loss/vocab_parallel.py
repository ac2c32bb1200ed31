"""Vocabulary-parallel log-probabilities: each tensor-parallel rank holds only its slice of the vocabulary.

A tensor-parallel LM head (Megatron's ``ColumnParallelLinear`` with ``parallel_output=True``) leaves rank ``r``
with the logits of vocabulary rows ``start:end`` only, ``[..., V / tp]``. Gathering them would put the whole
``[tokens, V]`` tensor on every rank (1.2 GB in float32 for Qwen's 151,936 entries at 2,048 tokens); instead the
softmax is taken across ranks with one all-gather per chunk of rows. Each rank sends, per row, a few scalars
of its own slice ``z`` (its row maximum ``m``):

* ``m`` and ``s = sum exp(z - m)``: every rank then combines ``lse = M + log sum_r s_r exp(m_r - M)`` with
  ``M = max_r m_r`` (the stable log-sum-exp, without a MAX all-reduce before the SUM one);
* the label's logit, which only the rank owning the label contributes, and the sum of the logits (for the
  mean log-probability of label smoothing);
* for the entropy, ``t = sum exp(z - m) (z - m)``: the rank's share of ``sum p log p`` is
  ``exp(m - lse) (t + (m - lse) s)``, a sum of terms of one sign (no cancellation).

Megatron's ``vocab_parallel_cross_entropy`` does the same arithmetic with three all-reduces (MAX, then two
SUMs); one gather of ``[5, rows]`` per rank costs one collective's latency instead of three, which is what a
small exchange pays on gloo and NCCL alike.

The backward needs no communication: ``d log p(y) / d z_v = onehot(y)_v - p_v`` and each rank writes it for its
own columns (the replicated loss back-propagates the same upstream gradient on every rank; Megatron's column
parallel head sums the hidden states' gradient over the TP group itself). The arithmetic is the one of
Megatron's ``vocab_parallel_cross_entropy``, here on plain ``torch.distributed`` (gloo included), chunked like
:mod:`twinkle_core.loss.logprobs`, with a sampling temperature and the padded vocabulary masked out.

Padded rows: a vocabulary padded to a multiple of the TP size has rows ``vocab_size:`` that are not tokens; they
are set to ``-inf`` before the softmax, so they never get probability (nor gradient).

Every rank of the group must call these functions with the same labels (TP ranks see the same batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from twinkle_core.errors import ConfigError

__all__ = ["TURN_OFF", "VocabShard", "refuse_vocab_shard", "vocab_parallel_argmax", "vocab_parallel_scores"]

#: how to turn the vocabulary-parallel path off, for the errors of the code that cannot take a shard
TURN_OFF = ("turn the vocabulary-parallel loss off with the strategy option vocab_parallel_loss (recipe: "
            "strategy.options.vocab_parallel_loss=false; Python: strategy_options={'vocab_parallel_loss': False}); "
            "the logits are then gathered over the tensor-parallel ranks")


@dataclass(frozen=True)
class VocabShard:
    """The slice of the (padded) vocabulary whose logits this rank holds, and the group holding the rest.

    ``start`` / ``end``: the rows ``start:end`` of the padded vocabulary (the last dimension of the local logits
    is ``end - start``); ``vocab_size``: the real vocabulary size (rows from it on are padding); ``group``: the
    ``torch.distributed`` process group of the ranks holding the other slices (``None``: the default group).
    """

    start: int
    end: int
    vocab_size: int
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end or self.vocab_size < 1:
            raise ValueError(f"VocabShard needs 0 <= start < end and vocab_size >= 1, got start={self.start}, "
                             f"end={self.end}, vocab_size={self.vocab_size}")

    @property
    def width(self) -> int:
        """How many logits per row this rank holds (``end - start``)."""
        return self.end - self.start

    @property
    def real_width(self) -> int:
        """How many of them are real tokens (the rest are padding rows of the vocabulary)."""
        return max(0, min(self.end, self.vocab_size) - self.start)

    def check(self, logits: torch.Tensor) -> None:
        if logits.shape[-1] != self.width:
            raise ValueError(f"logits hold {logits.shape[-1]} vocabulary entries but the vocab shard "
                             f"{self.start}:{self.end} has {self.width}")


def refuse_vocab_shard(shard: VocabShard | None, where: str, why: str) -> None:
    """Raise the ``ConfigError`` of ``where``, which needs whole-vocabulary logits (``why``), given a shard."""
    if shard is not None:
        raise ConfigError(f"{where} {why}, but the logits hold only this rank's vocabulary slice "
                          f"{shard.start}:{shard.end} of {shard.vocab_size}; {TURN_OFF}")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32, as :func:`twinkle_core.loss.logprobs.acc_dtype` (not imported: logprobs imports this
    module)."""
    return torch.promote_types(dtype, torch.float32)


def _labelled_rows(labels1d: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The rows that carry a label, as :func:`twinkle_core.loss.logprobs.labelled_rows`."""
    return (labels1d != ignore_index).nonzero(as_tuple=True)[0]


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _chunk(logits2d: torch.Tensor, idx: torch.Tensor, shard: VocabShard, dtype: torch.dtype,
           temperature: float) -> torch.Tensor:
    """A fresh ``[len(idx), width]`` chunk of ``logits / temperature`` in ``dtype``, padding columns at -inf."""
    z = logits2d.index_select(0, idx).to(dtype)
    if temperature != 1.0:
        z.div_(temperature)
    z[:, shard.real_width:] = float("-inf")
    return z


@dataclass(frozen=True)
class _RowStats:
    """Per row of a chunk, over the whole (real) vocabulary: ``lse``, the label's logit, the logits' sum, and
    ``sum p log p`` (zeros unless asked for)."""

    lse: torch.Tensor
    label_z: torch.Tensor
    z_sum: torch.Tensor
    p_log_p: torch.Tensor


def _chunk_stats(z: torch.Tensor, labels: torch.Tensor, shard: VocabShard, with_entropy: bool) -> _RowStats:
    """The :class:`_RowStats` of the local chunk ``z`` ``[rows, width]`` (padding columns at -inf): one
    all-gather of every rank's per-row scalars (see the module doc)."""
    real = z[:, : shard.real_width]
    # a rank holding only padding rows has m = -inf; the dtype's lowest finite value keeps exp(z - m) at 0
    m = z.max(dim=1).values.clamp_min(torch.finfo(z.dtype).min)
    shifted = real - m.unsqueeze(1)
    # the entropy needs the shifted logits after exp; without it, exp in place saves a [rows, width] buffer
    e = shifted.exp() if with_entropy else shifted.exp_()
    owned, local = _owned(labels, shard)
    label_z = torch.where(owned, z.gather(1, local.unsqueeze(1)).squeeze(1), torch.zeros_like(m))
    t = (e * shifted).sum(dim=1) if with_entropy else torch.zeros_like(m)
    mine = torch.stack([m, e.sum(dim=1), label_z, real.sum(dim=1), t])
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(shard.group))]
    dist.all_gather(parts, mine, group=shard.group)
    m_r, s_r, label_r, sum_r, t_r = torch.stack(parts).unbind(1)  # each [tp, rows]
    top = m_r.max(dim=0).values
    lse = top + (s_r * (m_r - top).exp()).sum(dim=0).log()
    p_log_p = ((m_r - lse).exp() * (t_r + (m_r - lse) * s_r)).sum(dim=0) if with_entropy else torch.zeros_like(m)
    return _RowStats(lse, label_r.sum(dim=0), sum_r.sum(dim=0), p_log_p)


def _owned(labels: torch.Tensor, shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    """``(owned, local)``: whether this rank holds each label's column, and that column (0 where not owned)."""
    local = labels - shard.start
    owned = (local >= 0) & (local < shard.width)
    return owned, torch.where(owned, local, torch.zeros_like(local))


class _VocabParallelScores(torch.autograd.Function):
    """Per row of ``logits2d`` ``[N, width]``: ``(log p(label), mean_v log p(v), H(p))`` with
    ``p = softmax(full row / temperature)`` over the real vocabulary; zeros where ignored; no gradient for H."""

    @staticmethod
    def forward(ctx: Any, logits2d: torch.Tensor, labels1d: torch.Tensor, shard: VocabShard, ignore_index: int,
                chunk_size: int, temperature: float, with_entropy: bool):
        acc = _acc_dtype(logits2d.dtype)
        rows = _labelled_rows(labels1d, ignore_index)
        n = logits2d.shape[0]
        label_lp, mean_lp, entropy = (torch.zeros(n, dtype=acc, device=logits2d.device) for _ in range(3))
        lse = torch.empty(rows.numel(), dtype=acc, device=logits2d.device)
        for start in range(0, rows.numel(), chunk_size):
            idx = rows[start : start + chunk_size]
            z = _chunk(logits2d, idx, shard, acc, temperature)
            stats = _chunk_stats(z, labels1d.index_select(0, idx), shard, with_entropy)
            label_lp.index_copy_(0, idx, stats.label_z - stats.lse)
            mean_lp.index_copy_(0, idx, stats.z_sum / shard.vocab_size - stats.lse)
            if with_entropy:
                entropy.index_copy_(0, idx, -stats.p_log_p)
            lse[start : start + idx.numel()] = stats.lse
        ctx.save_for_backward(logits2d, labels1d, rows, lse)
        ctx.shard, ctx.chunk_size, ctx.temperature = shard, chunk_size, temperature
        ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return label_lp, mean_lp, entropy

    @staticmethod
    def backward(ctx: Any, g_label: torch.Tensor | None, g_mean: torch.Tensor | None, _g_entropy: Any):
        logits2d, labels1d, rows, lse = ctx.saved_tensors
        shard, temperature = ctx.shard, ctx.temperature
        grad = torch.zeros_like(logits2d)
        if g_label is None and g_mean is None:
            return grad, None, None, None, None, None, None
        for start in range(0, rows.numel(), ctx.chunk_size):
            idx = rows[start : start + ctx.chunk_size]
            z = _chunk(logits2d, idx, shard, lse.dtype, temperature)
            gl = None if g_label is None else g_label.index_select(0, idx).to(lse.dtype)
            gm = None if g_mean is None else g_mean.index_select(0, idx).to(lse.dtype)
            total = gl if gm is None else (gm if gl is None else gl + gm)
            # d/dz of g_label * log p(y) + g_mean * mean_v log p(v): (onehot(y) * g_label + g_mean / V) - p * total;
            # padding columns have p = 0 and no 1/V share, so their gradient stays 0
            dz = z.sub_(lse[start : start + idx.numel()].unsqueeze(1)).exp_().mul_(-total.unsqueeze(1))
            if gl is not None:
                owned, local = _owned(labels1d.index_select(0, idx), shard)
                dz.scatter_add_(1, local.unsqueeze(1), torch.where(owned, gl, torch.zeros_like(gl)).unsqueeze(1))
            if gm is not None:
                dz[:, : shard.real_width].add_(gm.unsqueeze(1) / shard.vocab_size)
            if temperature != 1.0:  # the chain rule through z / temperature
                dz.div_(temperature)
            grad.index_copy_(0, idx, dz.to(grad.dtype))
        return grad, None, None, None, None, None, None


def vocab_parallel_scores(logits: torch.Tensor, labels: torch.Tensor, shard: VocabShard, ignore_index: int,
                          chunk_size: int, temperature: float = 1.0,
                          with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log p(label), mean_v log p(v), entropy)`` shaped like ``labels`` (no shift: ``logits[..., i, :]`` scores
    ``labels[..., i]``), from this rank's ``[..., shard.width]`` slice of the logits, with
    ``p = softmax(logits / temperature)`` over the ``shard.vocab_size`` real tokens. Ignored positions are 0;
    the entropy is all zeros unless ``with_entropy`` and has no gradient. Collective over ``shard.group``."""
    shard.check(logits)
    flat_labels = labels.reshape(-1).to(device=logits.device, dtype=torch.long)
    scores = _VocabParallelScores.apply(logits.reshape(-1, shard.width), flat_labels, shard, ignore_index,
                                        chunk_size, float(temperature), with_entropy)
    return tuple(score.view(labels.shape) for score in scores)


def vocab_parallel_argmax(logits: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The global ``argmax`` over the real vocabulary of every row of the local slice ``[..., width]``, ties broken
    toward the lower index as :func:`torch.argmax` does. Collective over ``shard.group``."""
    shard.check(logits)
    z = logits.detach().to(_acc_dtype(logits.dtype))
    z = z.masked_fill(torch.arange(shard.width, device=z.device) >= shard.real_width, float("-inf"))
    local_arg = z.argmax(dim=-1)  # the first maximal column
    local_max = z.gather(-1, local_arg.unsqueeze(-1)).squeeze(-1)
    global_max = _all_reduce(local_max.clone(), dist.ReduceOp.MAX, shard.group)
    # ranks without the maximum offer an index past every real one, so MIN picks the lowest holder's
    candidate = torch.where(local_max == global_max, local_arg + shard.start,
                            torch.full_like(local_arg, shard.vocab_size))
    return _all_reduce(candidate, dist.ReduceOp.MIN, shard.group)
