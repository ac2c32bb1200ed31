"""Label log-probabilities and entropies of ``softmax(logits / temperature)``, chunked.

The policy losses score the sampled tokens under the distribution they were sampled from: a rollout
drawn at temperature ``T`` came from ``softmax(z / T)``, so its importance ratios must use
``log softmax(z / T)`` (TRL's GRPO trainer divides the logits by the sampling temperature the same way).

Memory: ``logits / T`` on the whole tensor would allocate a second ``[B, T, V]`` tensor and keep it alive
until backward (autograd saves it for the log-softmax). Here the division happens per chunk of
``chunk_size`` label rows, on the float32 copy of that chunk that the log-sum-exp needs anyway, and the
backward pass recomputes it chunk by chunk. The extra memory beyond the logits and their gradient is
``O(chunk_size * V)`` float32 plus ``O(B * T)``, whatever ``T`` is, and unlabelled rows (the prompt) cost
nothing. The entropy comes out of the same forward pass, without gradient.

Shift convention (as :func:`twinkle_core.loss.logprobs.token_logprobs`): ``logits[:, t]`` predicts
``labels[:, t + 1]``; outputs are ``[B, T - 1]``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from twinkle_core.loss.logprobs import DEFAULT_CHUNK_SIZE, acc_dtype, shift_labels


class TokenLogprobs(NamedTuple):
    """Per shifted position, ``[B, T - 1]``: ``logps`` (with gradient, 0 where masked), ``entropy`` (no
    gradient, 0 where masked) and the boolean ``mask`` of label positions."""

    logps: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor


def _scaled_rows(logits2d: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """``logits2d[idx] / temperature`` in ``dtype``: a fresh chunk (``index_select`` copies), safe to modify in place."""
    z = logits2d.index_select(0, idx).to(dtype)
    return z if temperature == 1.0 else z.div_(temperature)


class _TemperedLabelLogProbs(torch.autograd.Function):
    """``(log p(label), H(p))`` per row of ``logits2d`` ``[N, V]`` with ``p = softmax(row / temperature)``.

    Gradient of ``log p(y)`` with respect to the row ``z``: ``(onehot(y) - p) / temperature``."""

    @staticmethod
    def forward(ctx: Any, logits2d: torch.Tensor, labels1d: torch.Tensor, ignore_index: int,
                temperature: float, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        acc = acc_dtype(logits2d.dtype)
        rows = (labels1d != ignore_index).nonzero(as_tuple=True)[0]
        label_lp = torch.zeros(logits2d.shape[0], dtype=acc, device=logits2d.device)
        entropy = torch.zeros_like(label_lp)
        lse = torch.empty(rows.numel(), dtype=acc, device=logits2d.device)
        for start in range(0, rows.numel(), chunk_size):
            idx = rows[start:start + chunk_size]
            z = _scaled_rows(logits2d, idx, acc, temperature)
            chunk_lse = torch.logsumexp(z, dim=1)
            y = labels1d.index_select(0, idx).unsqueeze(1)
            label_lp.index_copy_(0, idx, z.gather(1, y).squeeze(1) - chunk_lse)
            log_p = z.sub_(chunk_lse.unsqueeze(1))
            # -sum p log p on log-probs directly: exact where p underflows (the term is 0, not 0 * -inf)
            entropy.index_copy_(0, idx, -(log_p.exp() * log_p).sum(dim=1))
            lse[start:start + idx.numel()] = chunk_lse
        ctx.save_for_backward(logits2d, labels1d, rows, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return label_lp, entropy

    @staticmethod
    def backward(ctx: Any, g_label: torch.Tensor | None, _g_entropy: torch.Tensor | None):
        logits2d, labels1d, rows, lse = ctx.saved_tensors
        grad = torch.zeros_like(logits2d)
        if g_label is None:
            return grad, None, None, None, None
        for start in range(0, rows.numel(), ctx.chunk_size):
            idx = rows[start:start + ctx.chunk_size]
            g = g_label.index_select(0, idx).to(lse.dtype).unsqueeze(1)
            z = _scaled_rows(logits2d, idx, lse.dtype, ctx.temperature)
            dz = z.sub_(lse[start:start + idx.numel()].unsqueeze(1)).exp_().mul_(-g)
            dz.scatter_add_(1, labels1d.index_select(0, idx).unsqueeze(1), g)
            grad.index_copy_(0, idx, dz.div_(ctx.temperature).to(grad.dtype))
        return grad, None, None, None, None


def tempered_token_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                            ignore_index: int = -100, chunk_size: int = DEFAULT_CHUNK_SIZE) -> TokenLogprobs:
    """Shifted ``log softmax(logits / temperature)[label]`` and entropies, ``[B, T - 1]`` in float32 (or 64).

    Args:
        logits: ``[B, T, V]``.
        labels: ``[B, T]``, aligned with ``input_ids``; ``ignore_index`` marks positions not scored.
    """
    if not temperature > 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be positive and finite, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    shifted = shift_labels(labels.to(logits.device), ignore_index)
    flat_labels = shifted.reshape(-1).long()
    logps, entropy = _TemperedLabelLogProbs.apply(
        logits.reshape(-1, logits.shape[-1]), flat_labels, ignore_index, float(temperature), chunk_size)
    logps, entropy = logps.view(shifted.shape), entropy.view(shifted.shape)
    return TokenLogprobs(logps[..., :-1], entropy[..., :-1], shifted[..., :-1] != ignore_index)


__all__ = ["TokenLogprobs", "tempered_token_logprobs"]
