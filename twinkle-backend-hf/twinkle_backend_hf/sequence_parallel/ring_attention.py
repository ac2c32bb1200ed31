"""Ring attention on ``torch.distributed`` point-to-point messages (any backend with isend/irecv, gloo included).

Every rank of the ring group holds ``query``/``key``/``value`` for its share of the sequence (the
layout, :mod:`.ring_layout`, says which global tokens). In the forward pass the key/value block
travels around the ring: at step ``s`` rank ``r`` holds the block of rank ``r - s`` and folds it into
its output with the online softmax (running log-sum-exp, at least float32). The next block is
already on its way while the current one is computed.

The backward pass recomputes each block's probabilities from the saved log-sum-exp (nothing of size
``S x S`` is kept between the passes; on the CPU full and causal blocks do it in torch's fused FlashAttention
backward): ``dQ`` accumulates where it is, while ``dK``/``dV`` travel with
their key/value block and arrive, after the last step, back at the rank that owns it.

Masking is exact per element, from the global token indices of the layout: causal (``key index <=
query index``) and, with ``segment_ids``, packed sequences (a query sees only keys of its own
segment). A block that the causal rule hides completely is skipped (no compute; it still travels).
Grouped-query attention: each key/value head serves ``H / Hkv`` consecutive query heads, as in
``transformers``' ``repeat_kv``; only the ``Hkv`` heads travel.

Each block's forward is :func:`.ring_blocks.block_forward`: for the full and causal blocks a fused attention
kernel, the one a kernel plugin attached to the attention layer or else torch's own (:mod:`.ring_blocks`); plain
matrix products for element-wise masked blocks.
The merge and the backward stay here, so a kernel needs to give the block's output and log-sum-exp only.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from twinkle_backend_hf.sequence_parallel import ring_blocks, ring_layout
from twinkle_backend_hf.sequence_parallel.ulysses import RING_INNER, sequence_ids
from twinkle_core.errors import ConfigError


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any, causal: bool,
                   layout: str, segment_ids: torch.Tensor | None = None, scale: float | None = None,
                   block_attention: ring_blocks.BlockAttention | None = None) -> torch.Tensor:
    """Attention of the local queries over the whole (ring-distributed) sequence.

    ``q`` ``[B, H, S, D]``, ``k``/``v`` ``[B, Hkv, S, D]`` with ``S`` this rank's tokens (in ``layout``
    order); ``segment_ids`` ``[B, S]`` integers (equal ids = the same packed sequence), computed on
    the *global* sequence before sharding. Returns ``[B, H, S, D]`` in ``q``'s dtype. ``group``: the
    ring's process group (``None``: the default group). ``block_attention``: a fused kernel for the full and
    causal blocks (:mod:`.ring_blocks`; ``None``: torch's own fused attention on CPU and CUDA)."""
    ring_layout.check_layout(layout)
    if q.dim() != 4 or k.shape != v.shape or k.shape[:1] + k.shape[2:] != q.shape[:1] + q.shape[2:]:
        raise ValueError(f"ring attention needs q [B, H, S, D] and k, v [B, Hkv, S, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ConfigError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    segments = None if segment_ids is None else _gather_segments(segment_ids, group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, segments, group, bool(causal), layout, float(scale), block_attention)


# ====================================================================== communication
def _gather_segments(segment_ids: torch.Tensor, group: Any) -> torch.Tensor:
    """``[R, B, S]``: every rank's segment ids, indexed by the rank that owns them."""
    local = segment_ids.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.stack(parts)


def _peer(group: Any, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _start_shift(tensor: torch.Tensor, group: Any) -> tuple[torch.Tensor, list[Any]]:
    """Send ``tensor`` to the next rank of the ring and receive the previous rank's; returns the receive
    buffer and the requests to wait on."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), _peer(group, (rank + 1) % size), group),
           dist.P2POp(dist.irecv, received, _peer(group, (rank - 1) % size), group)]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


# ====================================================================== per-block math
class _Block:
    """What rank ``rank`` computes against the key/value block of rank ``source``: the query rows and key
    columns that can meet (:func:`~.ring_layout.causal_window`; all of them without the causal rule), the
    mask on them (``None``: all visible) and its ``kind`` (:data:`~.ring_blocks.BlockKind`: a fused block
    kernel computes ``full`` and ``causal`` blocks), or ``skip`` when nothing meets. ``segments``
    (``[R, B, S]``) add the same-segment rule."""

    def __init__(self, length: int, size: int, rank: int, source: int, causal: bool, layout: str,
                 segments: torch.Tensor | None, device: torch.device) -> None:
        self.rows, self.cols = slice(None), slice(None)
        self.mask: torch.Tensor | None = None
        self.kind: ring_blocks.BlockKind = "full"
        self.skip = False
        if causal:
            window = ring_layout.causal_window(length, size, rank, source, layout)
            self.skip = window is None
            if window is None:
                return
            self.rows, self.cols, q_index, k_index = window
            if int(k_index.max()) > int(q_index.min()):  # not wholly in the past: the element-wise rule
                self.mask = (k_index[None, :] <= q_index[:, None]).to(device)[None, None]
                # the same tokens on both sides (the diagonal block, in both layouts): the lower triangle
                self.kind = "causal" if torch.equal(q_index, k_index) else "masked"
        if segments is not None:
            q_seg, k_seg = segments[rank][:, self.rows], segments[source][:, self.cols]
            same = (q_seg[:, :, None] == k_seg[:, None, :])[:, None]  # [B, 1, Sq, Sk]
            self.mask = same if self.mask is None else self.mask & same
            self.kind = "masked"

    def scores(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
        return ring_blocks.masked_scores(q, k, scale, self.mask)


def _sum_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // groups, groups, s, d).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor | None,
                group: Any, causal: bool, layout: str, scale: float,
                kernel: ring_blocks.BlockAttention | None) -> torch.Tensor:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        acc = torch.promote_types(q.dtype, torch.float32)
        length = q.shape[2] * size
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        for step in range(size):
            requests: list[Any] = []
            if step < size - 1:
                incoming, requests = _start_shift(kv, group)
            block = _Block(length, size, rank, (rank - step) % size, causal, layout, segments, q.device)
            if not block.skip:
                rows = (slice(None), slice(None), block.rows)
                kb, vb = (t[:, :, block.cols] for t in kv.unbind(0))
                block_out, block_lse = ring_blocks.block_forward(q[rows], kb, vb, scale=scale, kind=block.kind,
                                                                 mask=block.mask, kernel=kernel, dtype=acc)
                old_lse = lse[rows]
                new_lse = torch.logaddexp(old_lse, block_lse)
                base = ring_blocks.finite(new_lse)
                out[rows] = (out[rows] * torch.exp(old_lse - base)[..., None]
                             + block_out * torch.exp(block_lse - base)[..., None])
                lse[rows] = new_lse
            if requests:
                _wait(requests)
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse, segments)
        ctx.group, ctx.causal, ctx.layout, ctx.scale = group, causal, layout, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, k, v, out, lse, segments = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        acc = out.dtype
        groups = q.shape[1] // k.shape[1]
        length = q.shape[2] * size
        qf, dout = q.to(acc), grad_out.to(acc)
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO * O): the softmax backward's correction
        lse = ring_blocks.finite(lse)[..., None]
        fused = ring_blocks.fused_block_backward(q.device)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=acc, device=k.device)  # travels with its key/value block
        for step in range(size):
            requests: list[Any] = []
            if step < size - 1:
                incoming, requests = _start_shift(kv, group)
            block = _Block(length, size, rank, (rank - step) % size, ctx.causal, ctx.layout, segments, q.device)
            if not block.skip:
                rows = (slice(None), slice(None), block.rows)
                kb, vb = (ring_blocks.repeat_heads(t[:, :, block.cols].to(acc), groups) for t in kv.unbind(0))
                if fused is not None and block.kind != "masked":
                    dq_block, dk, dv = fused(dout[rows], qf[rows], kb, vb, out[rows], lse[rows][..., 0], scale=scale,
                                             causal=block.kind == "causal")
                    dq[rows] += dq_block
                    dk, dv = _sum_heads(dk, groups), _sum_heads(dv, groups)
                else:
                    p = torch.exp(block.scores(qf[rows], kb, scale) - lse[rows])
                    ds = p * (torch.matmul(dout[rows], vb.transpose(-1, -2)) - delta[rows])
                    dq[rows] += torch.matmul(ds, kb) * scale
                    dk = _sum_heads(torch.matmul(ds.transpose(-1, -2), qf[rows]) * scale, groups)
                    dv = _sum_heads(torch.matmul(p.transpose(-1, -2), dout[rows]), groups)
                dkv[:, :, :, block.cols] += torch.stack([dk, dv])
            if requests:
                _wait(requests)
                kv = incoming
            # after the last step this delivers each block's gradient to the rank that owns the block
            dkv, dkv_requests = _start_shift(dkv, group) if size > 1 else (dkv, [])
            _wait(dkv_requests)
        dk, dv = dkv.unbind(0)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


# ====================================================================== transformers attention implementation
RING_ATTENTION_NAME = RING_INNER  # Ulysses wraps it under this name in the hybrid


@dataclass
class _RingState:
    group: Any = None
    layout: str = "zigzag"


_RING = _RingState()


def set_ring_group(group: Any, layout: str) -> None:
    """Make ``group`` (``None``: no ring, plain SDPA) and ``layout`` the ones the registered attention uses."""
    ring_layout.check_layout(layout)
    _RING.group, _RING.layout = group, layout
    _SEGMENT_CACHE.clear()


class _SegmentCache:
    """One slot: the local segment ids derived from the last local ``position_ids`` tensor seen.

    Every layer of one forward (and a checkpoint recompute) receives the same tensor, so the
    all-gather runs once per forward; the entry is dropped when that tensor is freed."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._ref: Any = None
        self._segments: torch.Tensor | None = None

    def _drop(self, ref: Any) -> None:
        if self._ref is ref:
            self.clear()

    def lookup(self, local: torch.Tensor, group: Any, layout: str) -> torch.Tensor | None:
        if self._ref is not None and self._ref() is local:
            return self._segments
        if local.dim() != 2:
            raise NotImplementedError(f"ring attention needs 2-D position_ids [batch, seq]; got {tuple(local.shape)}")
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        whole = ring_layout.unshard_sequence(parts, layout, dim=1)
        segments = sequence_ids(whole)  # a packed sequence starts wherever positions do not count up by one
        self._segments = None if segments is None else ring_layout.shard_sequence(segments, size, rank, layout)
        self._ref = weakref.ref(local, self._drop)
        return self._segments


_SEGMENT_CACHE = _SegmentCache()


def ring_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, *, dropout: float = 0.0,
                           scaling: float | None = None, is_causal: bool | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: ``query`` ``[B, H, S/R, D]``, ``key``/``value`` ``[B, Hkv, S/R, D]``
    in the ring layout, with *global* ``position_ids``; returns ``([B, S/R, H, D], None)``."""
    if _RING.group is None or dist.get_world_size(_RING.group) == 1:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is not None:
        raise NotImplementedError("ring attention got an attention mask from the model (a 4-D custom mask?); pass "
                                  "padding-free batches (position_ids) or 2-D right/left padding masks")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("ring attention does not support sliding-window attention layers")
    if dropout:
        raise NotImplementedError("ring attention does not support attention dropout; set attention_dropout=0")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    positions = kwargs.get("position_ids")
    segments = None if positions is None else _SEGMENT_CACHE.lookup(positions, _RING.group, _RING.layout)
    out = ring_attention(query, key, value, group=_RING.group, causal=bool(causal), layout=_RING.layout,
                         segment_ids=segments, scale=scaling, block_attention=ring_blocks.block_attention_of(module))
    return out.transpose(1, 2).contiguous(), None


def register_ring_attention() -> str:
    """Register (idempotent) the ring attention in ``transformers.AttentionInterface`` and return its name."""
    from transformers import AttentionInterface

    if RING_ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(RING_ATTENTION_NAME, ring_attention_forward)
    return RING_ATTENTION_NAME
