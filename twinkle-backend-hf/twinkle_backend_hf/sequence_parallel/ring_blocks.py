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

Without a plugin's kernel, full and causal blocks go to torch's own fused attention (:func:`torch_block_attention`:
FlashAttention on the CPU, about 10x faster than the plain products for a 2,048-token causal block, and
FlashAttention-2 or the memory-efficient kernel on CUDA). On the CPU their backward is torch's fused FlashAttention
backward too (:func:`torch_block_backward`), given the merged output and log-sum-exp.

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


def torch_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                          causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A full or causal block by torch's own fused attention kernels, which also return the log-sum-exp:
    FlashAttention on the CPU (every float dtype); on CUDA FlashAttention-2 for fp16 / bf16 with head size up to
    256, else the memory-efficient kernel (whose log-sum-exp is padded to a multiple of 32 rows)."""
    k, v = (repeat_heads(t, q.shape[1] // t.shape[1]) for t in (k, v))
    q, k, v = (t.contiguous() for t in (q, k, v))
    if q.device.type == "cuda":
        if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        else:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                             scale=scale)[:2]
        return out, lse[..., :q.shape[2]]
    return tuple(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale))


def torch_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, *, scale: float,
                         causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A full or causal block's share of the ring's gradients by torch's fused FlashAttention backward (CPU).

    Given the *merged* output and log-sum-exp of the query rows (``out``, ``lse``: over every block of the ring),
    the kernel's ``P = exp(scale q k^T - lse)`` and ``dS = P (dO v^T - rowsum(dO * out))`` are exactly the
    ring's per-block recomputation, so it returns the block's ``(dq, dk, dv)``; ``k``/``v`` have the query's
    heads (repeated), and so do ``dk``/``dv``. All inputs in one float dtype."""
    return tuple(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(t.contiguous() for t in (dout, q, k, v, out, lse)), 0.0, causal, scale=scale))


def fused_block_backward(device: torch.device) -> Any:
    """:func:`torch_block_backward` where torch has it (the CPU), else ``None`` (the ring's matrix products)."""
    return torch_block_backward if device.type == "cpu" else None


def default_block_attention(device: torch.device) -> BlockAttention | None:
    """The kernel for full and causal blocks when no plugin attached one: torch's own on CPU and CUDA."""
    return torch_block_attention if device.type in ("cpu", "cuda") else None


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, kind: BlockKind,
                  mask: torch.Tensor | None, kernel: BlockAttention | None,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's ``(out, lse)`` in ``dtype``: a full or causal block by ``kernel`` (``None``: torch's fused
    kernel where :func:`default_block_attention` has one), a masked one in plain matrix products in ``dtype``."""
    if kernel is None:
        kernel = default_block_attention(q.device)
    if kernel is None or kind == "masked":
        return plain_block_attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=scale, mask=mask)
    out, lse = kernel(q, k, v, scale=scale, causal=kind == "causal")
    return out.to(dtype), lse.to(dtype)
