"""Per-token log-probabilities of the labels, computed with bounded memory, at any sampling temperature.

Every built-in loss that needs ``log p(label)`` (cross entropy, DPO, GRPO and friends) goes through
this module, so the shift convention and the numerics live in one place.

Conventions
-----------
``logits`` is ``[B, T, V]`` and ``labels`` is ``[B, T]`` aligned with ``input_ids`` (the Hugging Face
convention): ``logits[:, t]`` predicts ``labels[:, t + 1]``. Positions whose label equals
``ignore_index`` (:data:`twinkle_core.constants.IGNORE_INDEX` by default) are masked out.

Temperature
-----------
``temperature`` scores the labels under ``softmax(logits / temperature)``: a rollout drawn at temperature
``T`` came from that distribution, so the policy losses' importance ratios must use it (TRL's GRPO trainer
divides the logits by the sampling temperature the same way). The division happens per chunk, on the float32
copy of that chunk that the log-sum-exp needs anyway, so no second ``[B, T, V]`` tensor exists; the gradient
of ``log p(y)`` with respect to a row ``z`` is then ``(onehot(y) - p) / temperature``.

Memory
------
A plain ``log_softmax(logits.float())`` keeps a full ``[N, V]`` float32 tensor alive until backward
(and the float32 upcast makes another one). :class:`_LabelLogProbs` instead

* selects the rows that carry a label (one ``nonzero``), and processes them ``chunk_size`` rows at a
  time: a chunk is upcast to float32, its log-sum-exp is taken and the label logit gathered;
* saves only the per-row log-sum-exp (``[n]`` float32) for backward, plus references to the inputs
  autograd holds anyway;
* in backward, recomputes the softmax of one chunk at a time and writes that chunk's gradient into
  the ``[N, V]`` gradient tensor (in the logits' dtype) that autograd has to return anyway.

Computation happens in :func:`acc_dtype` (float32 for bf16/fp16/fp32 inputs, float64 for float64).

So the extra memory beyond the logits and their gradient is ``O(chunk_size * V)`` float32 plus
``O(N)``, independent of the sequence length and batch size. Masked rows cost nothing. (On CPU,
bf16 logits of ``[4, 1024, 32000]``: the plain float32 cross entropy peaked at ~1.5 GB over the
logits, this at ~0.57 GB, 0.25 GB of which is the gradient itself.) The price is one host sync
(``nonzero``) per call, a second softmax pass in backward, and no double backward.

:class:`_LinearLabelLogProbs` does the same starting from the final hidden states and the LM-head
weight, so that the ``[N, V]`` logits are never materialised at all (only one chunk of them).

Both functions return two per-row values: ``log p(label)`` and the mean log-probability over the
vocabulary, ``mean_v log p(v)`` (the label-smoothing term of cross entropy). For those the gradient
with respect to the logits ``z`` is ``onehot(label) - softmax(z)`` and ``1/V - softmax(z)``.
:func:`tempered_token_logprobs` also returns the entropy of every scored position (no gradient), taken from
the same forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.loss.sequence_group import is_sequence_slice

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "TokenLogprobs",
    "acc_dtype",
    "label_logprobs",
    "labelled_rows",
    "linear_label_logprobs",
    "linear_logits",
    "next_token_labels",
    "next_token_scores",
    "shift_labels",
    "tempered_token_logprobs",
    "token_logprobs",
]

DEFAULT_CHUNK_SIZE = 1024


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``[B, T]`` labels re-aligned with the logits positions: ``out[:, t] = labels[:, t + 1]``.

    The last position (which predicts nothing) gets ``ignore_index``. Shifting the labels instead of
    slicing ``logits[:, :-1]`` keeps the logits a free ``view(-1, V)``, with no copy.
    """
    pad = labels.new_full((*labels.shape[:-1], 1), ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def next_token_labels(inputs: dict[str, Any], ignore_index: int = IGNORE_INDEX, device: Any = None) -> torch.Tensor:
    """The labels each logits position predicts: ``inputs["shift_labels"]`` when the batch carries them
    already shifted (sequence parallelism shifts before splitting the sequence), else
    ``shift_labels(inputs["labels"])``."""
    if inputs.get("shift_labels") is not None:
        return inputs["shift_labels"].to(device)
    return shift_labels(inputs["labels"].to(device), ignore_index)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype losses compute in: at least float32 (bf16/fp16 are upcast, float64 is kept)."""
    return torch.promote_types(dtype, torch.float32)


def labelled_rows(labels1d: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Indices of the rows of flat ``labels1d`` that carry a label (the only rows a chunked loss computes)."""
    return (labels1d != ignore_index).nonzero(as_tuple=True)[0]


def linear_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``hidden @ weight.T + bias`` for one chunk of rows, in :func:`acc_dtype` of the weight (the LM head's
    logits as the chunked losses compute them: matrix product in the weight's dtype, then upcast)."""
    z = hidden.to(weight.dtype) @ weight.t()
    if bias is not None:
        z = z + bias
    return z.to(acc_dtype(weight.dtype))


def _check_options(chunk_size: int, temperature: float = 1.0) -> None:
    if not temperature > 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be positive and finite, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")


def _chunk_grad(
    z: torch.Tensor, lse: torch.Tensor, y: torch.Tensor, g_label: torch.Tensor | None, g_mean: torch.Tensor | None
) -> torch.Tensor:
    """d/dz of ``g_label * log p(y) + g_mean * mean_v log p(v)`` for one chunk; overwrites ``z``."""
    probs = z.sub_(lse.unsqueeze(1)).exp_()
    if g_label is None or g_mean is None:
        total = g_label if g_mean is None else g_mean
    else:
        total = g_label + g_mean
    dz = probs.mul_(-total.unsqueeze(1))
    if g_label is not None:
        dz.scatter_add_(1, y.unsqueeze(1), g_label.unsqueeze(1))
    if g_mean is not None:
        dz.add_(g_mean.unsqueeze(1) / z.shape[1])
    return dz


class _RowScores(NamedTuple):
    """Per row of the flat logits: ``log p(label)``, ``mean_v log p(v)``, the entropy (all zeros unless asked
    for, and where ignored), and the log-sum-exp of the labelled rows that backward reuses."""

    label_lp: torch.Tensor
    mean_lp: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor


def _score_rows(rows: torch.Tensor, labels1d: torch.Tensor, n_rows: int, acc: torch.dtype, device: Any,
                chunk_size: int, chunk_logits: Callable[[torch.Tensor], torch.Tensor],
                with_entropy: bool = False) -> _RowScores:
    """The forward pass of both chunked functions: ``chunk_logits(idx)`` gives a fresh ``[len(idx), V]`` chunk
    of logits in ``acc`` (the loop may overwrite it)."""
    label_lp = torch.zeros(n_rows, dtype=acc, device=device)
    mean_lp = torch.zeros(n_rows, dtype=acc, device=device)
    entropy = torch.zeros(n_rows, dtype=acc, device=device)
    lse = torch.empty(rows.numel(), dtype=acc, device=device)
    for start in range(0, rows.numel(), chunk_size):
        idx = rows[start : start + chunk_size]
        z = chunk_logits(idx)
        c_lse = torch.logsumexp(z, dim=1)
        label_lp.index_copy_(0, idx, z.gather(1, labels1d.index_select(0, idx).unsqueeze(1)).squeeze(1) - c_lse)
        mean_lp.index_copy_(0, idx, z.mean(dim=1) - c_lse)
        if with_entropy:
            log_p = z.sub_(c_lse.unsqueeze(1))
            # -sum p log p on log-probs directly: exact where p underflows (the term is 0, not 0 * -inf)
            entropy.index_copy_(0, idx, -(log_p.exp() * log_p).sum(dim=1))
        lse[start : start + idx.numel()] = c_lse
    return _RowScores(label_lp, mean_lp, entropy, lse)


def _row_grads(rows: torch.Tensor, labels1d: torch.Tensor, lse: torch.Tensor, chunk_size: int,
               chunk_logits: Callable[[torch.Tensor], torch.Tensor], g_label: torch.Tensor | None,
               g_mean: torch.Tensor | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The backward pass of both chunked functions, chunk by chunk: ``(idx, d(loss) / d(logits[idx]))``."""
    for start in range(0, rows.numel(), chunk_size):
        idx = rows[start : start + chunk_size]
        yield idx, _chunk_grad(
            chunk_logits(idx),
            lse[start : start + idx.numel()],
            labels1d.index_select(0, idx),
            None if g_label is None else g_label.index_select(0, idx).to(lse.dtype),
            None if g_mean is None else g_mean.index_select(0, idx).to(lse.dtype),
        )


def _scaled_rows(logits2d: torch.Tensor, dtype: torch.dtype, temperature: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """``idx -> logits2d[idx] / temperature`` in ``dtype``: a fresh chunk (``index_select`` copies)."""

    def chunk(idx: torch.Tensor) -> torch.Tensor:
        z = logits2d.index_select(0, idx).to(dtype)
        return z if temperature == 1.0 else z.div_(temperature)

    return chunk


class _LabelLogProbs(torch.autograd.Function):
    """``(log p(label), mean_v log p(v), H(p))`` per row of ``logits2d`` ``[N, V]`` with
    ``p = softmax(row / temperature)``; zeros where ignored. The entropy (computed only ``with_entropy``) has no
    gradient."""

    @staticmethod
    def forward(ctx: Any, logits2d: torch.Tensor, labels1d: torch.Tensor, ignore_index: int, chunk_size: int,
                temperature: float, with_entropy: bool):
        acc = acc_dtype(logits2d.dtype)
        rows = labelled_rows(labels1d, ignore_index)
        scores = _score_rows(rows, labels1d, logits2d.shape[0], acc, logits2d.device, chunk_size,
                             _scaled_rows(logits2d, acc, temperature), with_entropy)
        ctx.save_for_backward(logits2d, labels1d, rows, scores.lse)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        ctx.mark_non_differentiable(scores.entropy)
        ctx.set_materialize_grads(False)
        return scores.label_lp, scores.mean_lp, scores.entropy

    @staticmethod
    def backward(ctx: Any, g_label: torch.Tensor | None, g_mean: torch.Tensor | None, _g_entropy: Any):
        logits2d, labels1d, rows, lse = ctx.saved_tensors
        grad = torch.zeros_like(logits2d)
        if g_label is None and g_mean is None:
            return grad, None, None, None, None, None
        chunks = _row_grads(rows, labels1d, lse, ctx.chunk_size, _scaled_rows(logits2d, lse.dtype, ctx.temperature),
                            g_label, g_mean)
        for idx, dz in chunks:
            if ctx.temperature != 1.0:  # the chain rule through z / temperature
                dz = dz.div_(ctx.temperature)
            grad.index_copy_(0, idx, dz.to(grad.dtype))
        return grad, None, None, None, None, None


class _LinearLabelLogProbs(torch.autograd.Function):
    """Like :class:`_LabelLogProbs` (at temperature 1, no entropy) but from ``hidden2d`` ``[N, H]`` and
    ``weight`` ``[V, H]``.

    The logits ``hidden @ weight.T (+ bias)`` exist one chunk at a time, in forward and (recomputed)
    in backward. The weight gradient is accumulated in float32.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden2d: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels1d: torch.Tensor,
        ignore_index: int,
        chunk_size: int,
    ):
        rows = labelled_rows(labels1d, ignore_index)
        scores = _score_rows(rows, labels1d, hidden2d.shape[0], acc_dtype(weight.dtype), hidden2d.device, chunk_size,
                             lambda idx: linear_logits(hidden2d.index_select(0, idx), weight, bias))
        ctx.save_for_backward(hidden2d, weight, bias, labels1d, rows, scores.lse)
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        return scores.label_lp, scores.mean_lp

    @staticmethod
    def backward(ctx: Any, g_label: torch.Tensor | None, g_mean: torch.Tensor | None):
        hidden2d, weight, bias, labels1d, rows, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden2d) if need_h else None
        acc = lse.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        if g_label is not None or g_mean is not None:
            chunks = _row_grads(rows, labels1d, lse, ctx.chunk_size,
                                lambda idx: linear_logits(hidden2d.index_select(0, idx), weight, bias), g_label, g_mean)
            for idx, dz in chunks:
                if grad_b is not None:
                    grad_b += dz.sum(0)
                dz = dz.to(weight.dtype)
                if grad_h is not None:
                    grad_h.index_copy_(0, idx, (dz @ weight).to(grad_h.dtype))
                if grad_w is not None:
                    grad_w += (dz.t() @ hidden2d.index_select(0, idx).to(weight.dtype)).to(acc)
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
        )


