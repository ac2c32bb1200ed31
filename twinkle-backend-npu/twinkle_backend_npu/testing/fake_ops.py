"""Plain-torch stand-ins for the ``torch_npu`` fused ops Twinkle's NPU kernels call, for CPU tests.

Each op keeps the real ``torch_npu`` signature, argument names and return convention (documented in the Ascend
"torch_npu API" reference), so the kernels that call them are right on real hardware; the arithmetic is the
textbook formula, in the order the Hugging Face modules use, so that fp32 parity tests are tight. Where the real op
accepts something these fakes do not model (e.g. ``sparse_mode`` 1 or 4-8), they raise rather than guess.

* ``npu_rms_norm(self, gamma, epsilon=1e-6) -> (y, rstd)``: ``rstd`` is float32, reduced over ``gamma``'s dims.
* ``npu_rotary_mul(self, r1, r2, rotary_mode="half") -> x * r1 + rotate(x) * r2``.
* ``npu_swiglu(self, dim=-1) -> silu(a) * b`` where ``a, b = self.chunk(2, dim)``.
* ``npu_fusion_attention(query, key, value, head_num, input_layout, ..., sparse_mode=0) -> (attention_out,
  softmax_max, softmax_sum, softmax_out, seed, offset, numels)``; layouts ``BSH``, ``SBH``, ``BSND``, ``BNSD``
  and ``TND`` (packed: ``actual_seq_qlen`` / ``actual_seq_kvlen`` are *cumulative* end offsets); ``atten_mask``
  is bool with ``True`` = masked; ``sparse_mode`` 0 (the given mask, plus the ``pre_tockens``/``next_tockens``
  band), 2 (causal aligned top-left) and 3 (causal aligned bottom-right) — 2 and 3 take the compressed
  2048x2048 upper-triangular mask, as the real op requires.
* ``NpuFusedAdamW``: ``torch_npu.optim.NpuFusedAdamW``'s signature; the update is torch's AdamW.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

#: the side of the compressed causal mask sparse_mode 2 and 3 take
COMPRESSED_MASK_SIZE = 2048
_NO_LIMIT = 2147483647


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    if self.dtype != gamma.dtype:
        raise RuntimeError(f"npu_rms_norm: gamma ({gamma.dtype}) must have the dtype of self ({self.dtype})")
    if tuple(self.shape[self.dim() - gamma.dim():]) != tuple(gamma.shape):
        raise RuntimeError(f"npu_rms_norm: gamma {tuple(gamma.shape)} must match the last dims of self "
                           f"{tuple(self.shape)}")
    dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    x = self.to(torch.promote_types(self.dtype, torch.float32))  # half types are normalised in float32
    rstd = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + epsilon)
    y = (x * rstd).to(self.dtype) * gamma
    return y, rstd.to(torch.float32)


def _rotate(x: torch.Tensor, rotary_mode: str) -> torch.Tensor:
    if rotary_mode == "half":
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    if rotary_mode == "interleave":
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    raise RuntimeError(f"npu_rotary_mul: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")


def npu_rotary_mul(self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    if self.dim() != 4 or r1.dim() != 4 or r1.shape != r2.shape:
        raise RuntimeError(f"npu_rotary_mul: expects 4-D x and two 4-D r1/r2 of one shape, got x "
                           f"{tuple(self.shape)}, r1 {tuple(r1.shape)}, r2 {tuple(r2.shape)}")
    torch.broadcast_shapes(self.shape, r1.shape)  # the real op broadcasts r1/r2 over x, never the other way
    return self * r1 + _rotate(self, rotary_mode) * r2


def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if self.shape[dim] % 2:
        raise RuntimeError(f"npu_swiglu: dim {dim} of {tuple(self.shape)} must be even (it is split in two)")
    a, b = self.chunk(2, dim=dim)
    return F.silu(a) * b


def _to_bnsd(x: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """One of the 4-D/3-D layouts as (B, N, S, D); ``heads`` splits the hidden size of BSH/SBH."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BSH":
        return x.unflatten(-1, (heads, -1)).transpose(1, 2)
    if layout == "SBH":
        return x.unflatten(-1, (heads, -1)).permute(1, 2, 0, 3)
    raise RuntimeError(f"npu_fusion_attention: input_layout must be BSH, SBH, BSND, BNSD or TND, got {layout!r}")


def _from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BSH":
        return x.transpose(1, 2).flatten(-2)
    return x.permute(2, 0, 1, 3).flatten(-2)  # SBH


