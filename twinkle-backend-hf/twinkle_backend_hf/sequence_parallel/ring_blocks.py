"""One block of ring attention (local queries x one key/value block), and the seam for a fused kernel to compute it.

Ring attention (:mod:`.ring_attention`) needs, for every key/value block that reaches a rank, the block's
normalised output and each query row's log-sum-exp of its scores; it merges the blocks with the online softmax and
its backward recomputes each block's probabilities from the *merged* log-sum-exp, so a block kernel is needed in the
forward pass only, and any kernel that computes the block exactly gives the ring's exact gradients.

:class:`BlockAttention` is that contract. Ring blocks come in three kinds: every key visible (``full``), the
causal diagonal block, whose queries and keys are the same tokens (``causal``: key ``j`` visible to query ``i``
iff ``j <= i``), and element-wise masks (packed sequences). A kernel is asked for the first two, which every fused
attention op expresses; masked blocks stay with :func:`plain_block_attention`, whose rows may see no key at all
(another sequence's block), something fused ops do not define.

A kernel plugin attaches its kernel to a network's attention layers with :func:`use_block_attention` (from a
``"model"`` kernel of :mod:`twinkle_core.kernels`, so the accelerator and the ``kernels`` switch decide); ring
attention looks it up on the layer it runs for (:func:`block_attention_of`). Nothing changes for other networks
in the same process.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch

#: a block's mask: ``full`` (none), ``causal`` (square, lower triangle), ``masked`` (element-wise, see ``mask``)
BlockKind = Literal["full", "causal", "masked"]
#: the attribute of an attention layer that holds its block kernel (read through wrappers that forward attributes)
ATTRIBUTE = "twinkle_ring_block_attention"


class BlockAttention(Protocol):
    """``(q [B, H, Sq, D], k, v [B, Hkv, Sk, D], scale, causal) -> (out [B, H, Sq, D], lse [B, H, Sq])``.

    ``out`` is ``softmax(scale * q k^T) v`` over the visible keys, ``lse`` the natural-log sum of ``exp`` of the
    visible scaled scores (float32 or wider). Query head ``h`` reads key/value head ``h // (H / Hkv)`` (as
    transformers' ``repeat_kv``). ``causal``: ``Sq == Sk`` and key ``j`` is visible to query ``i`` iff ``j <= i``;
    otherwise every key is visible, so every row sees at least one key. Inputs keep the model's dtype (the ring
    merges in at least float32); the kernel need not be differentiable."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                 causal: bool) -> tuple[torch.Tensor, torch.Tensor]: ...


def use_block_attention(module: torch.nn.Module, kernel: BlockAttention | None) -> None:
    """Make ring attention compute ``module``'s (an attention layer's) full and causal blocks with ``kernel``
    (``None``: with :func:`plain_block_attention` again)."""
    if kernel is None:
        module.__dict__.pop(ATTRIBUTE, None)
    else:
        setattr(module, ATTRIBUTE, kernel)


def block_attention_of(module: Any) -> BlockAttention | None:
    """The kernel attached to the attention layer ``module`` (or a view of it), or ``None``."""
    return getattr(module, ATTRIBUTE, None)


def finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (a row that has seen no visible key yet) replaced by 0, so ``exp(x - lse)`` is 0, not nan."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv, S, D]`` -> ``[B, Hkv * groups, S, D]``, each key/value head serving ``groups`` consecutive heads."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def masked_scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """``scale * q k^T`` with ``-inf`` where ``mask`` (broadcast to ``[B, H, Sq, Sk]``, True = visible) is False."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def plain_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                          mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The block in plain matrix products, in ``q``'s dtype; any element-wise ``mask`` (a row that sees no key
    gets output 0 and log-sum-exp ``-inf``)."""
    k, v = (repeat_heads(t, q.shape[1] // t.shape[1]) for t in (k, v))
    s = masked_scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - finite(lse)[..., None]), v), lse


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, kind: BlockKind,
                  mask: torch.Tensor | None, kernel: BlockAttention | None,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's ``(out, lse)`` in ``dtype``: by ``kernel`` for a full or causal block, else in plain matrix
    products computed in ``dtype``."""
    if kernel is None or kind == "masked":
        return plain_block_attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=scale, mask=mask)
    out, lse = kernel(q, k, v, scale=scale, causal=kind == "causal")
    return out.to(dtype), lse.to(dtype)
