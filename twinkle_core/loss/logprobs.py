"""Per-token log-probabilities of the labels, computed with bounded memory.

Every built-in loss that needs ``log p(label)`` (cross entropy, DPO, GRPO and friends) goes through
this module, so the shift convention and the numerics live in one place.

Conventions
-----------
``logits`` is ``[B, T, V]`` and ``labels`` is ``[B, T]`` aligned with ``input_ids`` (the Hugging Face
convention): ``logits[:, t]`` predicts ``labels[:, t + 1]``. Positions whose label equals
``ignore_index`` are masked out.

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
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "acc_dtype",
    "label_logprobs",
    "linear_label_logprobs",
    "next_token_labels",
    "shift_labels",
    "token_logprobs",
]

DEFAULT_CHUNK_SIZE = 1024


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``[B, T]`` labels re-aligned with the logits positions: ``out[:, t] = labels[:, t + 1]``.

    The last position (which predicts nothing) gets ``ignore_index``. Shifting the labels instead of
    slicing ``logits[:, :-1]`` keeps the logits a free ``view(-1, V)``, with no copy.
    """
    pad = labels.new_full((*labels.shape[:-1], 1), ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def next_token_labels(inputs: dict[str, Any], ignore_index: int = -100, device: Any = None) -> torch.Tensor:
    """The labels each logits position predicts: ``inputs["shift_labels"]`` when the batch carries them
    already shifted (sequence parallelism shifts before splitting the sequence), else
    ``shift_labels(inputs["labels"])``."""
    if inputs.get("shift_labels") is not None:
        return inputs["shift_labels"].to(device)
    return shift_labels(inputs["labels"].to(device), ignore_index)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype losses compute in: at least float32 (bf16/fp16 are upcast, float64 is kept)."""
    return torch.promote_types(dtype, torch.float32)


def _valid_rows(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return (labels != ignore_index).nonzero(as_tuple=True)[0]


def _chunk_grad(
    z: torch.Tensor, lse: torch.Tensor, y: torch.Tensor, g_label: torch.Tensor | None, g_mean: torch.Tensor | None
) -> torch.Tensor:
    """d/dz of ``g_label * log p(y) + g_mean * mean_v log p(v)`` for one chunk; overwrites ``z``."""
    probs = z.sub_(lse.unsqueeze(1)).exp_()
    total = torch.zeros_like(lse)
    if g_label is not None:
        total = total + g_label
    if g_mean is not None:
        total = total + g_mean
    dz = probs.mul_(-total.unsqueeze(1))
    if g_label is not None:
        dz.scatter_add_(1, y.unsqueeze(1), g_label.unsqueeze(1))
    if g_mean is not None:
        dz.add_(g_mean.unsqueeze(1) / z.shape[1])
    return dz


def _chunk_forward(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lse = torch.logsumexp(z, dim=1)
    label_lp = z.gather(1, y.unsqueeze(1)).squeeze(1) - lse
    mean_lp = z.mean(dim=1) - lse
    return lse, label_lp, mean_lp


class _LabelLogProbs(torch.autograd.Function):
    """``(log p(label), mean_v log p(v))`` per row of ``logits2d`` ``[N, V]``; zeros where ignored."""

    @staticmethod
    def forward(ctx: Any, logits2d: torch.Tensor, labels1d: torch.Tensor, ignore_index: int, chunk_size: int):
        n_rows, acc = logits2d.shape[0], acc_dtype(logits2d.dtype)
        rows = _valid_rows(labels1d, ignore_index)
        label_lp = torch.zeros(n_rows, dtype=acc, device=logits2d.device)
        mean_lp = torch.zeros(n_rows, dtype=acc, device=logits2d.device)
        lse = torch.empty(rows.numel(), dtype=acc, device=logits2d.device)
        for start in range(0, rows.numel(), chunk_size):
            idx = rows[start : start + chunk_size]
            z = logits2d.index_select(0, idx).to(acc)
            c_lse, c_label, c_mean = _chunk_forward(z, labels1d.index_select(0, idx))
            lse[start : start + idx.numel()] = c_lse
            label_lp.index_copy_(0, idx, c_label)
            mean_lp.index_copy_(0, idx, c_mean)
        ctx.save_for_backward(logits2d, labels1d, rows, lse)
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        return label_lp, mean_lp

    @staticmethod
    def backward(ctx: Any, g_label: torch.Tensor | None, g_mean: torch.Tensor | None):
        logits2d, labels1d, rows, lse = ctx.saved_tensors
        grad = torch.zeros_like(logits2d)
        if g_label is None and g_mean is None:
            return grad, None, None, None
        for start in range(0, rows.numel(), ctx.chunk_size):
            idx = rows[start : start + ctx.chunk_size]
            z = logits2d.index_select(0, idx).to(lse.dtype)
            dz = _chunk_grad(
                z,
                lse[start : start + idx.numel()],
                labels1d.index_select(0, idx),
                None if g_label is None else g_label.index_select(0, idx).to(lse.dtype),
                None if g_mean is None else g_mean.index_select(0, idx).to(lse.dtype),
            )
            grad.index_copy_(0, idx, dz.to(grad.dtype))
        return grad, None, None, None


class _LinearLabelLogProbs(torch.autograd.Function):
    """Like :class:`_LabelLogProbs` but from ``hidden2d`` ``[N, H]`` and ``weight`` ``[V, H]``.

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
        n_rows, acc = hidden2d.shape[0], acc_dtype(weight.dtype)
        rows = _valid_rows(labels1d, ignore_index)
        label_lp = torch.zeros(n_rows, dtype=acc, device=hidden2d.device)
        mean_lp = torch.zeros(n_rows, dtype=acc, device=hidden2d.device)
        lse = torch.empty(rows.numel(), dtype=acc, device=hidden2d.device)
        for start in range(0, rows.numel(), chunk_size):
            idx = rows[start : start + chunk_size]
            z = _linear_chunk(hidden2d.index_select(0, idx), weight, bias)
            c_lse, c_label, c_mean = _chunk_forward(z, labels1d.index_select(0, idx))
            lse[start : start + idx.numel()] = c_lse
            label_lp.index_copy_(0, idx, c_label)
            mean_lp.index_copy_(0, idx, c_mean)
        ctx.save_for_backward(hidden2d, weight, bias, labels1d, rows, lse)
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        return label_lp, mean_lp

    @staticmethod
    def backward(ctx: Any, g_label: torch.Tensor | None, g_mean: torch.Tensor | None):
        hidden2d, weight, bias, labels1d, rows, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden2d) if need_h else None
        acc = lse.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        if g_label is not None or g_mean is not None:
            for start in range(0, rows.numel(), ctx.chunk_size):
                idx = rows[start : start + ctx.chunk_size]
                h = hidden2d.index_select(0, idx)
                dz = _chunk_grad(
                    _linear_chunk(h, weight, bias),
                    lse[start : start + idx.numel()],
                    labels1d.index_select(0, idx),
                    None if g_label is None else g_label.index_select(0, idx).to(acc),
                    None if g_mean is None else g_mean.index_select(0, idx).to(acc),
                )
                if grad_b is not None:
                    grad_b += dz.sum(0)
                dz = dz.to(weight.dtype)
                if grad_h is not None:
                    grad_h.index_copy_(0, idx, (dz @ weight).to(grad_h.dtype))
                if grad_w is not None:
                    grad_w += (dz.t() @ h.to(weight.dtype)).to(acc)
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
        )


