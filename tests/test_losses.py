"""Built-in losses against independent reference formulas (values and gradients).

The references below are written out plainly: per-token loops over ``(b, t)`` with the
log-softmax spelled as ``z - log(sum(exp(z)))``. They use none of the implementation's helpers.
"""

from __future__ import annotations

import math

import pytest
import torch

from twinkle_core.loss.cross_entropy import ChunkedCrossEntropyLoss, CrossEntropyLoss
from twinkle_core.loss.gkd import GKDLoss
from twinkle_core.loss.logprobs import token_logprobs
from twinkle_core.loss.mse import MSELoss
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

# --------------------------------------------------------------------------- registry


def test_builtin_registry_paths_resolve():
    from twinkle_core.builtins import twinkle_register_losses

    records = list(twinkle_register_losses())
    assert {r.name for r in records} == {
        "cross_entropy", "chunked_cross_entropy", "gkd", "mse"
    }
    for record in records:
        cls = record.load()
        assert cls.name == record.name
        assert callable(cls())  # every loss is constructible with defaults


# --------------------------------------------------------------------------- log-prob helper


def test_token_logprobs_matches_naive():
    logits, labels = make_batch()
    logps, mask = token_logprobs(logits, labels, chunk_size=4)
    ref = naive_token_logps(logits, labels)
    assert logps.shape == mask.shape == (3, 5)
    assert int(mask.sum()) == len(ref)
    for (b, t), lp in ref.items():
        assert mask[b, t]
        close(logps[b, t], lp)
    assert torch.all(logps[~mask] == 0)
    weights = torch.randn(logps.shape, dtype=DT)
    g_impl = grad((logps * weights).sum(), logits)
    g_ref = grad(sum(lp * weights[b, t] for (b, t), lp in ref.items()), logits)
    close(g_impl, g_ref)


# --------------------------------------------------------------------------- cross entropy


def naive_ce(logits, labels, eps=0.0):
    total, n = 0.0, 0
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1] - 1):
            y = int(labels[b, t + 1])
            if y == IGNORE:
                continue
            lp = log_softmax_row(logits[b, t])
            total = total - (1 - eps) * lp[y] - eps * lp.mean()
            n += 1
    return total, n


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("cls", [CrossEntropyLoss, ChunkedCrossEntropyLoss])
def test_cross_entropy_matches_naive(cls, reduction, eps):
    logits, labels = make_batch()
    out = cls(reduction=reduction, label_smoothing=eps)({"logits": logits}, {"labels": labels})
    ref, n = naive_ce(logits, labels, eps)
    if reduction == "mean":
        ref = ref / n
        assert out.num_tokens == 1
    else:
        assert int(out.num_tokens) == n
    close(out.loss, ref)
    close(grad(out.loss, logits), grad(ref, logits))


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 1024])
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_chunked_ce_equals_ce(chunk_size, eps):
    logits, labels = make_batch(b=4, t=9, v=13, seed=1)  # 36 rows, 25 labelled: 4 and 7 do not divide
    plain = CrossEntropyLoss(label_smoothing=eps)({"logits": logits}, {"labels": labels})
    chunked = ChunkedCrossEntropyLoss(chunk_size=chunk_size, label_smoothing=eps)({"logits": logits}, {"labels": labels})
    assert int(plain.num_tokens) == int(chunked.num_tokens)
    close(chunked.loss, plain.loss)
    close(grad(chunked.loss, logits), grad(plain.loss, logits))


def test_chunked_ce_low_precision_logits():
    logits, labels = make_batch(dtype=torch.bfloat16)
    plain = CrossEntropyLoss()({"logits": logits}, {"labels": labels})
    chunked = ChunkedCrossEntropyLoss(chunk_size=5)({"logits": logits}, {"labels": labels})
    assert chunked.loss.dtype == torch.float32
    g = grad(chunked.loss, logits)
    assert g.dtype == torch.bfloat16
    torch.testing.assert_close(chunked.loss, plain.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g.float(), grad(plain.loss, logits).float(), rtol=1e-2, atol=1e-2)


