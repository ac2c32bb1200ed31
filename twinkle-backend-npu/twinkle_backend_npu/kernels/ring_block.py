"""Ring attention's full and causal blocks as ``npu_fusion_attention`` (the ring's :class:`BlockAttention` seam).

Ring attention (``twinkle_backend_hf.sequence_parallel``) merges one key/value block at a time with the online
softmax and needs each block's output and per-query log-sum-exp. ``npu_fusion_attention`` returns the output and,
per query row, ``softmax_max`` (the largest scaled score) and ``softmax_sum`` (the sum of ``exp(score - max)``),
both float32 ``(B, N, Sq, 8)`` with the value repeated over the last dimension (the Ascend op reference; MindSpeed's
``npu_ring_attention_update`` merges blocks from exactly these two), so ``lse = softmax_max + log(softmax_sum)``.

Layout ``BNSD``, the ring's own; grouped-query attention is native (query head ``h`` reads key/value head
``h // (N / Nkv)``). A full block takes no mask (``sparse_mode=0``); the causal diagonal block takes
``sparse_mode=2`` (causal aligned top-left) with the compressed 2048x2048 mask, as the op requires. Blocks of packed
sequences stay with the ring's plain matrix products: a row of one sequence can meet a block of another sequence's
keys only, and the op leaves a row without a visible key undefined.
"""

from __future__ import annotations

from typing import Any

from twinkle_backend_npu.kernels.attention import attention_layers, compressed_causal_mask

_FULL, _CAUSAL_TOP_LEFT = 0, 2  # sparse_mode values


def block_attention(q: Any, k: Any, v: Any, *, scale: float, causal: bool) -> tuple[Any, Any]:
    """q (B, N, Sq, D), k/v (B, Nkv, Sk, D) -> (out (B, N, Sq, D), lse (B, N, Sq) float32)."""
    import torch
    import torch_npu

    out, softmax_max, softmax_sum = torch_npu.npu_fusion_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), q.shape[1], "BNSD",
        atten_mask=compressed_causal_mask(q.device) if causal else None, scale=scale,
        sparse_mode=_CAUSAL_TOP_LEFT if causal else _FULL)[:3]
    return out, softmax_max[..., 0] + torch.log(softmax_sum[..., 0])


def apply(network: Any) -> int:
    """Attach :func:`block_attention` to ``network``'s attention layers; ring attention uses it where it runs."""
    from twinkle_backend_hf.sequence_parallel.ring_blocks import use_block_attention

    layers = attention_layers(network)
    for layer in layers:
        use_block_attention(layer, block_attention)
    return len(layers)
