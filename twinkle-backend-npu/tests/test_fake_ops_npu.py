"""The fake torch_npu fused ops against the textbook formulas, in float64 (rounding ~1e-16, so 1e-12 is a few
hundred ulp of headroom over the handful of operations each formula takes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from twinkle_backend_npu.testing import fake_ops

TIGHT = {"rtol": 1e-12, "atol": 1e-12}


def randn(*shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(sum(shape)))


def test_rms_norm_returns_y_and_a_float32_rstd_reduced_over_gamma():
    x, gamma = randn(2, 3, 16), randn(16)
    y, rstd = fake_ops.npu_rms_norm(x, gamma, epsilon=1e-5)
    expected_rstd = 1 / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(y, x * expected_rstd * gamma, **TIGHT)
    assert rstd.shape == (2, 3, 1) and rstd.dtype == torch.float32
    torch.testing.assert_close(rstd, expected_rstd.float())
    y16, rstd16 = fake_ops.npu_rms_norm(x.bfloat16(), gamma.bfloat16())
    assert y16.dtype == torch.bfloat16 and rstd16.dtype == torch.float32
    with pytest.raises(RuntimeError, match="dtype"):
        fake_ops.npu_rms_norm(x, gamma.float())


def test_rotary_mul_half_and_interleave_rotate_pairs_by_the_angle():
    x, angle = randn(2, 4, 5, 8), randn(1, 1, 5, 4)
    cos, sin = torch.cos(angle), torch.sin(angle)
    half = fake_ops.npu_rotary_mul(x, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    x1, x2 = x[..., :4], x[..., 4:]
    torch.testing.assert_close(half, torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1), **TIGHT)
    # interleave: (x0, x1) pairs are complex numbers multiplied by e^{i angle}
    r1, r2 = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    rotated = fake_ops.npu_rotary_mul(x, r1, r2, rotary_mode="interleave")
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (4, 2)).contiguous()) * torch.polar(
        torch.ones_like(angle), angle)).flatten(-2)
    torch.testing.assert_close(rotated, expected, **TIGHT)
    with pytest.raises(RuntimeError, match="4-D"):
        fake_ops.npu_rotary_mul(x[0], r1[0], r2[0])


def test_swiglu_is_silu_of_the_first_half_times_the_second():
    x = randn(3, 10)
    torch.testing.assert_close(fake_ops.npu_swiglu(x), x[:, :5] * torch.sigmoid(x[:, :5]) * x[:, 5:], **TIGHT)
    torch.testing.assert_close(fake_ops.npu_swiglu(x.T, dim=0), (x[:, :5] * torch.sigmoid(x[:, :5]) * x[:, 5:]).T,
                               **TIGHT)


def reference_attention(q, k, v, scale, masked=None):
    """(B, N, S, D) softmax(q k^T * scale) v, with the key/value heads repeated for grouped queries."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    return torch.softmax(scores, -1) @ v


CAUSAL = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def test_fusion_attention_layouts_scale_and_grouped_heads():
    q, k, v = randn(2, 4, 6, 8), randn(2, 2, 6, 8), randn(2, 2, 6, 8)
    expected = reference_attention(q, k, v, 0.3)
    result = fake_ops.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.3)
    assert len(result) == 7 and result[1].shape == (2, 4, 6, 8)  # softmax_max repeated 8 times
    torch.testing.assert_close(result[0], expected, **TIGHT)
    bsnd = fake_ops.npu_fusion_attention(*(t.transpose(1, 2) for t in (q, k, v)), 4, "BSND", scale=0.3)[0]
    torch.testing.assert_close(bsnd.transpose(1, 2), expected, **TIGHT)
    bsh = fake_ops.npu_fusion_attention(*(t.transpose(1, 2).flatten(-2) for t in (q, k, v)), 4, "BSH", scale=0.3)[0]
    torch.testing.assert_close(bsh, expected.transpose(1, 2).flatten(-2), **TIGHT)
    sbh = fake_ops.npu_fusion_attention(*(t.permute(2, 0, 1, 3).flatten(-2) for t in (q, k, v)), 4, "SBH",
                                        scale=0.3)[0]
    torch.testing.assert_close(sbh, expected.permute(2, 0, 1, 3).flatten(-2), **TIGHT)


def test_fusion_attention_causal_modes_and_explicit_masks():
    q, k, v = randn(1, 2, 3, 4), randn(1, 2, 5, 4), randn(1, 2, 5, 4)
    i, j = torch.arange(3)[:, None], torch.arange(5)[None, :]
    top_left = fake_ops.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=CAUSAL, scale=0.5, sparse_mode=2)[0]
    torch.testing.assert_close(top_left, reference_attention(q, k, v, 0.5, j > i), **TIGHT)
    bottom_right = fake_ops.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=CAUSAL, scale=0.5, sparse_mode=3)[0]
    torch.testing.assert_close(bottom_right, reference_attention(q, k, v, 0.5, j > i + 2), **TIGHT)
    explicit = (i + j) % 3 == 1  # any bool mask: True = masked
    given = fake_ops.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=explicit, scale=0.5)[0]
    torch.testing.assert_close(given, reference_attention(q, k, v, 0.5, explicit), **TIGHT)
    band = fake_ops.npu_fusion_attention(q, k, v, 2, "BNSD", scale=0.5, pre_tockens=1, next_tockens=0)[0]
    torch.testing.assert_close(band, reference_attention(q, k, v, 0.5, (j > i) | (j < i - 1)), **TIGHT)
    with pytest.raises(RuntimeError, match="sparse_mode 2 needs atten_mask"):
        fake_ops.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=j > i, sparse_mode=2)


def test_fusion_attention_tnd_attends_within_each_packed_sequence():
    lengths = (3, 5)
    q, k, v = randn(8, 4, 8), randn(8, 2, 8), randn(8, 2, 8)
    out = fake_ops.npu_fusion_attention(q, k, v, 4, "TND", atten_mask=CAUSAL, scale=0.25, actual_seq_qlen=[3, 8],
                                        actual_seq_kvlen=[3, 8], sparse_mode=3)[0]
    assert out.shape == (8, 4, 8)
    start = 0
    for length in lengths:
        part = slice(start, start + length)
        causal = torch.ones(length, length, dtype=torch.bool).triu(1)
        expected = reference_attention(*(t[part].transpose(0, 1)[None] for t in (q, k, v)), 0.25, causal)
        torch.testing.assert_close(out[part], expected[0].transpose(0, 1), **TIGHT)
        start += length
    with pytest.raises(RuntimeError, match="cumulative"):
        fake_ops.npu_fusion_attention(q, k, v, 4, "TND", atten_mask=CAUSAL, actual_seq_qlen=[3, 5],
                                      actual_seq_kvlen=[3, 5], sparse_mode=3)


def test_fusion_attention_backward_matches_the_formula():
    q, k, v = (randn(1, 2, 4, 4).requires_grad_() for _ in range(3))
    fake_ops.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=CAUSAL, scale=0.5, sparse_mode=2)[0].sum().backward()
    fake_grads = [t.grad for t in (q, k, v)]
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, scale=0.5).sum().backward()
    for fake, expected in zip(fake_grads, (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(fake, expected, **TIGHT)