def test_chunked_ce_from_hidden_states():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(3, 6, 5, generator=g, dtype=DT, requires_grad=True)
    w = torch.randn(11, 5, generator=g, dtype=DT, requires_grad=True)
    bias = torch.randn(11, generator=g, dtype=DT, requires_grad=True)
    _, labels = make_batch(v=11)
    plain = CrossEntropyLoss(label_smoothing=0.1)({"logits": h @ w.T + bias}, {"labels": labels})
    fused = ChunkedCrossEntropyLoss(chunk_size=4, label_smoothing=0.1)(
        {"hidden_states": (h * 0, h), "lm_head_weight": w, "lm_head_bias": bias}, {"labels": labels}
    )
    close(fused.loss, plain.loss)
    for a, b in zip(torch.autograd.grad(fused.loss, (h, w, bias)), torch.autograd.grad(plain.loss, (h, w, bias)), strict=True):
        close(a, b)


@pytest.mark.parametrize("cls", [CrossEntropyLoss, ChunkedCrossEntropyLoss])
def test_cross_entropy_all_ignored(cls):
    logits, labels = make_batch()
    labels[:] = IGNORE
    for reduction in ("sum", "mean"):
        out = cls(reduction=reduction)({"logits": logits}, {"labels": labels})
        assert float(out.loss.detach()) == 0.0
        assert float(out.num_tokens) == (0 if reduction == "sum" else 1)
        assert torch.all(grad(out.loss, logits) == 0)


# The GRPO family (grpo, dapo, dr_grpo) moved to the twinkle-rl plugin with its tests
# (plugins/twinkle-rl/tests/test_policy_losses.py).


# --------------------------------------------------------------------------- GKD


def naive_gkd(student, teacher, labels, beta, temperature):
    total, n = 0.0, 0
    for b in range(student.shape[0]):
        for t in range(student.shape[1] - 1):
            if int(labels[b, t + 1]) == IGNORE:
                continue
            ls = log_softmax_row(student[b, t] / temperature)
            lt = log_softmax_row(teacher[b, t] / temperature)
            s, te = torch.exp(ls), torch.exp(lt)
            if beta == 0:
                d = (te * (lt - ls)).sum()  # KL(teacher || student)
            elif beta == 1:
                d = (s * (ls - lt)).sum()  # KL(student || teacher)
            else:
                m = beta * te + (1 - beta) * s
                d = beta * (te * (lt - torch.log(m))).sum() + (1 - beta) * (s * (ls - torch.log(m))).sum()
            total = total + d
            n += 1
    return total, n


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.2])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_gkd_matches_naive(beta, temperature):
    student, labels = make_batch(seed=6)
    teacher = torch.randn(student.shape, dtype=DT, generator=torch.Generator().manual_seed(7)) * 2
    out = GKDLoss(beta=beta, temperature=temperature, chunk_size=4)(
        {"logits": student}, {"labels": labels, "teacher_logits": teacher}
    )
    expected, n = naive_gkd(student, teacher, labels, beta, temperature)
    assert out.num_tokens == n
    close(out.loss, expected)
    close(grad(out.loss, student), grad(expected, student))


def test_gkd_limits():
    student, labels = make_batch(seed=6)
    teacher = torch.randn(student.shape, dtype=DT, generator=torch.Generator().manual_seed(7))
    inputs = {"labels": labels, "teacher_logits": teacher}
    # identical distributions: every divergence is 0
    for beta in (0.0, 0.5, 1.0):
        assert float(GKDLoss(beta=beta)({"logits": teacher.clone()}, inputs).loss.detach()) == pytest.approx(0.0, abs=1e-12)
    # beta = 0.5 is the (symmetric) Jensen-Shannon divergence, bounded by log 2 per token
    js = GKDLoss(beta=0.5)({"logits": student}, inputs)
    swapped = GKDLoss(beta=0.5)({"logits": teacher}, {"labels": labels, "teacher_logits": student.detach()})
    close(js.loss, swapped.loss)
    assert float(js.loss.detach()) / js.num_tokens < math.log(2)
    # forward KL with student/teacher swapped is the reverse KL
    fwd = GKDLoss(beta=0.0)({"logits": teacher}, {"labels": labels, "teacher_logits": student.detach()})
    rev = GKDLoss(beta=1.0)({"logits": student}, inputs)
    close(fwd.loss, rev.loss)
    # the teacher gets no gradient
    t = teacher.clone().requires_grad_(True)
    out = GKDLoss(beta=0.5)({"logits": student}, {"labels": labels, "teacher_logits": t})
    assert not out.loss.requires_grad or torch.autograd.grad(out.loss, t, allow_unused=True)[0] is None