def _masked(sq: int, skv: int, mask: torch.Tensor | None, sparse_mode: int, pre_tockens: int, next_tockens: int,
            device: torch.device) -> torch.Tensor | None:
    """Bool (.., sq, skv), True where a query may not see a key."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(skv, device=device)[None, :]
    if sparse_mode in (2, 3):
        if mask is None or tuple(mask.shape[-2:]) != (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE):
            raise RuntimeError(f"npu_fusion_attention: sparse_mode {sparse_mode} needs atten_mask = "
                               f"torch.triu(torch.ones(2048, 2048), diagonal=1).bool()")
        return j > i + (skv - sq if sparse_mode == 3 else 0)
    if sparse_mode != 0:
        raise NotImplementedError(f"the fake npu_fusion_attention models sparse_mode 0, 2 and 3, not {sparse_mode}")
    # keys outside [i - pre_tockens, i + next_tockens] are masked; the defaults mean no band
    band = (j > i + next_tockens) | (j < i - pre_tockens) if (pre_tockens, next_tockens) != (_NO_LIMIT,) * 2 else None
    if mask is None:
        return band
    mask = mask.to(torch.bool)
    return mask if band is None else mask | band


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor | None, scale: float,
            keep_prob: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, N, S, D) q against (B, Nkv, S, D) k/v: output, softmax max and sum (fp32, per query)."""
    if q.shape[1] % k.shape[1]:
        raise RuntimeError(f"npu_fusion_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} "
                           f"key/value heads")
    groups = q.shape[1] // k.shape[1]  # query head h reads key/value head h // groups
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    scores32 = scores.to(torch.promote_types(scores.dtype, torch.float32))  # softmax of half types in float32
    probs = F.softmax(scores32, dim=-1).to(q.dtype)
    if keep_prob < 1.0:
        probs = F.dropout(probs, p=1.0 - keep_prob)
    top = scores32.amax(-1)
    return torch.matmul(probs, v), top, torch.exp(scores32 - top[..., None]).sum(-1)


def _segments(ends: Sequence[int] | None, total: int, what: str) -> list[tuple[int, int]]:
    if ends is None:
        raise RuntimeError(f"npu_fusion_attention: input_layout TND needs {what} (cumulative sequence ends)")
    ends = [int(e) for e in ends]
    if ends != sorted(ends) or not ends or ends[-1] != total:
        raise RuntimeError(f"npu_fusion_attention: {what} must be increasing cumulative ends reaching T={total}, "
                           f"got {ends}")
    return list(zip([0, *ends[:-1]], ends))


def npu_fusion_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
                         input_layout: str, pse: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
                         atten_mask: torch.Tensor | None = None, scale: float = 1.0, keep_prob: float = 1.0,
                         pre_tockens: int = _NO_LIMIT, next_tockens: int = _NO_LIMIT, inner_precise: int = 0,
                         prefix: Sequence[int] | None = None, actual_seq_qlen: Sequence[int] | None = None,
                         actual_seq_kvlen: Sequence[int] | None = None, sparse_mode: int = 0,
                         gen_mask_parallel: bool = True, sync: bool = False) -> tuple[Any, ...]:
    if pse is not None or padding_mask is not None or prefix is not None:
        raise NotImplementedError("the fake npu_fusion_attention does not model pse, padding_mask or prefix")
    if input_layout != "TND":
        kv_heads = key.shape[-1] // (query.shape[-1] // head_num) if input_layout in ("BSH", "SBH") else 0
        q = _to_bnsd(query, input_layout, head_num)
        k, v = _to_bnsd(key, input_layout, kv_heads), _to_bnsd(value, input_layout, kv_heads)
        masked = _masked(q.shape[2], k.shape[2], atten_mask, sparse_mode, pre_tockens, next_tockens, q.device)
        out, top, total = _attend(q, k, v, masked, scale, keep_prob)
        out = _from_bnsd(out, input_layout)
    else:  # packed: (T, N, D), each sequence attends only within itself
        outs, tops, totals = [], [], []
        q_segments = _segments(actual_seq_qlen, query.shape[0], "actual_seq_qlen")
        kv_segments = _segments(actual_seq_kvlen, key.shape[0], "actual_seq_kvlen")
        if len(q_segments) != len(kv_segments):
            raise RuntimeError("npu_fusion_attention: actual_seq_qlen and actual_seq_kvlen name different counts")
        for (qa, qb), (ka, kb) in zip(q_segments, kv_segments):
            q, k, v = (t.transpose(0, 1)[None] for t in (query[qa:qb], key[ka:kb], value[ka:kb]))
            mask = atten_mask if sparse_mode in (2, 3) else None
            if sparse_mode == 0 and atten_mask is not None:
                raise NotImplementedError("the fake npu_fusion_attention takes TND with sparse_mode 0 only unmasked")
            masked = _masked(qb - qa, kb - ka, mask, sparse_mode, pre_tockens, next_tockens, query.device)
            out, top, total = _attend(q, k, v, masked, scale, keep_prob)
            outs.append(out[0].transpose(0, 1))
            tops.append(top[0].transpose(0, 1))
            totals.append(total[0].transpose(0, 1))
        out, top, total = torch.cat(outs), torch.cat(tops), torch.cat(totals)
    # the real op repeats softmax max/sum 8 times in a last dim of 8 and returns an empty softmax_out
    softmax_max, softmax_sum = top[..., None].expand(*top.shape, 8), total[..., None].expand(*total.shape, 8)
    return out, softmax_max, softmax_sum, query.new_empty(0), 0, 0, 0


class NpuFusedAdamW(torch.optim.AdamW):
    """``torch_npu.optim.NpuFusedAdamW``'s signature (no ``foreach``/``fused``/``capturable``); torch's AdamW update."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, foreach=False)
