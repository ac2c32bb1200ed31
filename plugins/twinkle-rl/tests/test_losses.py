"""The preference losses against plain reference implementations of the papers' formulas.

The references loop over pairs and tokens in Python with the log-softmax written out; they use none of the
implementation's helpers (no ``token_logprobs``, no ``twinkle_rl.layout``). Logits are float64 so values and
gradients agree to ~1e-10.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from twinkle_rl.layout import PREFERENCE_PAIRS, PairLayoutError
from twinkle_rl.losses import DPOLoss, ORPOLoss, SimPOLoss

from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import LossContext
from twinkle_core.loss.logprobs import shift_labels

IGNORE = -100
DT = torch.float64


# --------------------------------------------------------------------------- batches


def preference_batch(num_pairs=3, t=7, v=6, seed=0):
    """Padded layout: ``2P`` rows, pair by pair (chosen, then rejected); prompts and padding differ per row.

    Returns the logits leaf, the inputs and each sequence's number of real (non-padding) tokens."""
    g = torch.Generator().manual_seed(seed)
    s_ = 2 * num_pairs
    logits = (torch.randn(s_, t, v, generator=g, dtype=DT) * 2).requires_grad_(True)
    labels = torch.randint(0, v, (s_, t), generator=g)
    lengths = []
    for s in range(s_):
        length = t - (s % 3)  # right padding
        labels[s, : 1 + s % 3] = IGNORE  # the prompt; its first token is never a label
        labels[s, length:] = IGNORE
        lengths.append(length)
    inputs = {
        "labels": labels,
        "pair_index": torch.arange(s_) // 2,
        "is_chosen": torch.arange(s_) % 2 == 0,
        "ref_logps": torch.randn(s_, generator=g, dtype=DT) * 3 - 8,
    }
    return logits, inputs, lengths


def pack(logits, inputs, lengths, rows):
    """The same sequences packed padding-free into ``rows`` (lists of sequence ids), with ``sequence_index``.

    The packed logits index the padded leaf, so gradients of both layouts land on the same tensor."""
    width = max(sum(lengths[s] for s in row) for row in rows)
    idx_s = torch.zeros(len(rows), width, dtype=torch.long)
    idx_t = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE)
    owner = torch.full((len(rows), width), -1)
    for r, row in enumerate(rows):
        pos = 0
        for s in row:
            n = lengths[s]
            idx_s[r, pos : pos + n] = s
            idx_t[r, pos : pos + n] = torch.arange(n)
            labels[r, pos : pos + n] = inputs["labels"][s, :n]
            owner[r, pos : pos + n] = s
            pos += n
    packed = {**inputs, "labels": labels, "sequence_index": owner}
    return logits[idx_s, idx_t], packed


def permute(logits, inputs, order):
    """Rows (sequences) reordered; pair ids and the reference follow their sequences."""
    order = torch.tensor(order)
    return logits[order], {key: value[order] for key, value in inputs.items()}


# --------------------------------------------------------------------------- plain references


def log_softmax_row(z):
    m = z.max()
    return z - m - torch.log(torch.exp(z - m).sum())


def log_sigmoid(x):
    return torch.log(1 / (1 + torch.exp(-x)))


def naive_sequence(logits_row, labels_row):
    """(sum of the answer tokens' log-probs, number of answer tokens): logits[t] scores labels[t + 1]."""
    total, count = logits_row.sum() * 0, 0
    for t in range(logits_row.shape[0] - 1):
        y = int(labels_row[t + 1])
        if y != IGNORE:
            total = total + log_softmax_row(logits_row[t])[y]
            count += 1
    return total, count


def naive_pairs(logits, inputs):
    """Per pair: (chosen sum, chosen length, rejected sum, rejected length, ref chosen, ref rejected)."""
    found = {}
    for s in range(logits.shape[0]):
        pair, chosen = int(inputs["pair_index"][s]), bool(inputs["is_chosen"][s])
        lp, n = naive_sequence(logits[s], inputs["labels"][s])
        ref = float(inputs["ref_logps"][s]) if "ref_logps" in inputs else 0.0
        found.setdefault(pair, {})["chosen" if chosen else "rejected"] = (lp, n, ref)
    return [(*p["chosen"][:2], *p["rejected"][:2], p["chosen"][2], p["rejected"][2]) for p in found.values()]