# --------------------------------------------------------------------------- MSE


def test_mse():
    g = torch.Generator().manual_seed(8)
    pred = torch.randn(3, 4, 1, generator=g, dtype=DT, requires_grad=True)
    target = torch.randn(3, 4, generator=g, dtype=DT)
    def naive_sq():
        return sum((pred[i, j, 0] - target[i, j]) ** 2 for i in range(3) for j in range(4))

    naive = naive_sq()
    out = MSELoss()({"logits": pred}, {"targets": target})
    assert out.num_tokens == 12
    close(out.loss, naive)
    close(grad(out.loss, pred), grad(naive, pred))
    mean = MSELoss(reduction="mean", key="values", target_key="returns")({"values": pred}, {"returns": target})
    assert mean.num_tokens == 1
    close(mean.loss, naive_sq() / 12)
    close(grad(mean.loss, pred), grad(naive_sq() / 12, pred))
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    masked = MSELoss(mask_key="mask")({"logits": pred}, {"targets": target, "mask": mask})
    naive_m = sum((pred[i, j, 0] - target[i, j]) ** 2 for i in range(3) for j in range(4) if mask[i, j])
    assert int(masked.num_tokens) == 7
    close(masked.loss, naive_m)
    with pytest.raises(ValueError):
        MSELoss()({"logits": pred}, {"targets": target[:, :3]})


# --------------------------------------------------------------------------- gradient accumulation


@pytest.mark.parametrize(
    "loss_fn",
    [
        CrossEntropyLoss(),
        ChunkedCrossEntropyLoss(chunk_size=3),
        GKDLoss(beta=0.3),
        MSELoss(key="logits", target_key="targets"),
    ],
    ids=lambda f: type(f).__name__,
)
def test_gradient_accumulation_is_exact(loss_fn):
    logits, labels = make_batch(b=8, t=6, v=7, seed=11)
    g = torch.Generator().manual_seed(12)
    inputs = {
        "labels": labels,
        "advantages": torch.randn(8, dtype=DT, generator=g),
        "old_logps": -torch.rand(8, 5, dtype=DT, generator=g) * 3,
        "ref_logps": -torch.rand(8, 5, dtype=DT, generator=g) * 3,
        "teacher_logits": torch.randn(8, 6, 7, dtype=DT, generator=g),
        "targets": torch.randn(8, 6, 7, dtype=DT, generator=g),
    }
    full = whole(loss_fn, {"logits": logits}, inputs)
    micro = [({"logits": logits[i : i + 2]}, rows(inputs, slice(i, i + 2))) for i in range(0, 8, 2)]
    acc = accumulate(loss_fn, micro)
    close(acc, full)
    close(grad(acc, logits), grad(full, logits))


def test_cross_entropy_uses_pre_shifted_labels_when_the_batch_has_them():
    """Sequence parallelism shifts labels before splitting; the loss must then not shift again."""
    from twinkle_core.loss.cross_entropy import ChunkedCrossEntropyLoss, CrossEntropyLoss
    from twinkle_core.loss.logprobs import shift_labels

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 6), generator=g)
    labels[0, :2] = -100
    shifted = shift_labels(labels)
    for loss in (CrossEntropyLoss(), ChunkedCrossEntropyLoss(chunk_size=3)):
        plain = loss({"logits": logits}, {"labels": labels})
        # a shard holding the last 3 positions only: with shift_labels it scores exactly those positions
        shard = loss({"logits": logits[:, 3:]}, {"labels": labels[:, 3:], "shift_labels": shifted[:, 3:]})
        head = loss({"logits": logits[:, :3]}, {"labels": labels[:, :3], "shift_labels": shifted[:, :3]})
        torch.testing.assert_close(shard.loss + head.loss, plain.loss)
        assert int(shard.num_tokens) + int(head.num_tokens) == int(plain.num_tokens)


