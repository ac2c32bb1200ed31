"""Tinker's built-in losses against independent float64 loop computations of the documented formulas
(https://tinker-docs.thinkingmachines.ai/tinker/losses/): values, gradients w.r.t. target_logprobs, defaults and
config overrides, padding, and the refusals."""

from __future__ import annotations

import math
import typing

import pytest
import torch
from twinkle_server.errors import BadRequest
from twinkle_server.tinker_losses import SUPPORTED, LossResult, UnsupportedLoss, tinker_loss

pytestmark = pytest.mark.timeout(60)

B, T = 3, 7
LENGTHS = (7, 5, 3)  # rows 1 and 2 are padded
EPS32 = 2.0**-23
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo")
GSPO_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


# ---- reference implementations: plain Python floats (float64), one token at a time -----------------------------
# Each returns (loss, terms, grads): the summed loss, the per-token summands (their |.| sum sets the tolerance)
# and d loss / d lp per position (0.0 on padding).


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


def ref_cross_entropy(lp, x, lengths, cfg):
    terms, grads = [], []
    for b, n in enumerate(lengths):
        grads.append([0.0] * len(lp[b]))
        for t in range(n):
            w = x["weights"][b][t]
            terms.append(-w * lp[b][t])
            grads[b][t] = -w
    return sum(terms), terms, grads


def ref_importance_sampling(lp, x, lengths, cfg):
    terms, grads = [], []
    for b, n in enumerate(lengths):
        grads.append([0.0] * len(lp[b]))
        for t in range(n):
            r = math.exp(lp[b][t] - x["logprobs"][b][t])
            a = x["advantages"][b][t]
            terms.append(-r * a)
            grads[b][t] = -r * a
    return sum(terms), terms, grads


def _ppo_token(r, a, lo, hi):
    """-min(r*A, clip(r)*A) and its derivative w.r.t. lp (dr/dlp = r)."""
    c = _clip(r, lo, hi)
    unclipped, clipped = r * a, c * a
    if unclipped <= clipped or lo < r < hi:  # the unclipped branch (or both agree): gradient r*A
        return -min(unclipped, clipped), -r * a
    return -clipped, 0.0  # the clipped constant wins: no gradient


def ref_ppo(lp, x, lengths, cfg):
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    terms, grads = [], []
    for b, n in enumerate(lengths):
        grads.append([0.0] * len(lp[b]))
        for t in range(n):
            r = math.exp(lp[b][t] - x["logprobs"][b][t])
            term, grad = _ppo_token(r, x["advantages"][b][t], lo, hi)
            terms.append(term)
            grads[b][t] = grad
    return sum(terms), terms, grads


def ref_cispo(lp, x, lengths, cfg):
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    terms, grads = [], []
    for b, n in enumerate(lengths):
        grads.append([0.0] * len(lp[b]))
        for t in range(n):
            c = _clip(math.exp(lp[b][t] - x["logprobs"][b][t]), lo, hi)  # a constant (stop-gradient)
            a = x["advantages"][b][t]
            terms.append(-c * lp[b][t] * a)
            grads[b][t] = -c * a
    return sum(terms), terms, grads


def ref_dro(lp, x, lengths, cfg):
    beta = cfg["beta"]
    terms, grads = [], []
    for b, n in enumerate(lengths):
        grads.append([0.0] * len(lp[b]))
        for t in range(n):
            d = lp[b][t] - x["logprobs"][b][t]
            a = x["advantages"][b][t]
            terms.append(-(lp[b][t] * a - 0.5 * beta * d * d))
            grads[b][t] = -a + beta * d
    return sum(terms), terms, grads


def ref_gspo(lp, x, lengths, cfg):
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    terms, grads = [], []
    for b, n in enumerate(lengths):
        grads.append([0.0] * len(lp[b]))
        marked = [t for t in range(n) if x["sequence_ratio_mask"][b][t] != 0]
        s = math.exp(sum(lp[b][t] - x["logprobs"][b][t] for t in marked) / len(marked))
        for t in range(n):  # every token carries s; d s_t / d lp_t = s (only through its own log-prob)
            term, grad = _ppo_token(s, x["advantages"][b][t], lo, hi)
            terms.append(term)
            grads[b][t] = grad
    return sum(terms), terms, grads


