"""Cross entropy that applies the LM head itself, so the ``[N, V]`` logits never exist.

With a large vocabulary the logits dominate a training step's memory: Qwen's 151,936 entries at 2,048
tokens are 1.2 GB in float32, and a plain loss keeps them, their log-softmax and their gradient alive at
once. :func:`linear_cross_entropy` takes the final hidden states and the LM head's weight instead and walks
the labelled rows in at most eight chunks (of at least 64 MiB of float32 logits each). Because the loss is a plain sum, the gradient each chunk
contributes is known in forward already (``softmax - (1 - eps) * onehot - eps / V`` per row), so forward
computes the hidden-state and weight gradients chunk by chunk and backward only scales them by the
upstream gradient: the same matrix products as the unfused head, no recomputation, and one chunk of
logits alive at a time. Without gradients (evaluation) the gradient work is skipped.

The model side: a loss whose :meth:`~twinkle_core.loss.base.Loss.fuses_lm_head` says so receives
``outputs["hidden_states"]`` and ``outputs["lm_head_weight"]`` (optionally ``"lm_head_bias"``) from
``forward_backward`` instead of ``outputs["logits"]`` (see ``TorchTwinkleModel``).
"""

from __future__ import annotations

from typing import Any

import torch

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.loss.logprobs import acc_dtype, labelled_rows, linear_logits

__all__ = ["CHUNK_BYTES", "MAX_CHUNKS", "chunk_rows", "linear_cross_entropy"]

#: float32 bytes of logits one chunk may hold at least (its softmax is computed in place)
CHUNK_BYTES = 64 * 2**20
#: at most this many chunks per call while a chunk stays under 4,096 rows: every chunk adds its weight gradient,
#: a full ``[V, H]`` pass, into the float32 accumulator. With 64 MiB chunks a 16,384-token batch at V=151,936
#: made 150 such passes; on an H200 they cost more than the LM head's matrix products (the fused step took
#: 1.47x the logits path's forward_backward).
MAX_CHUNKS = 8


def chunk_rows(vocab_size: int, total_rows: int = 0) -> int:
    """Rows per chunk: the larger of what fits in :data:`CHUNK_BYTES` of float32 logits and a
    :data:`MAX_CHUNKS`-th of ``total_rows``, 16 to 4,096. Memory stays at most an eighth of the unfused logits
    (or 64 MiB)."""
    by_memory = CHUNK_BYTES // (4 * vocab_size)
    return max(16, min(4096, max(by_memory, -(-total_rows // MAX_CHUNKS))))


class _LinearCrossEntropy(torch.autograd.Function):
    """``sum over labelled rows of (1 - eps) * nll + eps * smoothing`` of ``hidden2d @ weight.T + bias``."""

    @staticmethod
    def forward(ctx: Any, hidden2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels1d: torch.Tensor, ignore_index: int, label_smoothing: float, chunk_size: int):
        acc = acc_dtype(weight.dtype)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden2d) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        rows = labelled_rows(labels1d, ignore_index)
        total = torch.zeros((), dtype=acc, device=hidden2d.device)
        vocab, want_grads = weight.shape[0], need_h or need_w or need_b
        for start in range(0, rows.numel(), chunk_size):
            idx = rows[start : start + chunk_size]
            h, y = hidden2d.index_select(0, idx), labels1d.index_select(0, idx)
            z = linear_logits(h, weight, bias)
            # one exponential pass serves the log-sum-exp and the softmax of the gradient
            label_z = z.gather(1, y.unsqueeze(1)).squeeze(1)
            mean_z = z.mean(dim=1) if label_smoothing else None
            peak = z.amax(dim=1, keepdim=True)
            sums = z.sub_(peak).exp_().sum(dim=1)
            lse = peak.squeeze(1) + sums.log()
            chunk = (lse - label_z).sum() * (1.0 - label_smoothing)
            if label_smoothing:
                chunk = chunk + (lse - mean_z).sum() * label_smoothing
            total += chunk
            if not want_grads:
                continue
            dz = z.div_(sums.unsqueeze(1))  # softmax - (1 - eps) * onehot - eps / V: d(loss) / d(logits)
            dz.scatter_add_(1, y.unsqueeze(1), dz.new_full((idx.numel(), 1), label_smoothing - 1.0))
            if label_smoothing:
                dz.sub_(label_smoothing / vocab)
            if grad_b is not None:
                grad_b += dz.sum(0)
            dz = dz.to(weight.dtype)  # the unfused head's logits gradient has the logits' dtype
            if grad_h is not None:
                grad_h.index_copy_(0, idx, (dz @ weight).to(grad_h.dtype))
            if grad_w is not None:
                if grad_w.dtype == weight.dtype:  # in place: no [V, H] temporary per chunk
                    grad_w.addmm_(dz.t(), h.to(weight.dtype))
                else:
                    grad_w += dz.t() @ h.to(weight.dtype)
        ctx.grads = (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                     None if grad_b is None else grad_b.to(bias.dtype))
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor):
        grads = tuple(None if g is None else g.mul_(grad_total.to(g.dtype)) for g in ctx.grads)
        ctx.grads = None  # backward runs once; free the stash with it
        return (*grads, None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         bias: torch.Tensor | None = None, *, ignore_index: int = IGNORE_INDEX,
                         label_smoothing: float = 0.0, chunk_size: int | None = None) -> torch.Tensor:
    """Summed cross entropy of ``hidden @ weight.T + bias`` against ``labels`` (no shift), label smoothing as in
    :func:`torch.nn.functional.cross_entropy`, computed in at least float32, one chunk of logits at a time.

    ``hidden`` is ``[..., H]``, ``labels`` its leading shape; the result is a float scalar whose gradient reaches
    ``hidden``, ``weight`` and ``bias``. Backward may run once (no ``retain_graph`` double use, no double backward).
    """
    rows = chunk_rows(weight.shape[0], hidden.numel() // hidden.shape[-1]) if chunk_size is None else chunk_size
    if rows < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    flat_labels = labels.reshape(-1).to(device=hidden.device, dtype=torch.long)
    return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, flat_labels,
                                     ignore_index, float(label_smoothing), rows)