def naive_sft(rows, sft, norm):
    """The SFT term summed over pairs (the losses return sums over pairs): ``"answer"`` adds each chosen answer's
    mean NLL; ``"batch_tokens"`` adds, for each of the P pairs, the NLL mean over all chosen answer tokens."""
    if norm == "answer":
        return sum(sft * (-c / nc) for c, nc, *_ in rows)
    token_mean = sum(-c for c, *_ in rows) / sum(nc for _, nc, *_ in rows)
    return sft * len(rows) * token_mean


def naive_dpo(logits, inputs, beta, loss_type, ls=0.0, sft=0.0, reference_free=False, norm="answer"):
    rows = naive_pairs(logits, inputs)
    total = naive_sft(rows, sft, norm)
    for c, nc, r, nr, rc, rr in rows:
        if reference_free:
            rc = rr = 0.0
        h = (c - rc) - (r - rr)
        if loss_type == "sigmoid":  # DPO eq. 7; cDPO mixes in the flipped label
            loss = -(1 - ls) * log_sigmoid(beta * h) - ls * log_sigmoid(-beta * h)
        elif loss_type == "hinge":
            loss = torch.clamp(1 - beta * h, min=0)
        elif loss_type == "ipo":  # IPO eq. 17 on per-token-averaged log-likelihoods
            h_avg = (c / nc - rc / nc) - (r / nr - rr / nr)
            loss = (h_avg - 1 / (2 * beta)) ** 2
        else:  # robust DPO, Chowdhury et al. 2024, eq. 10
            loss = ((1 - ls) * -log_sigmoid(beta * h) + ls * log_sigmoid(-beta * h)) / (1 - 2 * ls)
        total = total + loss
    return total


def naive_simpo(logits, inputs, beta, gamma, ls=0.0, sft=0.0, norm="answer"):
    rows = naive_pairs(logits, inputs)
    total = naive_sft(rows, sft, norm)
    for c, nc, r, nr, _, _ in rows:
        z = beta / nc * c - beta / nr * r - gamma
        total = total - (1 - ls) * log_sigmoid(z) - ls * log_sigmoid(-z)
    return total


def naive_log_odds(mean_logp):
    """ORPO eq. 4: log(P / (1 - P)) of the per-token average log-likelihood P."""
    return mean_logp - torch.log(1 - torch.exp(mean_logp))


def naive_orpo(logits, inputs, beta, norm="answer"):
    rows = naive_pairs(logits, inputs)
    total = naive_sft(rows, 1.0, norm)
    for c, nc, r, nr, _, _ in rows:
        total = total - beta * log_sigmoid(naive_log_odds(c / nc) - naive_log_odds(r / nr))
    return total


def grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


def close(a, b, tol=1e-10):
    torch.testing.assert_close(torch.as_tensor(a, dtype=DT), torch.as_tensor(b, dtype=DT), rtol=tol, atol=tol)


def check(loss_fn, naive, logits, inputs):
    out = loss_fn({"logits": logits}, inputs)
    expected = naive(logits, inputs)
    assert out.num_tokens == logits.shape[0] // 2
    close(out.loss, expected)
    close(grad(out.loss, logits), grad(expected, logits))
    return out


# --------------------------------------------------------------------------- values and gradients


NORMS = ["answer", "batch_tokens"]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("loss_type,beta,ls,sft", [
    ("sigmoid", 0.1, 0.0, 0.0), ("sigmoid", 0.5, 0.2, 0.0), ("sigmoid", 0.3, 0.1, 0.7),
    ("hinge", 0.5, 0.0, 0.0), ("hinge", 0.05, 0.0, 1.0),
    ("ipo", 0.1, 0.0, 0.0), ("ipo", 0.5, 0.0, 0.3),
    ("robust", 0.3, 0.0, 0.0), ("robust", 0.3, 0.2, 0.0), ("robust", 0.2, 0.45, 0.5),
])
def test_dpo_matches_reference(loss_type, beta, ls, sft, norm):
    logits, inputs, _ = preference_batch(seed=1)
    loss_fn = DPOLoss(beta=beta, loss_type=loss_type, label_smoothing=ls, sft_weight=sft, sft_normalization=norm,
                      chunk_size=4)
    check(loss_fn, lambda lg, inp: naive_dpo(lg, inp, beta, loss_type, ls, sft, norm=norm), logits, inputs)