REFERENCES = {
    "cross_entropy": ref_cross_entropy,
    "importance_sampling": ref_importance_sampling,
    "ppo": ref_ppo,
    "cispo": ref_cispo,
    "dro": ref_dro,
    "gspo": ref_gspo,
}
DEFAULTS = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
}


# ---- data -------------------------------------------------------------------------------------------------------


def make_batch(seed: int, log_ratio_scale: float = 0.6, garbage: float = 37.0):
    """target_logprobs (leaf, float32) and loss_fn_inputs for every loss, with finite junk on padding."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(LENGTHS):
        mask[b, :n] = True
    lp = -3.0 * torch.rand(B, T, generator=g) - 0.01
    log_ratio = log_ratio_scale * (2 * torch.rand(B, T, generator=g) - 1)
    inputs = {
        "target_tokens": torch.randint(0, 262, (B, T), generator=g),
        "weights": torch.rand(B, T, generator=g) * (torch.rand(B, T, generator=g) > 0.3),
        "logprobs": (lp - log_ratio).float(),
        "advantages": 2 * torch.rand(B, T, generator=g) - 1,
        "sequence_ratio_mask": (torch.rand(B, T, generator=g) > 0.4).float(),
    }
    inputs["sequence_ratio_mask"][:, 0] = 1.0  # at least one marked valid position per datum
    pad = ~mask
    lp = lp.masked_fill(pad, -garbage)
    for key in ("weights", "logprobs", "advantages", "sequence_ratio_mask"):
        inputs[key] = inputs[key].masked_fill(pad, garbage)
    return lp.float(), inputs, mask


def pick(inputs, loss):
    return {k: v for k, v in inputs.items() if k in tinker_loss(loss, GSPO_CLIP if loss == "gspo" else None)
            .required_inputs}


def as_lists(lp, inputs):
    return lp.tolist(), {k: v.tolist() for k, v in inputs.items()}


def run(loss_name, cfg, lp, inputs, mask) -> tuple[LossResult, torch.Tensor]:
    loss = tinker_loss(loss_name, cfg)
    leaf = lp.clone().requires_grad_(True)
    result = loss(leaf, pick(inputs, loss_name), mask)
    result.loss.backward()
    return result, leaf.grad


def assert_matches_reference(loss_name, cfg, resolved, lp, inputs, mask):
    result, grad = run(loss_name, cfg, lp, inputs, mask)
    lp_l, x_l = as_lists(lp, inputs)
    ref_loss, terms, ref_grads = REFERENCES[loss_name](lp_l, x_l, LENGTHS, resolved)
    n = len(terms)
    scale = sum(abs(v) for v in terms)
    # float32 rounding: a few ulps per term (exp of a rounded difference of numbers up to ~4), sqrt(n) growth
    tol = 16 * EPS32 * math.sqrt(n) * scale + 1e-30
    assert abs(result.loss.item() - ref_loss) <= tol, (loss_name, result.loss.item(), ref_loss, tol)
    assert result.metrics == {"loss:sum": pytest.approx(result.loss.item(), abs=0)}
    for b in range(B):
        for t in range(T):
            want, got = ref_grads[b][t], grad[b, t].item()
            if want == 0.0:
                assert got == 0.0, (loss_name, b, t, got)
            else:
                assert abs(got - want) <= 16 * EPS32 * abs(want), (loss_name, b, t, got, want)
    return result, grad, ref_loss


def thresholds_clear(lp, inputs, mask, lo, hi, margin=1e-3):
    """The float64 ratios at valid positions stay away from lo/hi, so float32 rounding never flips a branch."""
    lp_l, x_l = as_lists(lp, inputs)
    for b, n in enumerate(LENGTHS):
        for t in range(n):
            r = math.exp(lp_l[b][t] - x_l["logprobs"][b][t])
            if abs(r - lo) < margin or abs(r - hi) < margin:
                return False
    return True


# ---- values and gradients against the references --------------------------------------------------------------


@pytest.mark.parametrize("loss_name", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_and_gradient_match_the_documented_formula_with_defaults(loss_name, seed):
    lp, inputs, mask = make_batch(seed)
    cfg = DEFAULTS[loss_name]
    if cfg.get("clip_low_threshold") is not None:
        assert thresholds_clear(lp, inputs, mask, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    result, grad, _ = assert_matches_reference(loss_name, None, cfg, lp, inputs, mask)
    assert tinker_loss(loss_name, None).config == cfg
    assert tinker_loss(loss_name, {}).config == cfg


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_the_documented_formula(seed):
    lp, inputs, mask = make_batch(seed, log_ratio_scale=0.9)
    assert_matches_reference("gspo", GSPO_CLIP, GSPO_CLIP, lp, inputs, mask)


def test_the_data_exercises_every_branch():
    """The formulas differ only where the ratio leaves the clip band: make sure the test data goes there, or the
    PPO / CISPO / GSPO comparisons above could not tell them apart from importance_sampling."""
    lp, inputs, mask = make_batch(0)
    is_res, is_grad = run("importance_sampling", None, lp, inputs, mask)
    ppo_res, ppo_grad = run("ppo", None, lp, inputs, mask)
    cispo_res, cispo_grad = run("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, lp, inputs, mask)
    assert (ppo_grad[mask] == 0).any() and (ppo_grad[mask] != 0).any()  # some tokens clipped, some not
    assert not torch.allclose(ppo_grad, is_grad)
    assert not torch.allclose(cispo_grad, is_grad)
    assert abs(ppo_res.loss.item() - is_res.loss.item()) > 1e-3
    gspo_res, gspo_grad = run("gspo", GSPO_CLIP, lp, inputs, mask)
    assert not torch.allclose(gspo_grad, ppo_grad)


def test_loss_is_a_sum_not_a_mean():
    lp, inputs, mask = make_batch(3)
    doubled_lp = torch.cat([lp, lp])
    doubled = {k: torch.cat([v, v]) for k, v in inputs.items()}
    for name in SUPPORTED:
        cfg = GSPO_CLIP if name == "gspo" else None
        one = tinker_loss(name, cfg)(lp, pick(inputs, name), mask).loss.item()
        two = tinker_loss(name, cfg)(doubled_lp, pick(doubled, name), torch.cat([mask, mask])).loss.item()
        assert two == pytest.approx(2 * one, rel=1e-6), name


# ---- config overrides change the result exactly where the ratio leaves the band ---------------------------------


def explicit_datum(ratios, advantages):
    """One datum with the given importance ratios (exactly representable log-ratio differences)."""
    n = len(ratios)
    lp = torch.full((1, n), -1.0)
    q = lp - torch.log(torch.tensor([ratios], dtype=torch.float64)).float()
    inputs = {
        "target_tokens": torch.zeros(1, n, dtype=torch.long),
        "logprobs": q,
        "advantages": torch.tensor([advantages], dtype=torch.float32),
        "sequence_ratio_mask": torch.ones(1, n),
    }
    return lp, inputs, torch.ones(1, n, dtype=torch.bool)


def ratios_of(lp, inputs):
    return [math.exp(a - b) for a, b in zip(lp[0].tolist(), inputs["logprobs"][0].tolist())]


def test_ppo_clip_thresholds():
    # ratio:  0.5 (A<0)  0.85 (A<0)  1.0 (A>0)  1.15 (A>0)  1.5 (A>0)  1.5 (A<0)
    lp, inputs, mask = explicit_datum([0.5, 0.85, 1.0, 1.15, 1.5, 1.5], [-1.0, -1.0, 1.0, 1.0, 1.0, -1.0])
    r = ratios_of(lp, inputs)

    def expected(lo, hi):
        terms = [_ppo_token(ri, a, lo, hi) for ri, a in zip(r, inputs["advantages"][0].tolist())]
        return sum(t for t, _ in terms), [g for _, g in terms]

    default_res, default_grad = run("ppo", None, lp, inputs, mask)
    tight_res, tight_grad = run("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, lp, inputs, mask)
    for res, grad, (lo, hi) in ((default_res, default_grad, (0.8, 1.2)), (tight_res, tight_grad, (0.9, 1.1))):
        want, want_grad = expected(lo, hi)
        assert res.loss.item() == pytest.approx(want, abs=1e-6 * len(r))
        assert grad[0].tolist() == pytest.approx(want_grad, rel=1e-6)
    # by hand: 0.5 with A<0 is clipped (to 0.8) under both; 1.5 with A>0 is capped (1.2 / 1.1); 1.5 with A<0 is not
    assert default_grad[0].tolist() == pytest.approx([0.0, 0.85, -1.0, -1.15, 0.0, 1.5], rel=1e-6)
    # 0.85 (A<0) and 1.15 (A>0) leave the tighter band: their gradient vanishes only under the override
    assert tight_grad[0].tolist() == pytest.approx([0.0, 0.0, -1.0, 0.0, 0.0, 1.5], rel=1e-6)
    assert default_res.loss.item() == pytest.approx(0.8 + 0.85 - 1.0 - 1.15 - 1.2 + 1.5, abs=1e-6)
    assert tight_res.loss.item() == pytest.approx(0.9 + 0.9 - 1.0 - 1.1 - 1.1 + 1.5, abs=1e-6)


def test_cispo_default_is_one_sided_and_overridable():
    lp, inputs, mask = explicit_datum([0.3, 1.0, 1.5, 6.0], [1.0, 1.0, -1.0, 1.0])
    default_res, default_grad = run("cispo", None, lp, inputs, mask)
    # default clip(r, 0, 4): only 6.0 is capped; the gradient is -clip(r) * A
    assert default_grad[0].tolist() == pytest.approx([-0.3, -1.0, 1.5, -4.0], rel=1e-6)
    # lp = -1 everywhere, so the loss -sum(c * lp * A) is sum(c * A)
    assert default_res.loss.item() == pytest.approx(0.3 + 1.0 - 1.5 + 4.0, rel=1e-6)
    sym_res, sym_grad = run("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, lp, inputs, mask)
    assert sym_grad[0].tolist() == pytest.approx([-0.8, -1.0, 1.2, -1.2], rel=1e-6)
    assert sym_res.loss.item() == pytest.approx(0.8 + 1.0 - 1.2 + 1.2, rel=1e-6)
    only_high = tinker_loss("cispo", {"clip_high_threshold": 2.0}).config
    assert only_high == {"clip_low_threshold": 0.0, "clip_high_threshold": 2.0}


def test_dro_beta():
    lp, inputs, mask = make_batch(4)
    default_res, _, _ = assert_matches_reference("dro", None, {"beta": 0.05}, lp, inputs, mask)
    big_res, _, _ = assert_matches_reference("dro", {"beta": 3}, {"beta": 3.0}, lp, inputs, mask)
    zero_res, zero_grad = run("dro", {"beta": 0.0}, lp, inputs, mask)
    assert zero_grad[mask].tolist() == pytest.approx((-inputs["advantages"][mask]).tolist(), rel=1e-6)
    assert default_res.loss.item() != big_res.loss.item() != zero_res.loss.item()


def test_gspo_clips_the_sequence_ratio_not_the_token_ratios():
    # token ratios 0.5 and 2.0: geometric mean exactly 1.0, inside any band -> every token gets -s*A = -A
    lp, inputs, mask = explicit_datum([0.5, 2.0, 1.0], [1.0, -1.0, 1.0])
    inputs["sequence_ratio_mask"] = torch.tensor([[1.0, 1.0, 0.0]])
    res, grad = run("gspo", GSPO_CLIP, lp, inputs, mask)
    assert grad[0].tolist() == pytest.approx([-1.0, 1.0, -1.0], rel=1e-6)
    assert res.loss.item() == pytest.approx(-1.0, rel=1e-6)
    # mark only the 2.0 token: s = 2.0 for every token; A>0 tokens are capped at 1.2 (no gradient), A<0 is not
    inputs["sequence_ratio_mask"] = torch.tensor([[0.0, 1.0, 0.0]])
    res, grad = run("gspo", GSPO_CLIP, lp, inputs, mask)
    assert grad[0].tolist() == pytest.approx([0.0, 2.0, 0.0], rel=1e-6)
    assert res.loss.item() == pytest.approx(-1.2 + 2.0 - 1.2, rel=1e-6)
    wide, wide_grad = run("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0}, lp, inputs, mask)
    assert wide_grad[0].tolist() == pytest.approx([-2.0, 2.0, -2.0], rel=1e-6)
    assert wide.loss.item() == pytest.approx(-2.0, rel=1e-6)


# ---- padding ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_name", SUPPORTED)
def test_padding_contributes_nothing(loss_name):
    cfg = GSPO_CLIP if loss_name == "gspo" else None
    lp, inputs, mask = make_batch(5, garbage=3.0)
    base, base_grad = run(loss_name, cfg, lp, inputs, mask)
    # wild padding, NaN and inf included, must change nothing at all
    lp2, inputs2 = lp.clone(), {k: v.clone() for k, v in inputs.items()}
    pad = ~mask
    lp2[pad] = float("nan")
    for key in ("weights", "logprobs", "advantages", "sequence_ratio_mask"):
        inputs2[key][pad] = float("inf")
    wild, wild_grad = run(loss_name, cfg, lp2, inputs2, mask)
    assert wild.loss.item() == base.loss.item()
    assert torch.equal(wild_grad, base_grad)
    assert (base_grad[pad] == 0).all()
    for key in ("logprobs", "elementwise_loss"):
        assert (wild.per_token[key][pad] == 0).all()
        assert torch.equal(wild.per_token[key][mask], base.per_token[key][mask])
    # the padded batch gives what each datum alone gives
    per_datum = 0.0
    for b, n in enumerate(LENGTHS):
        one = tinker_loss(loss_name, cfg)(
            lp[b : b + 1, :n], pick({k: v[b : b + 1, :n] for k, v in inputs.items()}, loss_name),
            torch.ones(1, n, dtype=torch.bool),
        )
        per_datum += one.loss.item()
    assert base.loss.item() == pytest.approx(per_datum, rel=1e-6, abs=1e-6)


# ---- outputs ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_name", SUPPORTED)
def test_per_token_outputs_and_metrics(loss_name):
    cfg = GSPO_CLIP if loss_name == "gspo" else None
    lp, inputs, mask = make_batch(6)
    leaf = lp.clone().requires_grad_(True)
    result = tinker_loss(loss_name, cfg)(leaf, pick(inputs, loss_name), mask)
    assert set(result.per_token) == {"logprobs", "elementwise_loss"}
    for value in result.per_token.values():
        assert value.shape == (B, T) and not value.requires_grad
    assert torch.equal(result.per_token["logprobs"][mask], lp[mask])
    assert result.per_token["elementwise_loss"].sum().item() == pytest.approx(result.loss.item(), rel=1e-6)
    assert result.loss.requires_grad and result.loss.dim() == 0
    # the SDK splits every metric name into name:reduction and sums loss:sum across request chunks
    assert list(result.metrics) == ["loss:sum"]
    assert result.metrics["loss:sum"] == result.loss.item()


def test_forward_without_grad():
    lp, inputs, mask = make_batch(7)
    with torch.no_grad():
        result = tinker_loss("ppo", None)(lp, pick(inputs, "ppo"), mask)
    assert not result.loss.requires_grad
    assert result.metrics["loss:sum"] == result.loss.item()


# ---- names, configs and inputs that are refused ------------------------------------------------------------------


def test_supported_and_every_sdk_loss_is_either_supported_or_refused():
    from tinker.types import LossFnType

    sdk = set(typing.get_args(LossFnType))
    assert set(SUPPORTED) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"}
    assert set(SUPPORTED) <= sdk
    for name in sorted(sdk - set(SUPPORTED)):
        with pytest.raises(UnsupportedLoss):
            tinker_loss(name, None)


def test_stable_reinforce_has_no_public_definition():
    with pytest.raises(UnsupportedLoss) as err:
        tinker_loss("stable_reinforce", None)
    assert "has no public definition" in err.value.message
    assert "supported: cross_entropy, importance_sampling, ppo, cispo, dro, gspo" in err.value.message
    assert err.value.status == 400 and err.value.category == "user"


def test_custom_is_refused_pointing_at_the_server_config():
    with pytest.raises(UnsupportedLoss) as err:
        tinker_loss("custom", {"anything": 1.0})
    assert "run it on the client with forward_backward_custom" in err.value.message


@pytest.mark.parametrize("name", ["grpo", "PPO", "", None, 3])
def test_unknown_names(name):
    with pytest.raises(UnsupportedLoss) as err:
        tinker_loss(name, None)
    assert "cross_entropy" in err.value.message and "gspo" in err.value.message


@pytest.mark.parametrize(
    ("loss_name", "config", "needles"),
    [
        ("ppo", {"clip_low": 0.9}, ["clip_low", "clip_high_threshold", "clip_low_threshold"]),
        ("cispo", {"epsilon": 0.2}, ["epsilon", "clip_high_threshold", "clip_low_threshold"]),
        ("dro", {"clip_low_threshold": 0.9}, ["clip_low_threshold", "beta"]),
        ("cross_entropy", {"beta": 0.1}, ["beta", "none"]),
        ("importance_sampling", {"clip_low_threshold": 0.5}, ["clip_low_threshold", "none"]),
        ("gspo", {"beta": 1.0, **GSPO_CLIP}, ["beta", "clip_high_threshold"]),
    ],
)
def test_unknown_config_keys_name_the_known_ones(loss_name, config, needles):
    with pytest.raises(BadRequest) as err:
        tinker_loss(loss_name, config)
    assert not isinstance(err.value, UnsupportedLoss)
    for needle in needles:
        assert needle in err.value.message


@pytest.mark.parametrize(
    ("loss_name", "config"),
    [
        ("ppo", {"clip_low_threshold": float("nan")}),
        ("ppo", {"clip_high_threshold": float("inf")}),
        ("dro", {"beta": float("-inf")}),
        ("ppo", {"clip_low_threshold": "0.9"}),
        ("ppo", {"clip_low_threshold": True}),
        ("ppo", {"clip_low_threshold": 1.3}),  # above the default high threshold 1.2
        ("cispo", {"clip_low_threshold": -0.1}),
        ("dro", {"beta": -0.5}),
        ("gspo", None),
        ("gspo", {"clip_low_threshold": 0.8}),
        ("ppo", [("clip_low_threshold", 0.9)]),
    ],
)
def test_bad_config_values(loss_name, config):
    with pytest.raises(BadRequest):
        tinker_loss(loss_name, config)


def test_gspo_without_thresholds_says_which_keys():
    with pytest.raises(BadRequest) as err:
        tinker_loss("gspo", {"clip_high_threshold": 1.2})
    assert "clip_low_threshold" in err.value.message and "not publish" in err.value.message


def test_integer_config_values_are_numbers():
    assert tinker_loss("ppo", {"clip_low_threshold": 0, "clip_high_threshold": 2}).config == {
        "clip_low_threshold": 0.0,
        "clip_high_threshold": 2.0,
    }


def test_required_inputs():
    assert tinker_loss("cross_entropy", None).required_inputs == ("target_tokens", "weights")
    for name in ("importance_sampling", "ppo", "cispo", "dro"):
        assert tinker_loss(name, None).required_inputs == ("target_tokens", "logprobs", "advantages")
    assert tinker_loss("gspo", GSPO_CLIP).required_inputs == (
        "target_tokens", "logprobs", "advantages", "sequence_ratio_mask")


def test_missing_and_unread_inputs_are_refused():
    lp, inputs, mask = make_batch(8)
    loss = tinker_loss("ppo", None)
    partial = {k: inputs[k] for k in ("target_tokens", "logprobs")}
    with pytest.raises(BadRequest, match="lack advantages"):
        loss(lp, partial, mask)
    # weights would be silently ignored by importance sampling: refused instead
    with pytest.raises(BadRequest, match="weights"):
        tinker_loss("importance_sampling", None)(lp, pick(inputs, "ppo") | {"weights": inputs["weights"]}, mask)
    with pytest.raises(BadRequest, match="mask"):
        tinker_loss("cross_entropy", None).check_inputs(["target_tokens", "weights", "mask"])
    tinker_loss("cross_entropy", None).check_inputs(["target_tokens", "weights"])


def test_non_finite_inputs_at_valid_positions_are_refused():
    lp, inputs, mask = make_batch(9)
    inputs["advantages"][1, 2] = float("nan")
    with pytest.raises(BadRequest, match=r"advantages.*datum 1.*position 2"):
        tinker_loss("ppo", None)(lp, pick(inputs, "ppo"), mask)


def test_per_position_shape_is_required():
    lp, inputs, mask = make_batch(10)
    topk = inputs["weights"].unsqueeze(-1).expand(B, T, 4)
    with pytest.raises(BadRequest, match="one value per model_input position"):
        tinker_loss("cross_entropy", None)(lp, {"target_tokens": inputs["target_tokens"], "weights": topk}, mask)


def test_gspo_needs_a_marked_position_per_datum():
    lp, inputs, mask = make_batch(11)
    inputs["sequence_ratio_mask"][2] = 0.0
    inputs["sequence_ratio_mask"][2, 5] = 1.0  # marked, but on padding (datum 2 has 3 positions)
    with pytest.raises(BadRequest, match=r"marks no position of datum\(s\) \[2\]"):
        tinker_loss("gspo", GSPO_CLIP)(lp, pick(inputs, "gspo"), mask)
