"""``linear_cross_entropy``: the LM head applied inside the loss, chunk by chunk, with the gradients computed in
forward. In float64 it must equal ``F.cross_entropy(F.linear(...))`` to rounding, with every option."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from twinkle_core.loss.cross_entropy import CrossEntropyLoss
from twinkle_core.loss.fused_head import chunk_rows, linear_cross_entropy

EPS64 = torch.finfo(torch.float64).eps


def _inputs(bias: bool):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(50, 8, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(50, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    y = torch.randint(0, 50, (37,), generator=g)
    y[::5] = -100
    return h, w, b, y


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_value_and_gradients_equal_the_unfused_head(bias, eps, chunk):
    h, w, b, y = _inputs(bias)
    want = F.cross_entropy(F.linear(h, w, b), y, reduction="sum", label_smoothing=eps)
    got = linear_cross_entropy(h, w, y, b, label_smoothing=eps, chunk_size=chunk)
    params = [t for t in (h, w, b) if t is not None]
    # an upstream gradient other than 1 (a mean loss, loss scaling) must scale every gradient
    want_grads = torch.autograd.grad(want * 0.37, params)
    got_grads = torch.autograd.grad(got * 0.37, params)
    assert abs(got.item() - want.item()) <= 64 * EPS64 * abs(want.item())
    for g_got, g_want in zip(got_grads, want_grads, strict=True):
        assert (g_got - g_want).abs().max().item() <= 64 * EPS64 * g_want.abs().max().item()


def test_without_gradients_only_the_value_is_computed():
    h, w, b, y = _inputs(True)
    with torch.no_grad():
        got = linear_cross_entropy(h, w, y, b)
    assert got.item() == pytest.approx(F.cross_entropy(F.linear(h, w, b), y, reduction="sum").item(), rel=1e-12)


def test_all_labels_ignored_gives_zero_and_zero_gradients():
    h, w, _, y = _inputs(False)
    got = linear_cross_entropy(h, w, torch.full_like(y, -100))
    got.backward()
    assert got.item() == 0.0 and h.grad.abs().max().item() == 0.0 and w.grad.abs().max().item() == 0.0


def test_chunks_hold_a_bounded_slice_of_the_vocabulary():
    assert chunk_rows(151_936) * 151_936 * 4 <= 64 * 2**20 and chunk_rows(64) == 4096 and chunk_rows(10**9) == 16
    # a large batch goes in at most 8 chunks (each chunk is a [V, H] pass of the weight gradient), under 4,096 rows
    assert chunk_rows(151_936, 16_384) == 2048 and chunk_rows(151_936, 2_048) == 256
    assert chunk_rows(151_936, 10**6) == 4096 and chunk_rows(151_936, 100) == chunk_rows(151_936)


def test_the_cross_entropy_loss_reads_hidden_states_when_the_model_hands_them_over():
    h, w, _, y = _inputs(False)
    labels = torch.cat([torch.tensor([-100]), y[:-1]]).view(1, -1)  # next-token labels: position t predicts t + 1
    loss = CrossEntropyLoss(reduction="mean", lm_head="fused")
    fused = loss({"hidden_states": h.view(1, 37, 8), "lm_head_weight": w}, {"labels": labels})
    plain = loss({"logits": F.linear(h, w).view(1, 37, 50)}, {"labels": labels})
    assert fused.num_tokens == plain.num_tokens == 1
    assert fused.loss.item() == pytest.approx(plain.loss.item(), rel=1e-12)
    assert loss.fuses_lm_head(10) and not CrossEntropyLoss(lm_head="logits").fuses_lm_head(10**6)
    assert CrossEntropyLoss().fuses_lm_head(151_936) and not CrossEntropyLoss().fuses_lm_head(32_000)