def test_dpo_robust_without_noise_is_sigmoid_dpo():
    logits, inputs, _ = preference_batch(seed=2)
    robust = DPOLoss(loss_type="robust")({"logits": logits}, inputs)
    plain = DPOLoss(loss_type="sigmoid")({"logits": logits}, inputs)
    close(robust.loss, plain.loss)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_reference_free_uses_a_uniform_reference(loss_type):
    logits, inputs, _ = preference_batch(seed=3)
    naive = lambda lg, inp: naive_dpo(lg, inp, 0.2, loss_type, reference_free=True)  # noqa: E731
    check(DPOLoss(beta=0.2, loss_type=loss_type, reference_free=True), naive, logits, inputs)  # ref_logps ignored
    without = {k: v for k, v in inputs.items() if k != "ref_logps"}
    check(DPOLoss(beta=0.2, loss_type=loss_type, reference_free=True), naive, logits, without)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("beta,gamma,ls,sft", [(2.0, 0.5, 0.0, 0.0), (1.0, 1.5, 0.1, 0.0), (2.5, 0.0, 0.0, 0.4)])
def test_simpo_matches_reference(beta, gamma, ls, sft, norm):
    logits, inputs, _ = preference_batch(seed=4)
    inputs.pop("ref_logps")  # reference-free: the batch needs none
    loss_fn = SimPOLoss(beta=beta, gamma=gamma, label_smoothing=ls, sft_weight=sft, sft_normalization=norm)
    check(loss_fn, lambda lg, inp: naive_simpo(lg, inp, beta, gamma, ls, sft, norm=norm), logits, inputs)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("beta", [0.1, 1.0, 0.0])
def test_orpo_matches_reference(beta, norm):
    logits, inputs, _ = preference_batch(seed=5)
    inputs.pop("ref_logps")
    check(ORPOLoss(beta=beta, sft_normalization=norm), lambda lg, inp: naive_orpo(lg, inp, beta, norm=norm),
          logits, inputs)


def test_the_two_normalisations_differ_and_answer_is_the_default():
    """With answers of different lengths the two averages differ, so the tests above can tell them apart."""
    logits, inputs, _ = preference_batch(seed=5)
    rows = naive_pairs(logits.detach(), inputs)
    assert len({nc for _, nc, *_ in rows}) > 1
    assert abs(float(naive_sft(rows, 1.0, "answer") - naive_sft(rows, 1.0, "batch_tokens"))) > 1e-3
    assert DPOLoss().sft_normalization == SimPOLoss().sft_normalization == ORPOLoss().sft_normalization == "answer"


def test_orpo_stays_finite_when_an_answer_is_certain():
    logits, inputs, _ = preference_batch(num_pairs=1, seed=6)
    with torch.no_grad():  # make every answer token of the chosen sequence certain (log-prob rounds to 0)
        for t in range(logits.shape[1] - 1):
            y = int(inputs["labels"][0, t + 1])
            if y != IGNORE:
                logits[0, t, y] = 1e4
    out = ORPOLoss()({"logits": logits}, inputs)
    assert torch.isfinite(out.loss)
    assert torch.isfinite(grad(out.loss, logits)).all()


# --------------------------------------------------------------------------- layouts


LOSSES = {
    "dpo-sigmoid": lambda: DPOLoss(beta=0.3, label_smoothing=0.1, sft_weight=0.5),
    "dpo-ipo": lambda: DPOLoss(beta=0.3, loss_type="ipo"),
    "dpo-hinge": lambda: DPOLoss(beta=0.3, loss_type="hinge"),
    "dpo-robust": lambda: DPOLoss(beta=0.3, loss_type="robust", label_smoothing=0.2),
    "simpo": lambda: SimPOLoss(sft_weight=0.3),
    "orpo": lambda: ORPOLoss(beta=0.5),
}
# the batch-token mean is a mean over one micro-batch: any layout of that batch, but not any split of it
LAYOUT_LOSSES = {
    **LOSSES,
    "dpo-batch-tokens": lambda: DPOLoss(beta=0.3, sft_weight=0.5, sft_normalization="batch_tokens"),
    "simpo-batch-tokens": lambda: SimPOLoss(sft_weight=0.3, sft_normalization="batch_tokens"),
    "orpo-batch-tokens": lambda: ORPOLoss(beta=0.5, sft_normalization="batch_tokens"),
}


