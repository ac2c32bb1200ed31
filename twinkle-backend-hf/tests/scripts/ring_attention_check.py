"""Ring attention vs. full ``scaled_dot_product_attention`` on the gathered sequence (torchrun, gloo).

    torchrun --nproc-per-node R ring_attention_check.py OUT_DIR

Every rank builds the same whole-sequence inputs (seeded), computes the reference on all of them, and
runs :func:`ring_attention` on its own shard. For each case it writes to ``OUT_DIR/rank{R}.json``, per
quantity (``out``, ``dq``, ``dk``, ``dv``) on its shard: ``delta``, the largest ``|ring - reference|``
with the reference computed in float64 from the same (rounded) inputs; and for the float32 / bfloat16 cases also
``spread``, how far SDPA in that dtype on one process lies from that float64 reference (the float noise of
the computation itself), and ``magnitude``, the largest ``|reference|``, and the ``dtype``. ``tests/test_ring_attention.py``
turns these into tolerances. ``_control_*`` entries are deltas that must be large (a wrong mask), so the
comparisons are known to be able to fail.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from twinkle_backend_hf.sequence_parallel.ring_attention import ring_attention
from twinkle_backend_hf.sequence_parallel.ring_layout import shard_sequence

from twinkle_core.testing.torchrun import exit_job

BATCH, LENGTH, HEAD_DIM = 2, 24, 8  # 24 tokens split into 2R chunks for R = 2 and R = 4
#: packed rows: segment lengths per row (the second row's last segment spans several ranks' chunks)
SEGMENTS = ((5, 11, 8), (3, 21))
#: name: (causal, layout, packed, query heads, key/value heads, dtype)
CASES = {
    "causal_zigzag": (True, "zigzag", False, 4, 4, torch.float64),
    "causal_contiguous": (True, "contiguous", False, 4, 4, torch.float64),
    "full_zigzag": (False, "zigzag", False, 4, 4, torch.float64),
    "full_contiguous": (False, "contiguous", False, 4, 4, torch.float64),
    "causal_zigzag_packed": (True, "zigzag", True, 4, 4, torch.float64),
    "full_contiguous_packed": (False, "contiguous", True, 4, 4, torch.float64),
    "causal_zigzag_gqa": (True, "zigzag", False, 4, 2, torch.float64),
    "causal_contiguous_packed_gqa": (True, "contiguous", True, 6, 2, torch.float64),
    "fp32_causal_zigzag_packed_gqa": (True, "zigzag", True, 4, 2, torch.float32),
    "fp32_full_contiguous": (False, "contiguous", False, 4, 4, torch.float32),
    "bf16_causal_zigzag_packed_gqa": (True, "zigzag", True, 4, 2, torch.bfloat16),
}


def segment_ids() -> torch.Tensor:
    rows = [torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)) for lengths in SEGMENTS]
    return torch.stack(rows)


def reference(q, k, v, dout, causal, segments):
    """Whole-sequence SDPA: the output and the gradients of ``sum(out * dout)``."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    mask = None
    if segments is not None:
        mask = (segments[:, :, None] == segments[:, None, :])[:, None]
        if causal:
            mask = mask & torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                         attn_mask=mask, is_causal=causal and mask is None)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def run_ring(q, k, v, dout, causal, layout, segments, size, rank):
    shard = lambda t: shard_sequence(t, size, rank, layout, dim=2)  # noqa: E731
    ql, kl, vl = (shard(t).detach().requires_grad_(True) for t in (q, k, v))
    local_segments = None if segments is None else shard_sequence(segments, size, rank, layout, dim=1)
    out = ring_attention(ql, kl, vl, group=None, causal=causal, layout=layout, segment_ids=local_segments)
    out.backward(shard(dout))
    return {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}, shard


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    size, rank = dist.get_world_size(), dist.get_rank()
    results: dict[str, object] = {}
    for index, (name, (causal, layout, packed, heads, kv_heads, dtype)) in enumerate(CASES.items()):
        g = torch.Generator().manual_seed(index)
        q = torch.randn(BATCH, heads, LENGTH, HEAD_DIM, generator=g, dtype=torch.float64).to(dtype)
        k, v = (torch.randn(BATCH, kv_heads, LENGTH, HEAD_DIM, generator=g, dtype=torch.float64).to(dtype)
                for _ in range(2))
        dout = torch.randn(BATCH, heads, LENGTH, HEAD_DIM, generator=g, dtype=torch.float64).to(dtype)
        segments = segment_ids() if packed else None
        exact = reference(*(t.double() for t in (q, k, v, dout)), causal, segments)
        ring, shard = run_ring(q, k, v, dout, causal, layout, segments, size, rank)
        entry: dict[str, object] = {key: {"delta": max_diff(ring[key], shard(exact[key]))} for key in exact}
        if dtype != torch.float64:
            single = reference(q, k, v, dout, causal, segments)
            for key, stats in entry.items():
                stats["spread"] = max_diff(shard(single[key]), shard(exact[key]))
                stats["magnitude"] = float(shard(exact[key]).abs().max())
                stats["dtype"] = str(dtype).removeprefix("torch.")
        results[name] = entry
        if name == "causal_zigzag_packed":  # the same inputs with the causal rule left out
            wrong, _ = run_ring(q, k, v, dout, False, layout, segments, size, rank)
            results["_control_wrong_causal"] = max(max_diff(wrong[key], shard(exact[key])) for key in exact)
        if name == "causal_contiguous_packed_gqa":  # the same inputs with the segments left out
            wrong, _ = run_ring(q, k, v, dout, causal, layout, None, size, rank)
            results["_control_no_segments"] = max(max_diff(wrong[key], shard(exact[key])) for key in exact)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    exit_job(0)


if __name__ == "__main__":
    main(sys.argv[1])