def _linear_chunk(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    z = h.to(weight.dtype) @ weight.t()
    if bias is not None:
        z = z + bias
    return z.to(acc_dtype(weight.dtype))


def label_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position ``(log p(label), mean_v log p(v))`` in :func:`acc_dtype`, shaped like ``labels``.

    No shift here: ``logits[..., i, :]`` scores ``labels[..., i]``. Ignored positions are 0.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    vocab = logits.shape[-1]
    flat_labels = labels.reshape(-1).to(device=logits.device, dtype=torch.long)
    label_lp, mean_lp = _LabelLogProbs.apply(logits.reshape(-1, vocab), flat_labels, ignore_index, chunk_size)
    return label_lp.view(labels.shape), mean_lp.view(labels.shape)


def linear_label_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`label_logprobs` of ``hidden @ weight.T + bias`` without materialising those logits."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    flat_labels = labels.reshape(-1).to(device=hidden.device, dtype=torch.long)
    label_lp, mean_lp = _LinearLabelLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, flat_labels, ignore_index, chunk_size
    )
    return label_lp.view(labels.shape), mean_lp.view(labels.shape)


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted per-token log-probabilities of the labels.

    Args:
        logits: ``[B, T, V]``.
        labels: ``[B, T]``, aligned with ``input_ids``.

    Returns:
        ``(logps, mask)``, both ``[B, T - 1]``: ``logps[:, t] = log softmax(logits[:, t])[labels[:, t + 1]]``
        in :func:`acc_dtype` (0 where masked) and ``mask`` the boolean ``labels[:, 1:] != ignore_index``.
    """
    shifted = shift_labels(labels.to(logits.device), ignore_index)
    logps, _ = label_logprobs(logits, shifted, ignore_index, chunk_size)
    return logps[..., :-1], shifted[..., :-1] != ignore_index