@pytest.mark.parametrize("name", LAYOUT_LOSSES)
def test_packed_layout_equals_padded(name):
    logits, inputs, lengths = preference_batch(num_pairs=3, seed=7)
    padded = LAYOUT_LOSSES[name]()({"logits": logits}, inputs)
    # several sequences per row, pairs split over rows, rows of different fill, sequences out of order
    packed_logits, packed_inputs = pack(logits, inputs, lengths, [[0, 3], [5, 1, 2], [4]])
    packed = LAYOUT_LOSSES[name]()({"logits": packed_logits}, packed_inputs)
    assert packed.num_tokens == padded.num_tokens == 3
    close(packed.loss, padded.loss)
    close(grad(packed.loss, logits), grad(padded.loss, logits))
    assert packed.metrics == pytest.approx(padded.metrics, rel=1e-9)


@pytest.mark.parametrize("name", LAYOUT_LOSSES)
@pytest.mark.parametrize("order", [
    [1, 0, 2, 3, 5, 4],  # rejected before chosen in some pairs
    [4, 0, 3, 5, 1, 2],  # pairs interleaved
])
def test_any_row_order_gives_the_same_loss(name, order):
    logits, inputs, _ = preference_batch(num_pairs=3, seed=8)
    inputs["pair_index"] = torch.tensor([7, 7, 3, 3, 11, 11])  # global pair ids, not 0..P-1
    base = LAYOUT_LOSSES[name]()({"logits": logits}, inputs)
    moved_logits, moved = permute(logits, inputs, order)
    out = LAYOUT_LOSSES[name]()({"logits": moved_logits}, moved)
    close(out.loss, base.loss)
    close(grad(out.loss, logits), grad(base.loss, logits))
    assert out.metrics == pytest.approx(base.metrics, rel=1e-9)


@pytest.mark.parametrize("name", LOSSES)
def test_gradient_accumulation_over_whole_pairs(name):
    logits, inputs, _ = preference_batch(num_pairs=4, seed=9)
    full = LOSSES[name]()({"logits": logits}, inputs)
    total, pairs = 0.0, 0
    for rows in ([0, 1, 4, 5], [2, 3], [6, 7]):
        part_logits, part = permute(logits, inputs, rows)
        out = LOSSES[name]()({"logits": part_logits}, part)
        total, pairs = total + out.loss, pairs + out.num_tokens
    assert pairs == full.num_tokens
    close(total, full.loss)
    close(grad(total, logits), grad(full.loss, logits))


# --------------------------------------------------------------------------- metrics


def naive_rewards(logits, inputs, beta, per_token):
    """The pair metrics; ``per_token``: rewards and ``logps/*`` from mean per-token log-probs (SimPO, ORPO),
    else rewards from sequence log-ratios and ``logps/*`` from sequence sums (DPO)."""
    rows = [(c.detach(), nc, r.detach(), nr, rc, rr) for c, nc, r, nr, rc, rr in naive_pairs(logits, inputs)]
    if per_token:
        chosen_logps = [float(c) / nc for c, nc, *_ in rows]
        rejected_logps = [float(r) / nr for _, _, r, nr, _, _ in rows]
        chosen = [beta * x for x in chosen_logps]
        rejected = [beta * x for x in rejected_logps]
    else:
        chosen_logps = [float(c) for c, *_ in rows]
        rejected_logps = [float(r) for _, _, r, *_ in rows]
        chosen = [beta * (float(c) - rc) for c, _, _, _, rc, _ in rows]
        rejected = [beta * (float(r) - rr) for _, _, r, _, _, rr in rows]
    n = len(rows)
    return {
        "rewards/chosen": sum(chosen) / n,
        "rewards/rejected": sum(rejected) / n,
        "rewards/margins": sum(c - r for c, r in zip(chosen, rejected)) / n,
        "rewards/accuracies": sum(c > r for c, r in zip(chosen, rejected)) / n,
        "logps/chosen": sum(chosen_logps) / n,
        "logps/rejected": sum(rejected_logps) / n,
    }


