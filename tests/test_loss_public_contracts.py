"""Rules the losses share, each defined once: :data:`twinkle_core.constants.IGNORE_INDEX`, the public helpers of
:mod:`twinkle_core.loss.helpers`, and one chunked log-prob routine that takes a temperature
(:mod:`twinkle_core.loss.logprobs`, used by the core losses and by twinkle-rl's policy losses)."""

from __future__ import annotations

import inspect

import pytest
import torch

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.loss import helpers
from twinkle_core.loss.base import CallableLoss, LossOutput
from twinkle_core.loss.cross_entropy import ChunkedCrossEntropyLoss, CrossEntropyLoss
from twinkle_core.loss.fused_head import linear_cross_entropy
from twinkle_core.loss.logprobs import (
    label_logprobs,
    labelled_rows,
    linear_logits,
    shift_labels,
    tempered_token_logprobs,
    token_logprobs,
)


def batch(seed=0, b=2, t=6, v=11, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=generator, dtype=dtype) * 2
    labels = torch.randint(0, v, (b, t), generator=generator)
    labels[0, :2] = IGNORE_INDEX
    return logits, labels


def test_ignore_index_is_the_one_pytorch_and_transformers_use():
    assert IGNORE_INDEX == torch.nn.CrossEntropyLoss().ignore_index == -100
    for fn in (CrossEntropyLoss, ChunkedCrossEntropyLoss, token_logprobs, tempered_token_logprobs, shift_labels,
               linear_cross_entropy):
        assert inspect.signature(fn).parameters["ignore_index"].default == IGNORE_INDEX, fn


def test_helpers():
    assert helpers.check_reduction("mean") == "mean"
    with pytest.raises(ValueError, match="reduction must be one of"):
        helpers.check_reduction("max")
    with pytest.raises(KeyError, match=r"MyLoss needs inputs\['advantages'\]"):
        helpers.require({}, "advantages", "MyLoss", "inputs")
    per_sequence = torch.tensor([1.0, 2.0])
    assert helpers.align_to_shifted(per_sequence, 2, 3, "x").tolist() == [[1.0] * 3, [2.0] * 3]
    assert helpers.align_to_shifted(torch.arange(8.0).view(2, 4), 2, 3, "x").tolist() == [[1, 2, 3], [5, 6, 7]]
    with pytest.raises(ValueError, match=r"x has shape \(2, 5\)"):
        helpers.align_to_shifted(torch.zeros(2, 5), 2, 3, "x")
    assert helpers.scalar(torch.tensor(2.5, requires_grad=True)) == 2.5


def test_a_loss_names_itself_by_its_class():
    def fn(outputs, inputs):
        return LossOutput(loss=torch.zeros(()), num_tokens=1)

    assert CrossEntropyLoss().where == "CrossEntropyLoss" and CallableLoss(fn).where == "CallableLoss"


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_label_logprobs_at_a_temperature_match_autograd(temperature, chunk_size):
    logits, labels = batch()
    weights = torch.linspace(-1.0, 2.0, labels.numel(), dtype=logits.dtype).view_as(labels)
    mine = logits.clone().requires_grad_(True)
    label_lp, mean_lp = label_logprobs(mine, labels, chunk_size=chunk_size, temperature=temperature)
    ((label_lp * weights).sum() + 0.3 * mean_lp.sum()).backward()
    plain = logits.clone().requires_grad_(True)
    log_p = torch.log_softmax(plain / temperature, dim=-1)
    mask = labels != IGNORE_INDEX
    expected_label = torch.where(mask, log_p.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    expected_mean = torch.where(mask, log_p.mean(-1), 0.0)
    ((expected_label * weights).sum() + 0.3 * expected_mean.sum()).backward()
    torch.testing.assert_close(label_lp, expected_label, rtol=0, atol=1e-12)
    torch.testing.assert_close(mean_lp, expected_mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(mine.grad, plain.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tempered_at_temperature_one_is_the_untempered_routine_bit_for_bit(dtype):
    logits, labels = batch(seed=3, dtype=dtype)
    a, b = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    scored = tempered_token_logprobs(a, labels, chunk_size=3)
    logps, mask = token_logprobs(b, labels, chunk_size=3)
    assert torch.equal(scored.logps, logps) and torch.equal(scored.mask, mask)
    scored.logps.sum().backward()
    logps.sum().backward()
    assert torch.equal(a.grad, b.grad)
    assert not scored.entropy.requires_grad and (scored.entropy[~mask] == 0).all()


def test_token_logprobs_takes_the_temperature_too():
    logits, labels = batch(seed=5)
    tempered = tempered_token_logprobs(logits, labels, temperature=0.7)
    logps, mask = token_logprobs(logits, labels, temperature=0.7)
    assert torch.equal(tempered.logps, logps) and torch.equal(tempered.mask, mask)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("inf")])
def test_bad_temperatures_are_refused(temperature):
    logits, labels = batch()
    with pytest.raises(ValueError, match="temperature must be positive and finite"):
        label_logprobs(logits, labels, temperature=temperature)


def test_the_chunk_building_blocks_are_public():
    labels = torch.tensor([IGNORE_INDEX, 3, IGNORE_INDEX, 0])
    assert labelled_rows(labels, IGNORE_INDEX).tolist() == [1, 3]
    hidden, weight, bias = torch.randn(2, 4, dtype=torch.bfloat16), torch.randn(5, 4), torch.randn(5)
    logits = linear_logits(hidden, weight, bias)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ weight.t() + bias)
