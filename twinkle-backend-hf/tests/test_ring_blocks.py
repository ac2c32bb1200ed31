"""Ring attention's block kernels: torch's own fused attention (the default for full and causal blocks) against
the plain matrix products, and the masked blocks that stay plain."""

from __future__ import annotations

import pytest
import torch
from twinkle_backend_hf.sequence_parallel import ring_blocks

# The two compute the same sums in different orders (the fused kernel in tiles, with its own running maximum).
# Each output is a weighted mean of 24 values of size ~1 and each log-sum-exp a sum of 24 terms, so they may
# differ by 24 roundings of the dtype (eps: 2^-52, 2^-23), times 5 for the exponentials' own rounding.
TOLERANCE = {dtype: 24 * torch.finfo(dtype).eps * 5 for dtype in (torch.float64, torch.float32)}


def blocks(dtype: torch.dtype, heads: int = 4, kv_heads: int = 2, rows: int = 24, keys: int = 24):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 2 * rows, 16, generator=generator, dtype=dtype)[:, :, rows // 2:rows // 2 + rows]
    k, v = (torch.randn(2, kv_heads, keys, 16, generator=generator, dtype=dtype) for _ in range(2))
    return q, k, v  # q is a non-contiguous slice of its rows, as a zig-zag half is


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_fused_block_equals_the_plain_products(dtype, causal):
    q, k, v = blocks(dtype)
    mask = torch.ones(24, 24, dtype=torch.bool).tril() if causal else None
    out, lse = ring_blocks.torch_block_attention(q, k, v, scale=0.3, causal=causal)
    plain_out, plain_lse = ring_blocks.plain_block_attention(q, k, v, scale=0.3, mask=mask)
    assert out.shape == plain_out.shape and lse.shape == plain_lse.shape
    torch.testing.assert_close(out, plain_out, rtol=0, atol=TOLERANCE[dtype])
    torch.testing.assert_close(lse.to(dtype), plain_lse, rtol=0, atol=TOLERANCE[dtype])


def test_full_and_causal_blocks_go_to_the_fused_kernel_by_default_and_masked_ones_stay_plain(monkeypatch):
    calls = []

    def spy(q, k, v, *, scale, causal):
        calls.append(causal)
        return ring_blocks.plain_block_attention(q, k, v, scale=scale, mask=None)

    monkeypatch.setattr(ring_blocks, "torch_block_attention", spy)
    q, k, v = blocks(torch.float32)
    for kind in ("full", "causal"):
        ring_blocks.block_forward(q, k, v, scale=0.3, kind=kind, mask=None, kernel=None, dtype=torch.float32)
    assert calls == [False, True]
    # a packed block: the first query row sees no key at all (fused kernels leave that undefined)
    mask = torch.ones(24, 24, dtype=torch.bool)
    mask[0] = False
    out, lse = ring_blocks.block_forward(q, k, v, scale=0.3, kind="masked", mask=mask, kernel=None,
                                         dtype=torch.float32)
    assert calls == [False, True]
    assert torch.isneginf(lse[:, :, 0]).all() and (out[:, :, 0] == 0).all()


def test_devices_without_a_torch_kernel_use_the_plain_products():
    assert ring_blocks.default_block_attention(torch.device("cpu")) is ring_blocks.torch_block_attention
    assert ring_blocks.default_block_attention(torch.device("meta")) is None
