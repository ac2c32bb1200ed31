"""``LossOutput(num_tokens=0)``: gradients are not normalised, so the gradients of several ``forward_backward``
calls are summed up to the optimizer step (what a service offering Tinker's sum losses relies on)."""

from __future__ import annotations

import math

import torch

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.loss.base import LossOutput
from twinkle_core.testing.conformance import make_batch
from twinkle_core.testing.reference import ReferenceModel

LR = 0.1


def token_nll_sum(outputs, inputs, *, count_tokens=False):
    """The summed negative log-likelihood of the labelled tokens (no shift: labels align with positions)."""
    labels = inputs["labels"]
    mask = labels != IGNORE_INDEX
    logp = torch.log_softmax(outputs["logits"].float(), dim=-1)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    loss = -(picked * mask).sum()
    return LossOutput(loss=loss, num_tokens=int(mask.sum()) if count_tokens else 0)


def make(count_tokens=False):
    model = ReferenceModel(seed=0)
    model.set_loss(lambda outputs, inputs: token_nll_sum(outputs, inputs, count_tokens=count_tokens))
    model.set_optimizer("SGD", lr=LR)
    return model


def manual_gradients(model, batches):
    """d(sum of every batch's summed loss)/d(weights), by autograd on the model's own forward."""
    params = model.trainable_parameters()
    total = sum(token_nll_sum(model.forward(inputs=b), b).loss for b in batches)
    return [g.clone() for g in torch.autograd.grad(total, params)]


def test_two_calls_with_num_tokens_zero_then_a_step_equal_one_step_on_the_summed_gradient():
    batches = [make_batch(1, rows=3), make_batch(2, rows=5)]
    model = make()
    before = [p.detach().clone() for p in model.trainable_parameters()]
    expected = manual_gradients(model, batches)
    model.zero_grad()
    for b in batches:
        model.forward_backward(inputs=b)
    norm = model.clip_grad_norm(math.inf)  # normalises the window (a factor of exactly 1 here), measures only
    for p, g in zip(model.trainable_parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    assert math.isclose(norm, float(torch.linalg.vector_norm(torch.stack([g.norm() for g in expected]))),
                        rel_tol=1e-5)
    model.step()
    for p, w, g in zip(model.trainable_parameters(), before, expected):
        torch.testing.assert_close(p.detach(), w - LR * g, rtol=1e-5, atol=1e-6)


def test_two_calls_equal_one_call_on_both_batches():
    first, second = make_batch(3, rows=2), make_batch(4, rows=4)
    both = {k: torch.cat([first[k], second[k]]) for k in first}
    split, joined = make(), make()
    split.forward_backward(inputs=first)
    split.forward_backward(inputs=second)
    joined.forward_backward(inputs=both)
    for model in (split, joined):
        model.clip_grad_norm(math.inf)
        model.step()
    for a, b in zip(split.trainable_parameters(), joined.trainable_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_token_count_instead_divides_the_window_by_it():
    batches = [make_batch(5, rows=3), make_batch(6, rows=3)]
    model = make(count_tokens=True)
    expected = manual_gradients(model, batches)
    tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    model.zero_grad()
    for b in batches:
        model.forward_backward(inputs=b)
    model.clip_grad_norm(math.inf)
    for p, g in zip(model.trainable_parameters(), expected):
        torch.testing.assert_close(p.grad, g / tokens, rtol=1e-5, atol=1e-7)