def naive_nll_metrics(logits, inputs):
    """``nll/chosen``: the mean over pairs of each chosen answer's mean NLL; ``nll/chosen_batch_tokens``: the mean
    NLL over every chosen answer token, one token at a time."""
    answer_means, token_nlls = [], []
    for s in range(logits.shape[0]):
        if not bool(inputs["is_chosen"][s]):
            continue
        nlls = [-float(log_softmax_row(logits[s, t].detach())[int(inputs["labels"][s, t + 1])])
                for t in range(logits.shape[1] - 1) if int(inputs["labels"][s, t + 1]) != IGNORE]
        answer_means.append(sum(nlls) / len(nlls))
        token_nlls.extend(nlls)
    return {"nll/chosen": sum(answer_means) / len(answer_means),
            "nll/chosen_batch_tokens": sum(token_nlls) / len(token_nlls)}


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust"])
def test_dpo_metrics_are_sequence_log_ratios(loss_type, norm):
    logits, inputs, _ = preference_batch(num_pairs=4, seed=10)
    loss_fn = DPOLoss(beta=0.2, loss_type=loss_type, sft_weight=0.5, sft_normalization=norm)
    out = loss_fn({"logits": logits}, inputs)
    expected = {**naive_rewards(logits, inputs, 0.2, per_token=False), **naive_nll_metrics(logits, inputs)}
    assert out.metrics == pytest.approx(expected, rel=1e-9)
    assert all(isinstance(v, float) for v in out.metrics.values())


def test_dpo_accuracy_counts_pairs_ranked_right():
    logits, inputs, _ = preference_batch(num_pairs=2, seed=11)
    sums = torch.stack([naive_sequence(logits[s], inputs["labels"][s])[0].detach() for s in range(4)])
    ref = sums.clone()
    ref[0] += 1.0  # pair 0: chosen reward -0.1, rejected 0 -> ranked wrong
    ref[3] += 2.0  # pair 1: chosen 0, rejected -0.2 -> ranked right
    out = DPOLoss(beta=0.1)({"logits": logits}, {**inputs, "ref_logps": ref})
    assert out.metrics["rewards/accuracies"] == pytest.approx(0.5)
    assert out.metrics["rewards/chosen"] == pytest.approx(-0.05)
    assert out.metrics["rewards/rejected"] == pytest.approx(-0.1)
    assert out.metrics["rewards/margins"] == pytest.approx(0.05)
    assert "nll/chosen" not in out.metrics and "nll/chosen_batch_tokens" not in out.metrics


@pytest.mark.parametrize("norm", NORMS)
def test_simpo_metrics_use_mean_token_logps(norm):
    logits, inputs, _ = preference_batch(num_pairs=3, seed=12)
    inputs.pop("ref_logps")
    simpo = SimPOLoss(beta=2.0, sft_normalization=norm)({"logits": logits}, inputs)
    assert simpo.metrics == pytest.approx(naive_rewards(logits, inputs, 2.0, per_token=True), rel=1e-9)
    with_sft = SimPOLoss(beta=2.0, sft_weight=0.5, sft_normalization=norm)({"logits": logits}, inputs)
    expected = {**naive_rewards(logits, inputs, 2.0, per_token=True), **naive_nll_metrics(logits, inputs)}
    assert with_sft.metrics == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("norm", NORMS)
def test_orpo_metrics_are_trls_log_odds_metrics(norm):
    logits, inputs, _ = preference_batch(num_pairs=3, seed=12)
    inputs.pop("ref_logps")
    orpo = ORPOLoss(beta=0.1, sft_normalization=norm)({"logits": logits}, inputs)
    rows = [(c.detach(), nc, r.detach(), nr) for c, nc, r, nr, _, _ in naive_pairs(logits, inputs)]
    odds = [naive_log_odds(c / nc) - naive_log_odds(r / nr) for c, nc, r, nr in rows]
    expected = {**naive_rewards(logits, inputs, 0.1, per_token=True), **naive_nll_metrics(logits, inputs),
                "log_odds_ratio": sum(float(log_sigmoid(x)) for x in odds) / 3,  # TRL: mean log sigmoid(log odds)
                "log_odds_chosen": sum(float(x) for x in odds) / 3}  # TRL: mean log odds ratio
    assert orpo.metrics == pytest.approx(expected, rel=1e-9)