def label_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX,
    chunk_size: int = DEFAULT_CHUNK_SIZE, *, temperature: float = 1.0, vocab_shard: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position ``(log p(label), mean_v log p(v))`` in :func:`acc_dtype`, shaped like ``labels``, with
    ``p = softmax(logits / temperature)``.

    No shift here: ``logits[..., i, :]`` scores ``labels[..., i]``. Ignored positions are 0. With a
    ``vocab_shard`` (:class:`~twinkle_core.loss.vocab_parallel.VocabShard`, from ``LossContext.vocab_shard``)
    ``logits`` are this rank's slice of the vocabulary and the softmax is taken across its group.
    """
    label_lp, mean_lp, _ = _chunked_scores(logits, labels, ignore_index, chunk_size, temperature, False, vocab_shard)
    return label_lp, mean_lp


def _chunked_scores(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, chunk_size: int,
                    temperature: float, with_entropy: bool,
                    vocab_shard: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_options(chunk_size, temperature)
    if vocab_shard is not None:
        # imported here: vocab_parallel builds on this module's helpers
        from twinkle_core.loss.vocab_parallel import vocab_parallel_scores

        return vocab_parallel_scores(logits, labels, vocab_shard, ignore_index, chunk_size, temperature, with_entropy)
    vocab = logits.shape[-1]
    flat_labels = labels.reshape(-1).to(device=logits.device, dtype=torch.long)
    scores = _LabelLogProbs.apply(logits.reshape(-1, vocab), flat_labels, ignore_index, chunk_size,
                                  float(temperature), with_entropy)
    return tuple(score.view(labels.shape) for score in scores)


def linear_label_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`label_logprobs` of ``hidden @ weight.T + bias`` without materialising those logits."""
    _check_options(chunk_size)
    flat_labels = labels.reshape(-1).to(device=hidden.device, dtype=torch.long)
    label_lp, mean_lp = _LinearLabelLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, flat_labels, ignore_index, chunk_size
    )
    return label_lp.view(labels.shape), mean_lp.view(labels.shape)


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX,
    chunk_size: int = DEFAULT_CHUNK_SIZE, *, temperature: float = 1.0, vocab_shard: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted per-token log-probabilities of the labels.

    Args:
        logits: ``[B, T, V]``.
        labels: ``[B, T]``, aligned with ``input_ids``.
        temperature: score under ``softmax(logits / temperature)`` (the sampling temperature of a rollout).
        vocab_shard: ``LossContext.vocab_shard`` when ``logits`` are this rank's vocabulary slice (see
            :func:`label_logprobs`).

    Returns:
        ``(logps, mask)``, both ``[B, T - 1]``: ``logps[:, t] = log softmax(logits[:, t])[labels[:, t + 1]]``
        in :func:`acc_dtype` (0 where masked) and ``mask`` the boolean ``labels[:, 1:] != ignore_index``.
    """
    shifted = shift_labels(labels.to(logits.device), ignore_index)
    logps, _ = label_logprobs(logits, shifted, ignore_index, chunk_size, temperature=temperature,
                              vocab_shard=vocab_shard)
    return logps[..., :-1], shifted[..., :-1] != ignore_index


class TokenLogprobs(NamedTuple):
    """Per shifted position, ``[B, T - 1]``: ``logps`` (with gradient, 0 where masked), ``entropy`` (no
    gradient, 0 where masked) and the boolean ``mask`` of label positions."""

    logps: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor


def tempered_token_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                            ignore_index: int = IGNORE_INDEX, chunk_size: int = DEFAULT_CHUNK_SIZE,
                            vocab_shard: Any = None) -> TokenLogprobs:
    """Shifted ``log softmax(logits / temperature)[label]`` and entropies, ``[B, T - 1]`` in float32 (or 64).

    Args:
        logits: ``[B, T, V]`` (``[B, T, V / tp]`` with a ``vocab_shard``, see :func:`label_logprobs`).
        labels: ``[B, T]``, aligned with ``input_ids``; ``ignore_index`` marks positions not scored.
    """
    shifted = shift_labels(labels.to(logits.device), ignore_index)
    logps, _, entropy = _chunked_scores(logits, shifted, ignore_index, chunk_size, temperature, True, vocab_shard)
    return TokenLogprobs(logps[..., :-1], entropy[..., :-1], shifted[..., :-1] != ignore_index)


def next_token_scores(logits: torch.Tensor, inputs: dict[str, Any], *, temperature: float = 1.0,
                      ignore_index: int = IGNORE_INDEX, chunk_size: int = DEFAULT_CHUNK_SIZE,
                      vocab_shard: Any = None, with_entropy: bool = False) -> TokenLogprobs:
    """:func:`tempered_token_logprobs` of the batch's labels, whole rows or sequence-parallel slices alike.

    Whole rows (``inputs["labels"]`` ``[B, T]``): ``[B, T - 1]``, the shifted layout. A slice of each sequence
    (``shift_labels`` ``[B, L]`` and no ``labels``: see :mod:`twinkle_core.loss.sequence_group`): ``[B, L]``, every
    position, since the strategy shifted the labels before splitting (the last position of a slice scores the first
    label of the next). Either way per-token inputs aligned by the strategy or the task match the result's layout.
    ``entropy`` is all zeros unless ``with_entropy``.
    """
    sliced = is_sequence_slice(inputs)
    labels = next_token_labels(inputs, ignore_index, logits.device) if sliced else shift_labels(
        inputs["labels"].to(logits.device), ignore_index)
    logps, _, entropy = _chunked_scores(logits, labels, ignore_index, chunk_size, temperature, with_entropy,
                                        vocab_shard)
    if not sliced:  # the last position of a whole row predicts nothing
        logps, entropy, labels = logps[..., :-1], entropy[..., :-1], labels[..., :-1]
    return TokenLogprobs(logps, entropy, labels != ignore_index)
