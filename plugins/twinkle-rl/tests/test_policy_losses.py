"""The clipped policy losses (grpo, dapo, dr_grpo, ppo, gspo) against reference formulas written from the papers.

The references loop over ``(b, t)`` in Python with the log-softmax spelled as ``z - log(sum(exp(z)))`` and use
none of the implementation's helpers. Float64 logits give values and gradients that agree to ~1e-10; the
float32 test derives its tolerance from the arithmetic (:mod:`twinkle_core.testing.tolerance`).
(The grpo / dapo / dr_grpo tests moved here from the core's tests/test_losses.py with the losses.)
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from twinkle_rl.losses.policy import DAPOLoss, DrGRPOLoss, GRPOLoss, GSPOLoss, PPOLoss

from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import LossContext
from twinkle_core.loss.logprobs import shift_labels, tempered_token_logprobs
from twinkle_core.testing.loss_reference import (
    DT,
    IGNORE,
    accumulate,
    close,
    grad,
    log_softmax_row,
    make_batch,
    naive_token_logps,
    rows,
    whole,
)
from twinkle_core.testing.tolerance import sum_tolerance, unit_roundoff

# --------------------------------------------------------------------------- plain references


def naive_entropy(logits, labels, temperature=1.0):
    """Mean over label tokens of -sum_v p log p, p = softmax(logits[b, t] / T)."""
    values = []
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1] - 1):
            if int(labels[b, t + 1]) != IGNORE:
                lp = log_softmax_row(logits[b, t].detach() / temperature)
                values.append(float(-(lp.exp() * lp).sum()))
    return sum(values) / len(values)


def rl_batch(seed=4):
    logits, labels = make_batch(b=4, t=7, v=9, seed=seed)
    lps = naive_token_logps(logits, labels)
    # old log-probs pushed away from the current ones so that ratios land inside and outside
    # both clip ranges: exp(+-0.5) ~ 1.65 / 0.61, exp(+-0.25) ~ 1.28 / 0.78, exp(+-0.05).
    shifts = [0.5, -0.5, 0.25, -0.25, 0.05, -0.05, 0.0]
    old = torch.zeros(4, 6, dtype=DT)
    ref = torch.zeros(4, 6, dtype=DT)
    old.fill_(123.0)  # junk on masked positions must not matter
    ref.fill_(-55.0)
    for k, ((b, t), lp) in enumerate(sorted(lps.items())):
        old[b, t] = lp.detach() - shifts[k % len(shifts)]
        ref[b, t] = lp.detach() + 0.3 * math.sin(k)
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=DT)
    return logits, labels, lps, old, ref, advantages


def naive_pg(lps, old, ref, adv, eps_low, eps_high, beta, aggregation, length=None, per_token_adv=False):
    per_seq: dict[int, list] = {}
    clipped = 0
    for (b, t), lp in lps.items():
        a = float(adv[b, t + 1]) if per_token_adv else float(adv[b])
        r = torch.exp(lp - old[b, t])
        l_tok = -torch.min(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
        if beta:
            d = ref[b, t] - lp
            l_tok = l_tok + beta * (torch.exp(d) - d - 1)
        per_seq.setdefault(b, []).append(l_tok)
        rv = float(r.detach())
        clipped += (rv > 1 + eps_high and a > 0) or (rv < 1 - eps_low and a < 0)
    if aggregation == "grpo":
        total, n = sum(sum(v) / len(v) for v in per_seq.values()), len(per_seq)
    elif aggregation == "dapo":
        total, n = sum(sum(v) for v in per_seq.values()), sum(len(v) for v in per_seq.values())
    else:
        total, n = sum(sum(v) for v in per_seq.values()) / length, len(per_seq)
    return total, n, clipped / len(lps)


def naive_gspo(lps, old, ref, adv, eps_low, eps_high, beta):
    """Zheng et al. 2025: s_i = exp(mean_t (logp - old)), l_i = -min(s A, clip(s) A) (+ beta mean_t k3)."""
    rows = sorted({b for b, _ in lps})
    total, clipped = 0.0, 0
    for b in rows:
        keys = [k for k in lps if k[0] == b]
        s = torch.exp(sum(lps[k] - old[k] for k in keys) / len(keys))
        a = float(adv[b])
        seq_loss = -torch.min(s * a, torch.clamp(s, 1 - eps_low, 1 + eps_high) * a)
        if beta:
            gaps = [ref[k] - lps[k] for k in keys]
            seq_loss = seq_loss + beta * sum(torch.exp(d) - d - 1 for d in gaps) / len(keys)
        total = total + seq_loss
        sv = float(s.detach())
        clipped += (sv > 1 + eps_high and a > 0) or (sv < 1 - eps_low and a < 0)
    return total, len(rows), clipped / len(rows)


# --------------------------------------------------------------------------- GRPO family (moved from the core)


CASES = [
    (GRPOLoss, {"epsilon": 0.2}, 0.2, 0.2, "grpo"),
    (GRPOLoss, {"epsilon": 0.2, "beta": 0.04}, 0.2, 0.2, "grpo"),
    (DAPOLoss, {}, 0.2, 0.28, "dapo"),
    (DAPOLoss, {"epsilon_low": 0.1, "epsilon_high": 0.3, "beta": 0.1}, 0.1, 0.3, "dapo"),
    (DrGRPOLoss, {"epsilon": 0.2, "max_completion_length": 16}, 0.2, 0.2, "dr_grpo"),
    (DrGRPOLoss, {"epsilon": 0.2, "max_completion_length": 16, "beta": 0.04}, 0.2, 0.2, "dr_grpo"),
]


@pytest.mark.parametrize("cls,kwargs,lo,hi,agg", CASES)
def test_policy_gradient_losses_with_clipping(cls, kwargs, lo, hi, agg):
    logits, labels, lps, old, ref, adv = rl_batch()
    beta = kwargs.get("beta", 0.0)
    out = cls(**kwargs)({"logits": logits}, {"labels": labels, "advantages": adv, "old_logps": old, "ref_logps": ref})
    expected, n, clip_frac = naive_pg(lps, old, ref, adv, lo, hi, beta, agg, kwargs.get("max_completion_length"))
    assert 0.0 < clip_frac < 1.0  # the batch really exercises clipping
    assert float(out.num_tokens) == n
    close(out.loss, expected)
    close(grad(out.loss, logits), grad(expected, logits))
    assert out.metrics["clip_fraction"] == pytest.approx(clip_frac)
    gaps = [float(ref[b, t] - lp.detach()) for (b, t), lp in lps.items()]
    kl_ref = sum(math.exp(d) - d - 1 for d in gaps) / len(gaps)
    assert out.metrics["kl_mean"] == pytest.approx(kl_ref)
    assert out.metrics["entropy"] == pytest.approx(naive_entropy(logits, labels), rel=1e-12)


def test_clipped_tokens_get_no_gradient():
    """One token, positive advantage: the surrogate is flat above 1 + eps, live below it."""
    logits = torch.zeros(1, 2, 3, dtype=DT, requires_grad=True)
    labels = torch.tensor([[IGNORE, 1]])
    lp = math.log(1 / 3)
    for shift, live in [(0.5, False), (0.1, True)]:
        out = GRPOLoss(epsilon=0.2)(
            {"logits": logits}, {"labels": labels, "advantages": torch.tensor([1.0]), "old_logps": torch.tensor([[lp - shift]])}
        )
        g = grad(out.loss, logits)
        assert bool(g.abs().sum() > 0) == live
        assert out.metrics["clip_fraction"] == (0.0 if live else 1.0)


@pytest.mark.parametrize("layout", ["full", "shifted"])
def test_per_token_advantages(layout):
    logits, labels, lps, old, ref, _ = rl_batch()
    adv_full = torch.randn(4, 7, dtype=DT, generator=torch.Generator().manual_seed(9))
    adv = adv_full if layout == "full" else adv_full[:, 1:]
    out = DAPOLoss()({"logits": logits}, {"labels": labels, "advantages": adv, "old_logps": old})
    expected, n, _ = naive_pg(lps, old, ref, adv_full, 0.2, 0.28, 0.0, "dapo", per_token_adv=True)
    close(out.loss, expected)
    close(grad(out.loss, logits), grad(expected, logits))


def test_grpo_on_policy_without_old_logps():
    logits, labels, lps, _, _, adv = rl_batch()
    out = GRPOLoss()({"logits": logits}, {"labels": labels, "advantages": adv})
    # ratio == 1: value is -mean(A) per sequence; gradient is that of -A * log p averaged per sequence
    per_seq: dict[int, list] = {}
    for (b, _t), lp in lps.items():
        per_seq.setdefault(b, []).append(-float(adv[b]) * lp)
    expected = sum(sum(v) / len(v) for v in per_seq.values())
    close(out.loss, -sum(float(adv[b]) for b in per_seq))
    close(grad(out.loss, logits), grad(expected, logits))
    assert out.metrics["clip_fraction"] == 0.0
    assert out.metrics["ratio_mean"] == pytest.approx(1.0)
    assert "kl_mean" not in out.metrics


def test_grpo_beta_needs_reference():
    logits, labels, _, old, _, adv = rl_batch()
    with pytest.raises(KeyError):
        GRPOLoss(beta=0.1)({"logits": logits}, {"labels": labels, "advantages": adv, "old_logps": old})


def test_dr_grpo_default_length_is_batch_length():
    logits, labels, lps, old, ref, adv = rl_batch()
    out = DrGRPOLoss()({"logits": logits}, {"labels": labels, "advantages": adv, "old_logps": old})
    expected, _, _ = naive_pg(lps, old, ref, adv, 0.2, 0.2, 0.0, "dr_grpo", length=6)
    close(out.loss, expected)


# --------------------------------------------------------------------------- PPO and GSPO


@pytest.mark.parametrize("kwargs,lo,hi", [({}, 0.2, 0.2), ({"epsilon": 0.1, "epsilon_high": 0.3, "beta": 0.05}, 0.1, 0.3)])
def test_ppo_per_token_advantages(kwargs, lo, hi):
    logits, labels, lps, old, ref, _ = rl_batch()
    adv_full = torch.randn(4, 7, dtype=DT, generator=torch.Generator().manual_seed(10))
    inputs = {"labels": labels, "advantages": adv_full[:, 1:], "old_logps": old, "ref_logps": ref}
    out = PPOLoss(**kwargs)({"logits": logits}, inputs)
    expected, n, clip_frac = naive_pg(lps, old, ref, adv_full, lo, hi, kwargs.get("beta", 0.0), "dapo", per_token_adv=True)
    assert 0.0 < clip_frac < 1.0
    assert float(out.num_tokens) == n == len(lps)
    close(out.loss, expected)
    close(grad(out.loss, logits), grad(expected, logits))
    assert out.metrics["clip_fraction"] == pytest.approx(clip_frac)


def test_ppo_refuses_one_advantage_per_sequence():
    logits, labels, _, old, _, adv = rl_batch()
    with pytest.raises(ValueError, match="per-token advantages"):
        PPOLoss()({"logits": logits}, {"labels": labels, "advantages": adv, "old_logps": old})


GSPO_CASES = [({}, 3e-4, 4e-4), ({"epsilon_low": 0.05, "epsilon_high": 0.2, "beta": 0.04}, 0.05, 0.2)]


@pytest.mark.parametrize("kwargs,lo,hi", GSPO_CASES)
def test_gspo_sequence_ratio(kwargs, lo, hi):
    logits, labels, lps, old, ref, adv = rl_batch()
    out = GSPOLoss(**kwargs)({"logits": logits}, {"labels": labels, "advantages": adv, "old_logps": old, "ref_logps": ref})
    expected, n, clip_frac = naive_gspo(lps, old, ref, adv, lo, hi, kwargs.get("beta", 0.0))
    assert 0.0 < clip_frac < 1.0  # sequences 2 and 3 have ratios 1.13 and 0.90, sequences 0 and 1 exactly 1
    assert float(out.num_tokens) == n == 4
    close(out.loss, expected)
    close(grad(out.loss, logits), grad(expected, logits))
    assert out.metrics["clip_fraction"] == pytest.approx(clip_frac)
    assert out.metrics["ratio_mean"] == pytest.approx(float(sum(
        math.exp(sum(float(lps[k].detach() - old[k]) for k in lps if k[0] == b) / sum(1 for k in lps if k[0] == b))
        for b in range(4)) / 4))


def test_gspo_refuses_per_token_advantages():
    logits, labels, _, old, _, _ = rl_batch()
    with pytest.raises(ValueError, match="one advantage per sequence"):
        GSPOLoss()({"logits": logits}, {"labels": labels, "advantages": torch.ones(4, 6, dtype=DT), "old_logps": old})


def test_gspo_ignores_rows_without_labels():
    logits, labels, lps, old, ref, adv = rl_batch()
    labels[1] = IGNORE
    out = GSPOLoss()({"logits": logits}, {"labels": labels, "advantages": adv, "old_logps": old})
    expected, n, _ = naive_gspo({k: v for k, v in lps.items() if k[0] != 1}, old, ref, adv, 3e-4, 4e-4, 0.0)
    assert float(out.num_tokens) == n == 3
    close(out.loss, expected)


# --------------------------------------------------------------------------- temperature and entropy


ALL_LOSSES = [
    (GRPOLoss, lambda lps, old, ref, adv: naive_pg(lps, old, ref, adv, 0.2, 0.2, 0.0, "grpo")),
    (DAPOLoss, lambda lps, old, ref, adv: naive_pg(lps, old, ref, adv, 0.2, 0.28, 0.0, "dapo")),
    (DrGRPOLoss, lambda lps, old, ref, adv: naive_pg(lps, old, ref, adv, 0.2, 0.2, 0.0, "dr_grpo", length=6)),
    (PPOLoss, lambda lps, old, ref, adv: naive_pg(lps, old, ref, adv, 0.2, 0.2, 0.0, "dapo", per_token_adv=True)),
    (GSPOLoss, lambda lps, old, ref, adv: naive_gspo(lps, old, ref, adv, 3e-4, 4e-4, 0.0)),
]


def advantages_for(cls, adv):
    return adv.unsqueeze(1).expand(4, 7).contiguous() if cls is PPOLoss else adv


@pytest.mark.parametrize("cls,reference", ALL_LOSSES, ids=lambda x: getattr(x, "name", ""))
def test_temperature_scores_logits_over_t(cls, reference):
    """A rollout sampled at T: log-probs (and entropy) are those of softmax(logits / T), not of the raw logits."""
    logits, labels, _, old, ref, adv = rl_batch()
    temperature = 0.7
    adv_in = advantages_for(cls, adv)
    inputs = {"labels": labels, "advantages": adv_in, "old_logps": old}
    out = cls(temperature=temperature, chunk_size=5)({"logits": logits}, inputs)
    expected, _, _ = reference(naive_token_logps(logits, labels, temperature), old, ref, adv_in)
    close(out.loss, expected)
    close(grad(out.loss, logits), grad(expected, logits))
    assert out.metrics["entropy"] == pytest.approx(naive_entropy(logits, labels, temperature), rel=1e-12)
    plain = cls()({"logits": logits}, inputs)
    assert abs(float(plain.loss.detach()) - float(out.loss.detach())) > 1e-3
    assert out.metrics["entropy"] < plain.metrics["entropy"]  # T < 1 sharpens every distribution


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_tempered_logprobs_chunks_and_entropy(chunk_size):
    logits, labels = make_batch(b=4, t=9, v=13, seed=1)
    scored = tempered_token_logprobs(logits, labels, temperature=1.3, chunk_size=chunk_size)
    lps = naive_token_logps(logits, labels, 1.3)
    assert int(scored.mask.sum()) == len(lps)
    for (b, t), lp in lps.items():
        close(scored.logps[b, t], lp)
        h = log_softmax_row(logits[b, t].detach() / 1.3)
        close(scored.entropy[b, t], -(h.exp() * h).sum())
    assert torch.all(scored.logps[~scored.mask] == 0) and torch.all(scored.entropy[~scored.mask] == 0)
    weights = torch.randn(scored.logps.shape, dtype=DT, generator=torch.Generator().manual_seed(2))
    close(grad((scored.logps * weights).sum(), logits), grad(sum(lp * weights[k] for k, lp in lps.items()), logits))


def test_temperature_keeps_no_scaled_copy_of_the_logits():
    """Autograd saves the logits themselves, never a logits-sized scaled copy (the division is per chunk)."""
    logits, labels, _, old, _, adv = rl_batch()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        GRPOLoss(temperature=0.7)({"logits": logits}, {"labels": labels, "advantages": adv, "old_logps": old})
    big = [x for x in saved if x.numel() >= logits.numel()]
    assert big and all(x.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr() for x in big)


def test_float32_logits_within_derived_tolerance():
    """float32 computation vs the float64 reference of the same logits, for every loss at T = 0.7.

    Error budget: each log-prob carries the rounding of a V-term log-sum-exp (``sum_tolerance(V, 1)``: the
    normalised sum is >= 1, so its relative error is the log's absolute error) plus a few ulps of the largest
    scaled logit, of the log-sum-exp and of ``old_logps`` cast to float32. A loss moves by at most
    ``sum_t |dL/dlogp_t|`` times that (the gradient taken from the float64 reference), plus the rounding of
    its own ``n``-term sum, whose absolute sum is at most ``sum_t |A_t| max(r_t, 1 + eps_high)`` (per-sequence
    means and GSPO's geometric-mean ratios only shrink it)."""
    logits64, labels, _, old, _, adv = rl_batch()
    logits32 = logits64.detach().float().requires_grad_(True)
    exact = logits32.detach().double().requires_grad_(True)  # float32 values, float64 arithmetic
    temperature, u = 0.7, unit_roundoff(torch.float32)
    z_max = float(exact.detach().abs().max()) / temperature
    vocab = exact.shape[-1]
    per_logp = sum_tolerance(vocab, 1.0) + 8 * u * (z_max + math.log(vocab) + 1) + u * float(old.abs().max())
    for cls, reference in ALL_LOSSES:
        adv_in = advantages_for(cls, adv)
        out = cls(temperature=temperature)({"logits": logits32}, {"labels": labels, "advantages": adv_in, "old_logps": old})
        assert out.loss.dtype == torch.float32
        lps = naive_token_logps(exact, labels, temperature)
        expected, _, _ = reference(lps, old, None, adv_in)
        sensitivity = sum(float(g.abs()) for g in torch.autograd.grad(expected, list(lps.values()), allow_unused=True)
                          if g is not None)
        magnitude = sum(abs(float(adv_in[b, t + 1] if adv_in.dim() == 2 else adv_in[b]))
                        * max(math.exp(float(lp.detach() - old[b, t])), 1.28) for (b, t), lp in lps.items())
        tolerance = sensitivity * per_logp + sum_tolerance(len(lps), magnitude)
        error = abs(float(out.loss.detach()) - float(expected.detach()))
        assert error <= tolerance, (cls.name, error, tolerance)


# --------------------------------------------------------------------------- batch handling


POLICY_LOSSES = [
    GRPOLoss(beta=0.05), DAPOLoss(beta=0.05), DrGRPOLoss(max_completion_length=10, beta=0.05),
    GSPOLoss(epsilon_low=0.1, epsilon_high=0.1, beta=0.05), GRPOLoss(temperature=0.6, beta=0.05),
]


@pytest.mark.parametrize("loss_fn", POLICY_LOSSES, ids=lambda f: f"{type(f).__name__}-T{f.temperature}")
def test_gradient_accumulation_is_exact(loss_fn):
    """Micro-batch sums over the global num_tokens equal the whole batch's loss (as the model accumulates)."""
    logits, labels = make_batch(b=8, t=6, v=7, seed=11)
    g = torch.Generator().manual_seed(12)
    inputs = {
        "labels": labels,
        "advantages": torch.randn(8, dtype=DT, generator=g),
        "old_logps": -torch.rand(8, 5, dtype=DT, generator=g) * 3,
        "ref_logps": -torch.rand(8, 5, dtype=DT, generator=g) * 3,
    }
    full = whole(loss_fn, {"logits": logits}, inputs)
    acc = accumulate(loss_fn, [({"logits": logits[i:i + 2]}, rows(inputs, slice(i, i + 2))) for i in range(0, 8, 2)])
    close(acc, full)
    close(grad(acc, logits), grad(full, logits))


def sliced_layout(inputs: dict, length: int) -> dict:
    """What a sequence-parallel strategy hands the loss on a group of one rank: ``shift_labels`` ``[B, T]`` (no
    ``labels``), per-token inputs aligned with them (one padding column), global ``position_ids`` and no mask."""
    sliced = {"shift_labels": shift_labels(inputs["labels"]), "position_ids": torch.arange(length).expand(
        inputs["labels"].shape[0], -1)}
    for key, value in inputs.items():
        if key != "labels":
            sliced[key] = torch.cat([value, value[:, :1]], dim=1) if value.dim() == 2 else value
    return sliced


@pytest.mark.parametrize("loss_fn", [*POLICY_LOSSES, PPOLoss(beta=0.05)], ids=lambda f: f"{type(f).__name__}")
def test_a_sequence_in_the_sliced_layout_gives_the_whole_row_loss(loss_fn):
    """The sliced layout of a whole sequence (sp group of one) is scored like the row (the multi-rank case, where
    the per-sequence sums are all-reduced, is ``test_sequence_parallel_losses``)."""
    logits, labels = make_batch(b=4, t=6, v=7, seed=21)
    g = torch.Generator().manual_seed(22)
    advantages = torch.randn(4, 5, dtype=DT, generator=g) if loss_fn.name == "ppo" else torch.randn(4, dtype=DT,
                                                                                                    generator=g)
    inputs = {"labels": labels, "advantages": advantages, "old_logps": -torch.rand(4, 5, dtype=DT, generator=g) * 3,
              "ref_logps": -torch.rand(4, 5, dtype=DT, generator=g) * 3}
    expected = loss_fn({"logits": logits}, inputs)
    expected_grad = grad(expected.loss, logits)
    for context in (None, LossContext(sp_size=1)):
        got = loss_fn({"logits": logits}, sliced_layout(inputs, 6), context=context)
        close(float(got.num_tokens), float(expected.num_tokens))
        close(got.loss.detach(), expected.loss.detach())
        close(grad(got.loss, logits), expected_grad)


def test_dr_grpo_under_sequence_parallelism_needs_the_completion_length():
    from twinkle_core.loss.sequence_group import SequenceReduction

    logits, labels = make_batch(b=2, t=4, v=5, seed=23)
    tokens = DrGRPOLoss().policy_tokens({"logits": logits}, {"labels": labels, "advantages": torch.ones(2)})
    sliced = dataclasses.replace(tokens, reduction=SequenceReduction(size=2))
    with pytest.raises(ConfigError, match="max_completion_length"):
        DrGRPOLoss().aggregate(tokens.logps, sliced)


@pytest.mark.parametrize("cls", [GRPOLoss, DrGRPOLoss, GSPOLoss, DAPOLoss])
def test_packed_rows_are_refused_where_a_row_must_be_one_completion(cls):
    logits = torch.randn(1, 6, 5)
    packed = {"labels": torch.zeros(1, 6, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]),
              "advantages": torch.ones(1)}
    with pytest.raises(ValueError, match="packed"):
        cls()({"logits": logits}, packed)
    # the sliced layout always has position_ids and no mask: there the restarts at position 0 tell
    sliced = {key: value for key, value in packed.items() if key != "labels"}
    sliced["shift_labels"] = packed["labels"]
    with pytest.raises(ValueError, match="packed"):
        cls()({"logits": logits}, sliced)


@pytest.mark.parametrize("kwargs", [{"temperature": 0.0}, {"temperature": -1.0}, {"beta": -0.1}, {"chunk_size": 0}])
def test_bad_options_are_refused(kwargs):
    for cls in (GRPOLoss, DAPOLoss, DrGRPOLoss, GSPOLoss, PPOLoss):
        with pytest.raises(ValueError):
            cls(**kwargs)