# --------------------------------------------------------------------------- TRL's code, transcribed
# Transcriptions (float64, padded batch, chosen rows even) of what TRL computes per micro-batch, read in
# huggingface/trl at f2cd577 (1.10.0.dev0): trl/trainer/dpo_trainer.py ``_compute_loss`` with
# ``loss_type=["sigmoid", "sft"]`` and ``loss_weights=[1, alpha]`` (``rpo_alpha`` up to v0.28 adds the same
# cross entropy), trl/experimental/cpo/cpo_trainer.py with ``loss_type="simpo"`` and ``cpo_alpha``, and
# trl/experimental/orpo/orpo_trainer.py (its encoder-decoder NLL, over the answer labels: for decoder-only
# models TRL's ORPO NLL also counts the prompt tokens, which the pair losses never score).


def trl_logps(logits, labels, average):
    """TRL's ``get_batch_logps``: shifted log-probs of the label tokens, summed or averaged per row."""
    shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
    mask = shift_labels != IGNORE
    per_token = torch.gather(shift_logits.log_softmax(-1), 2, shift_labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    sums = (per_token * mask).sum(-1)
    return sums / mask.sum(-1) if average else sums


def trl_chosen_nll(logits, labels):
    """TRL's SFT term: one cross entropy (token mean) over every chosen answer token of the batch."""
    v = logits.shape[-1]
    return F.cross_entropy(logits[0::2, :-1].reshape(-1, v), labels[0::2, 1:].reshape(-1), ignore_index=IGNORE)


def trl_dpo(logits, inputs, beta, alpha):
    logps, ref = trl_logps(logits, inputs["labels"], average=False), inputs["ref_logps"]
    chosen_ratio, rejected_ratio = logps[0::2] - ref[0::2], logps[1::2] - ref[1::2]
    nll = trl_chosen_nll(logits, inputs["labels"])
    loss = (-F.logsigmoid(beta * (chosen_ratio - rejected_ratio))).mean() + alpha * nll
    return loss, trl_pair_metrics(beta * chosen_ratio, beta * rejected_ratio, logps, nll)


def trl_simpo(logits, inputs, beta, gamma, alpha):
    logps = trl_logps(logits, inputs["labels"], average=True)
    z = (logps[0::2] - logps[1::2]) - gamma / beta
    nll = trl_chosen_nll(logits, inputs["labels"])
    loss = (-F.logsigmoid(beta * z)).mean() + alpha * nll
    return loss, trl_pair_metrics(beta * logps[0::2], beta * logps[1::2], logps, nll)


def trl_orpo(logits, inputs, beta):
    logps = trl_logps(logits, inputs["labels"], average=True)
    chosen, rejected = logps[0::2], logps[1::2]
    log1mexp = lambda x: torch.log(-torch.expm1(x))  # noqa: E731
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    nll = trl_chosen_nll(logits, inputs["labels"])
    metrics = trl_pair_metrics(beta * chosen, beta * rejected, logps, nll)
    metrics["log_odds_ratio"] = float(ratio.detach().mean())
    metrics["log_odds_chosen"] = float(log_odds.detach().mean())
    return nll - beta * ratio.mean(), metrics


def trl_pair_metrics(chosen_rewards, rejected_rewards, logps, nll):
    """TRL's metric names and values; TRL's ``nll_loss`` is ours ``nll/chosen_batch_tokens``."""
    chosen_rewards, rejected_rewards, logps = chosen_rewards.detach(), rejected_rewards.detach(), logps.detach()
    return {
        "rewards/chosen": float(chosen_rewards.mean()),
        "rewards/rejected": float(rejected_rewards.mean()),
        "rewards/margins": float((chosen_rewards - rejected_rewards).mean()),
        "rewards/accuracies": float((chosen_rewards > rejected_rewards).to(DT).mean()),
        "logps/chosen": float(logps[0::2].mean()),
        "logps/rejected": float(logps[1::2].mean()),
        "nll/chosen_batch_tokens": float(nll.detach()),
    }


TRL = {
    "dpo": (lambda: DPOLoss(beta=0.2, sft_weight=0.7, sft_normalization="batch_tokens"),
            lambda lg, inp: trl_dpo(lg, inp, beta=0.2, alpha=0.7)),
    "simpo": (lambda: SimPOLoss(beta=2.0, gamma=0.6, sft_weight=0.7, sft_normalization="batch_tokens"),
              lambda lg, inp: trl_simpo(lg, inp, beta=2.0, gamma=0.6, alpha=0.7)),
    "orpo": (lambda: ORPOLoss(beta=0.3, sft_normalization="batch_tokens"),
             lambda lg, inp: trl_orpo(lg, inp, beta=0.3)),
}


@pytest.mark.parametrize("name", TRL)
def test_batch_tokens_is_trls_loss_and_metrics(name):
    make, trl = TRL[name]
    logits, inputs, _ = preference_batch(num_pairs=4, seed=20)
    out = make()({"logits": logits}, inputs)
    want, want_metrics = trl(logits, inputs)
    close(out.loss / out.num_tokens, want)  # the model divides the sum by the pair count
    close(grad(out.loss / out.num_tokens, logits), grad(want, logits))
    shared = {key: out.metrics[key] for key in want_metrics}
    assert shared == pytest.approx(want_metrics, rel=1e-9)


@pytest.mark.parametrize("name", TRL)
def test_batch_tokens_accumulates_as_trl_does(name):
    """TRL averages its micro-batch losses equally (loss / gradient_accumulation_steps, then the ranks' mean);
    the model sums micro-batch sums and divides by the step's pair count: the same for micro-batches of equal
    pair counts, and (as in TRL) not the loss of the two micro-batches as one batch."""
    make, trl = TRL[name]
    logits, inputs, _ = preference_batch(num_pairs=4, seed=21)
    halves = lambda: [permute(logits, inputs, rows) for rows in ([0, 1, 2, 3], [4, 5, 6, 7])]  # noqa: E731
    outs = [make()({"logits": lg}, inp) for lg, inp in halves()]
    accumulated = sum(o.loss for o in outs) / sum(o.num_tokens for o in outs)
    trl_accumulated = sum(trl(lg, inp)[0] for lg, inp in halves()) / 2
    close(accumulated, trl_accumulated)
    close(grad(accumulated, logits), grad(trl_accumulated, logits))
    assert abs(float(accumulated.detach() - trl(logits, inputs)[0].detach())) > 1e-4  # the split matters


# --------------------------------------------------------------------------- errors


ALL = [lambda: DPOLoss(), lambda: SimPOLoss(), lambda: ORPOLoss()]


@pytest.mark.parametrize("make", ALL)
def test_a_batch_without_the_layout_names_the_preference_task(make):
    logits, inputs, _ = preference_batch(seed=13)
    plain = {"labels": inputs["labels"], "ref_logps": inputs["ref_logps"]}
    with pytest.raises(PairLayoutError, match="'preference' task"):
        make()({"logits": logits}, plain)


@pytest.mark.parametrize("make", ALL)
def test_a_pair_split_across_batches_is_an_error(make):
    logits, inputs, _ = preference_batch(seed=14)
    part_logits, part = permute(logits, inputs, [0, 1, 2])  # pair 1 lost its rejected answer
    with pytest.raises(PairLayoutError, match="split"):
        make()({"logits": part_logits}, part)


def test_dpo_without_a_reference_names_the_fix():
    logits, inputs, _ = preference_batch(seed=15)
    inputs.pop("ref_logps")
    with pytest.raises(ConfigError) as info:
        DPOLoss()({"logits": logits}, inputs)
    assert "task_options.reference" in str(info.value) and "reference_free: true" in str(info.value)


def test_dpo_refuses_a_reference_of_the_wrong_size():
    logits, inputs, _ = preference_batch(seed=16)
    with pytest.raises(ValueError, match="ref_logps has 3 values"):
        DPOLoss()({"logits": logits}, {**inputs, "ref_logps": inputs["ref_logps"][:3]})


@pytest.mark.parametrize("make", ALL)
def test_a_pair_in_the_sliced_layout_gives_the_whole_row_loss(make):
    """What a sequence-parallel strategy hands the loss on a group of one rank (``shift_labels``, no ``labels``) is
    scored like the rows; the multi-rank case is ``test_sequence_parallel_losses``."""
    logits, inputs, _ = preference_batch(seed=17)
    expected = make()({"logits": logits}, inputs)
    expected_grad = torch.autograd.grad(expected.loss, logits)[0]
    sliced = {k: v for k, v in inputs.items() if k != "labels"}
    sliced["shift_labels"] = shift_labels(inputs["labels"])
    for context in (None, LossContext(sp_size=1)):
        got = make()({"logits": logits}, sliced, context=context)
        assert got.num_tokens == expected.num_tokens
        torch.testing.assert_close(got.loss.detach(), expected.loss.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.autograd.grad(got.loss, logits)[0], expected_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("make", ALL)
def test_an_answer_without_tokens_is_an_error(make):
    logits, inputs, _ = preference_batch(seed=18)
    inputs["labels"][3] = IGNORE
    with pytest.raises(ValueError, match=r"sequence\(s\) \[3\] have no answer tokens"):
        make()({"logits": logits}, inputs)


@pytest.mark.parametrize("make", [
    lambda: DPOLoss(loss_type="kto"),
    lambda: DPOLoss(beta=0),
    lambda: DPOLoss(label_smoothing=0.6),
    lambda: DPOLoss(loss_type="robust", label_smoothing=0.5),
    lambda: DPOLoss(loss_type="ipo", label_smoothing=0.1),
    lambda: DPOLoss(loss_type="hinge", label_smoothing=0.1),
    lambda: DPOLoss(sft_weight=-1),
    lambda: SimPOLoss(beta=-1),
    lambda: SimPOLoss(label_smoothing=0.7),
    lambda: ORPOLoss(beta=-0.1),
    lambda: ORPOLoss(chunk_size=0),
])
def test_bad_options_are_config_errors(make):
    with pytest.raises(ConfigError):
        make()


@pytest.mark.parametrize("cls", [DPOLoss, SimPOLoss, ORPOLoss])
@pytest.mark.parametrize("value", ["tokens", "batch", None, "Answer"])
def test_a_bad_sft_normalization_names_the_valid_ones(cls, value):
    with pytest.raises(ConfigError, match=rf"{cls.name} loss: sft_normalization must be one of answer, "
                                          rf"batch_tokens, got {value!r}"):
        cls(sft_normalization=value)


# --------------------------------------------------------------------------- registration


def test_the_plugin_registers_the_losses(monkeypatch):
    from twinkle_core.plugins import get_plugins, reset_plugins

    monkeypatch.delenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    reset_plugins()
    try:
        plugins = get_plugins()
        for name, cls in (("dpo", DPOLoss), ("simpo", SimPOLoss), ("orpo", ORPOLoss)):
            loaded = plugins.load("loss", name)
            assert loaded is cls and loaded.name == name
            assert PREFERENCE_PAIRS in loaded.requires
    finally:
        reset_plugins()


@pytest.mark.parametrize("name, options, match", [
    ("dpo", {"beta": float("nan")}, r"dpo loss: beta must be a finite number > 0, got nan"),
    ("dpo", {"beta": float("inf")}, r"dpo loss: beta must be a finite number > 0"),
    ("dpo", {"label_smoothing": float("nan"), "loss_type": "hinge"}, r"label_smoothing must be a finite number"),
    ("dpo", {"sft_weight": float("nan")}, r"sft_weight must be a finite number >= 0"),
    ("simpo", {"gamma": float("nan")}, r"simpo loss: gamma must be a finite number"),
    ("simpo", {"beta": float("nan")}, r"simpo loss: beta"),
    ("orpo", {"beta": float("nan")}, r"orpo loss: beta must be a finite number >= 0"),
    ("grpo", {"beta": float("nan")}, r"grpo loss: beta must be a finite number >= 0"),
    ("grpo", {"epsilon": float("nan")}, r"grpo loss: the lower clip range"),
    ("dapo", {"epsilon_high": float("inf")}, r"dapo loss: the upper clip range"),
    ("ppo", {"temperature": float("nan")}, r"ppo loss: temperature must be a finite number > 0"),
    ("gspo", {"beta": float("inf")}, r"gspo loss: beta"),
    ("dr_grpo", {"max_completion_length": 0}, r"max_completion_length must be an integer >= 1"),
    ("ppo_value", {"clip_range_value": float("inf")}, r"clip_range_value \(None: no clipping\) must be a finite"),
])
def test_non_finite_loss_options_are_refused(name, options, match):
    """nan passes no comparison (``nan <= 0`` is false), so every bound is checked with isfinite first."""
    from twinkle_core.model.loss_setup import build_loss

    with pytest.raises(ConfigError, match=match):
        build_loss(name, **options)