def test_require_whole_sequences_refuses_a_sequence_parallel_slice():
    # for losses that cannot sum over the sequence group; the per-sequence losses (twinkle-rl's preference and
    # policy losses) sum over it instead: see test_sequence_reduction_* below
    from twinkle_core.loss.base import LossContext, require_whole_sequences

    sliced = {"shift_labels": torch.zeros(2, 4, dtype=torch.long), "advantages": torch.ones(2)}
    with pytest.raises(ValueError, match="sequence parallelism"):
        require_whole_sequences(sliced, "SomeLoss")
    whole = {"labels": torch.zeros(2, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match="sequence parallelism"):
        require_whole_sequences(whole, "SomeLoss", LossContext(sp_size=2))
    require_whole_sequences(whole, "SomeLoss", LossContext())
    require_whole_sequences(whole, "SomeLoss")


def test_sequence_reduction_is_the_identity_on_whole_rows_and_shares_slices():
    """One process: whole rows (even with a sequence group in the context) and a slice with a group of one reduce
    to themselves with share 1; a slice over 4 ranks reports a quarter (the 2-rank all-reduce and its gradient:
    plugins/twinkle-rl/tests/test_sequence_parallel_losses.py)."""
    from twinkle_core.loss.base import LossContext
    from twinkle_core.loss.sequence_group import is_sequence_slice, sequence_reduction

    values = torch.randn(3, 5, requires_grad=True)
    sliced = {"shift_labels": torch.zeros(3, 5, dtype=torch.long)}
    assert is_sequence_slice(sliced) and not is_sequence_slice({**sliced, "labels": sliced["shift_labels"]})
    for inputs, context in (({"labels": sliced["shift_labels"]}, LossContext(sp_size=2)), (sliced, None),
                            (sliced, LossContext(sp_size=1))):
        reduction = sequence_reduction(inputs, context)
        assert not reduction.sliced and reduction.share == 1.0
        sums, counts = reduction.row_sums(values, torch.ones(3, 5))
        assert torch.equal(sums, values.sum(-1)) and torch.equal(counts, torch.full((3,), 5.0))
    assert sequence_reduction(sliced, LossContext(sp_size=4)).share == 0.25


def test_sequence_reduction_tells_packed_slices_by_their_restarts():
    from twinkle_core.loss.sequence_group import SequenceReduction

    reduction = SequenceReduction()
    sliced = {"shift_labels": torch.zeros(2, 6, dtype=torch.long)}
    assert not reduction.rows_are_packed({**sliced, "position_ids": torch.arange(6).expand(2, 6)})
    left_padded = torch.tensor([[-2, -2, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])  # pads isolated at PAD_POSITION
    assert not reduction.rows_are_packed({**sliced, "position_ids": left_padded})
    assert reduction.rows_are_packed({**sliced, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)})
    # whole rows: the padding-free layout (positions and no mask)
    assert reduction.rows_are_packed({"labels": sliced["shift_labels"], "position_ids": left_padded})
    assert not reduction.rows_are_packed({"labels": sliced["shift_labels"], "position_ids": left_padded,
                                          "attention_mask": torch.ones(2, 6)})


def test_a_fractional_count_is_not_rounded_up_in_the_mean():
    from twinkle_core.loss.base import LossOutput

    # one pair shared by 2 sequence-parallel ranks: each reports half its loss and half a pair
    assert float(LossOutput(loss=torch.tensor(1.5), num_tokens=0.5).mean) == 3.0
    assert float(LossOutput(loss=torch.tensor(1.5), num_tokens=0).mean) == 1.5  # 0: not normalised
    assert float(LossOutput(loss=torch.tensor(1.5), num_tokens=3).mean) == 0.5
