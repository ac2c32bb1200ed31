"""The public step context of a backend whose schedule fuses forward and backward (issue 21)."""

from __future__ import annotations

import pytest
import torch

from twinkle_core.errors import ConfigError
from twinkle_core.model.step_context import StepContext
from twinkle_core.testing.conformance import make_batch
from twinkle_core.testing.reference import make_reference_model


def _lora(model):
    model.add_adapter_to_model("a", {"r": 2, "init_lora_weights": False})
    model.add_adapter_to_model("b", {"r": 2, "init_lora_weights": False})


def test_step_context_resolves_the_adapter_like_every_other_call():
    model = make_reference_model()
    assert model.step_context().state is model.train_state()
    assert model.train_state().name == ""
    _lora(model)
    with pytest.raises(ConfigError, match="several adapters"):
        model.step_context()
    with pytest.raises(ConfigError, match="no adapter named 'c'"):
        model.step_context("c")
    step = model.step_context("b")
    assert isinstance(step, StepContext) and step.state is model.train_state("b") and step.device == model.device


def test_step_context_builds_the_default_loss_only_when_read():
    model = make_reference_model()
    step = model.step_context()
    assert model.get_train_configs()["loss"] is None  # an evaluation step sets no loss
    assert step.loss is model.train_state().loss is not None
    assert model.get_train_configs()["loss"]["name"] == "cross_entropy"


def test_step_context_moves_tensors_and_scopes_the_adapter():
    model = make_reference_model()
    _lora(model)
    batch = make_batch(seed=1)
    inputs = model.step_context("a").to_device({**batch, "note": "kept"})
    assert inputs["note"] == "kept" and inputs["input_ids"].device.type == model.device.type

    def logits(step):
        with torch.no_grad(), step.adapter_scope():
            return model.run_network(model.wrapped, step.to_device(batch))["logits"]

    assert torch.equal(logits(model.step_context("a")), model.forward_only(inputs=batch, adapter_name="a")["logits"])
    base = model.forward_only(inputs=batch, adapter_name="a", disable_adapters=True)["logits"]
    assert torch.equal(logits(model.step_context("a", disable_adapters=True)), base)
    assert not torch.equal(logits(model.step_context("b")), logits(model.step_context("a")))


def test_a_fused_schedule_through_the_step_context_matches_forward_backward():
    """What Megatron's pipeline does with the context gives forward_backward's gradients."""
    batch = make_batch(seed=2)
    reference = make_reference_model(seed=3)
    reference.forward_backward(inputs=batch)
    expected = [p.grad.clone() for p in reference.trainable_parameters()]

    model = make_reference_model(seed=3)
    step = model.step_context()
    assert step.loss is not None  # the task's default (cross-entropy), as forward_backward would set it
    inputs = step.to_device(batch)
    step.state.open_window(float((inputs["labels"] != -100).sum()), model.strategy, step.device)
    with step.adapter_scope(), model.strategy.forward_context(step.device.type):
        outputs = model.run_network(model.wrapped, inputs)
        result = step.state.apply_loss(outputs, inputs, model.loss_context)
    model.strategy.backward(model.strategy.scale_loss(step.state.scale_for_backward(result.loss)), model.wrapped,
                            step.state.handle)
    step.state.record_backward(result.num_tokens)
    for got, want in zip([p.grad for p in model.trainable_parameters()], expected):
        torch.testing.assert_close(got, want)
