"""PPO's clipped value loss (``ppo_value``) against the formula written out per token.

Reference: ``0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)`` summed over label tokens, with
``V`` read at the positions whose logits predict the labels (``values[:, t]`` for ``labels[:, t + 1]``).
"""

from __future__ import annotations

import pytest
import torch
from twinkle_rl.losses.value import PPOValueLoss

from twinkle_core.loss.base import LossContext

IGNORE = -100
DT = torch.float64
EPS = 0.2


def value_batch(seed=0, b=3, t=7):
    """Critic logits ``[B, T, 1]``; ``old_values`` placed so every branch of the clipped loss occurs."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(b, t, 1, generator=g, dtype=DT).requires_grad_(True)
    labels = torch.randint(0, 5, (b, t), generator=g)
    for i in range(b):
        labels[i, : 2 + i] = IGNORE  # prompts of different lengths
    labels[0, -1] = IGNORE  # right padding
    returns = torch.randn(b, t - 1, generator=g, dtype=DT)
    # V - V_old: inside the trust region (+-0.1), above it (+0.5) and below it (-0.5)
    offsets = torch.tensor([0.1, 0.5, -0.5, -0.1, 0.5, -0.5], dtype=DT).repeat(b)[: b * (t - 1)].view(b, t - 1)
    old_values = head.detach()[:, :-1, 0] - offsets
    old_values[labels[:, 1:] == IGNORE] = 1e6  # junk on masked positions must not matter
    return head, labels, returns, old_values


def naive_value_loss(head, labels, returns, old_values, eps):
    total, n, clipped_larger, values, rets = 0.0, 0, 0, [], []
    for b in range(head.shape[0]):
        for t in range(head.shape[1] - 1):
            if int(labels[b, t + 1]) == IGNORE:
                continue
            v, r = head[b, t, 0], returns[b, t]
            unclipped = (v - r) ** 2
            if eps is None:
                term = unclipped
            else:
                clipped = (torch.clamp(v, old_values[b, t] - eps, old_values[b, t] + eps) - r) ** 2
                term = torch.max(unclipped, clipped)
                clipped_larger += bool(clipped > unclipped)
            total = total + 0.5 * term
            n += 1
            values.append(float(v.detach()))
            rets.append(float(r))
    return total, n, clipped_larger / n, values, rets


def grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


def close(a, b, tol=1e-12):
    torch.testing.assert_close(torch.as_tensor(a, dtype=DT), torch.as_tensor(b, dtype=DT), rtol=tol, atol=tol)


def variance(xs):
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / len(xs)


@pytest.mark.parametrize("layout", ["shifted", "full"])
def test_value_loss_matches_naive_with_both_branches(layout):
    head, labels, returns, old_values = value_batch()
    pad = torch.zeros(returns.shape[0], 1, dtype=DT)
    inputs = {"labels": labels, "returns": returns, "old_values": old_values}
    if layout == "full":  # [B, T] aligned with labels: column t + 1 belongs to label t + 1
        inputs.update(returns=torch.cat([pad, returns], 1), old_values=torch.cat([pad, old_values], 1))
    out = PPOValueLoss(clip_range_value=EPS)({"logits": head}, inputs)
    expected, n, clip_fraction, values, rets = naive_value_loss(head, labels, returns, old_values, EPS)
    assert 0.0 < clip_fraction < 1.0  # both branches occur
    assert float(out.num_tokens) == n
    close(out.loss, expected)
    close(grad(out.loss, head), grad(expected, head))
    assert out.metrics["value_clip_fraction"] == pytest.approx(clip_fraction)
    assert out.metrics["value_mean"] == pytest.approx(sum(values) / n)
    residuals = [r - v for r, v in zip(rets, values, strict=True)]
    assert out.metrics["explained_variance"] == pytest.approx(1 - variance(residuals) / variance(rets))


def test_clipped_branch_stops_the_gradient_outside_the_trust_region():
    """One token, V above V_old + eps: if the clipped error is larger the token gets no gradient, else it does."""
    head = torch.zeros(1, 2, 1, dtype=DT, requires_grad=True)
    labels = torch.tensor([[IGNORE, 1]])
    old = torch.tensor([[-0.5]], dtype=DT)  # clip(V = 0) = -0.3
    for ret, live in [(-1.0, True), (1.0, False)]:  # R = -1: |0 + 1| > |-0.3 + 1|; R = 1: |0 - 1| < |-0.3 - 1|
        out = PPOValueLoss()({"logits": head}, {"labels": labels, "returns": torch.tensor([[ret]], dtype=DT),
                                                "old_values": old})
        assert bool(grad(out.loss, head).abs().sum() > 0) == live
        assert out.metrics["value_clip_fraction"] == (0.0 if live else 1.0)
        close(out.loss, 0.5 * max(ret**2, (-0.3 - ret) ** 2))


def test_values_output_unclipped_and_on_policy_forms():
    head, labels, returns, old_values = value_batch(seed=1)
    plain, n, _, _, _ = naive_value_loss(head, labels, returns, old_values, None)
    no_clip = PPOValueLoss(clip_range_value=None)({"values": head[..., 0]}, {"labels": labels, "returns": returns,
                                                                              "old_values": old_values})
    close(no_clip.loss, plain)
    close(grad(no_clip.loss, head), grad(plain, head))
    assert no_clip.metrics["value_clip_fraction"] == 0.0
    # without old_values the current values stand in: inside their own trust region, so the plain loss
    on_policy = PPOValueLoss()({"logits": head}, {"labels": labels, "returns": returns})
    plain, _, _, _, _ = naive_value_loss(head, labels, returns, old_values, None)
    close(on_policy.loss, plain)
    close(grad(on_policy.loss, head), grad(plain, head))


def test_gradient_accumulation_is_exact():
    head, labels, returns, old_values = value_batch(seed=2, b=4)
    loss_fn = PPOValueLoss()
    inputs = {"labels": labels, "returns": returns, "old_values": old_values}
    whole = loss_fn({"logits": head}, inputs)
    outs = [loss_fn({"logits": head[i:i + 2]}, {k: v[i:i + 2] for k, v in inputs.items()}) for i in (0, 2)]
    acc = sum(o.loss for o in outs) / sum(float(o.num_tokens) for o in outs)
    full = whole.loss / float(whole.num_tokens)
    close(acc, full)
    close(grad(acc, head), grad(full, head))


def test_refusals():
    head, labels, returns, old_values = value_batch()
    inputs = {"labels": labels, "returns": returns, "old_values": old_values}
    with pytest.raises(ValueError, match="one output per token"):
        PPOValueLoss()({"logits": head.expand(-1, -1, 3)}, inputs)
    with pytest.raises(KeyError, match="returns"):
        PPOValueLoss()({"logits": head}, {"labels": labels})
    with pytest.raises(ValueError, match="sequence parallelism"):
        PPOValueLoss()({"logits": head}, inputs, context=LossContext(sp_size=2))
    with pytest.raises(ValueError, match="sequence parallelism"):
        PPOValueLoss()({"logits": head}, {"shift_labels": labels, "returns": returns})
    for bad in (0.0, -0.1):
        with pytest.raises(ValueError):
            PPOValueLoss(clip_range_value=bad)
