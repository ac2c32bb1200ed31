"""Switching tenants of ``MultiLoraTransformersModel`` without walking the model (issue 15 (f)).

The fast switch (``adapters.AdapterSwitch``) must leave exactly the state PEFT's ``set_adapter`` leaves, stay
right across add/remove adapter, the frozen-reference forward, generation and user calls to PEFT, and train
bit for bit like PEFT's own switching.
"""

from __future__ import annotations

import functools
import gc
import weakref

import peft
import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from twinkle_backend_hf.model import TransformersModel
from twinkle_backend_hf.multi_lora import MultiLoraTransformersModel
from twinkle_backend_hf.testing import tiny_qwen2_config

from twinkle_core.testing.conformance import make_batch

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def make(tenants=("a", "b", "c")):
    model = MultiLoraTransformersModel(config=tiny_qwen2_config(), seed=0, max_lora_rank=8)
    for name in tenants:
        add(model, name)
    return model


def add(model, name):
    model.add_adapter_to_model(name, dict(LORA))
    model.set_optimizer("AdamW", lr=1e-2, adapter_name=name)


def with_peft_switching(model):
    """The same model switching tenants the way it did before: PEFT's set_adapter, a walk over all modules."""
    model.activate_adapter = functools.partial(TransformersModel.activate_adapter, model)
    return model


def step(model, name, seed):
    model.forward_backward(inputs=make_batch(seed), adapter_name=name)
    model.clip_grad_and_step(adapter_name=name)


def peft_state(model):
    """What PEFT's switching decides: which weights are trainable and each LoRA layer's active adapters."""
    module = model.module
    layers = [m.active_adapters for m in module.modules() if isinstance(m, BaseTunerLayer)]
    return ({n for n, p in module.named_parameters() if p.requires_grad}, layers,
            module.active_adapter, module.base_model.active_adapter)


class Counter:
    def __init__(self, monkeypatch, owner, name):
        self.calls = 0
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


def test_switching_tenants_walks_no_module_and_leaves_the_state_peft_would(monkeypatch):
    model = make()
    for i, name in enumerate("abc"):  # each tenant's first activation goes through PEFT
        step(model, name, i)
    walks = Counter(monkeypatch, torch.nn.Module, "named_modules")
    train_calls = Counter(monkeypatch, torch.nn.Module, "train")
    peft_switches = Counter(monkeypatch, peft.PeftModel, "set_adapter")
    layer_switches = Counter(monkeypatch, BaseTunerLayer, "set_adapter")
    for i, name in enumerate("abcacb"):
        step(model, name, 10 + i)
        assert model.module.active_adapter == name
    assert (walks.calls, train_calls.calls, peft_switches.calls, layer_switches.calls) == (0, 0, 0, 0)
    monkeypatch.undo()
    fast = peft_state(model)
    model.module.set_adapter("b")  # PEFT's own switch to the tenant that is active
    assert peft_state(model) == fast
    assert fast[0] and all(".b." in n for n in fast[0])


def test_switching_is_bitwise_peft_switching_across_add_remove_reference_and_generation():
    models, states = [], []
    for build in (make, lambda: with_peft_switching(make())):
        model = build()  # seeds torch: the re-added adapter below starts from the same weights in both
        models.append(model)
        states.append(seen := [])
        for i, name in enumerate("abcab"):
            step(model, name, i)
        model.remove_adapter("c")  # not the active tenant
        add(model, "c")  # the same name again: new weights, which the switch must not confuse with the old
        step(model, "c", 19)
        seen.append(peft_state(model))
        add(model, "d")
        for i, name in enumerate("dbacd"):
            step(model, name, 20 + i)
        # the frozen reference (all adapters off) between tenant steps, then the tenant again
        model.forward_only(inputs=make_batch(30), adapter_name="a", disable_adapters=True)
        step(model, "a", 31)
        seen.append(peft_state(model))
        with model.generation_module(adapter_name="c") as gen:
            gen.module(input_ids=make_batch(32)["input_ids"].to(gen.device))
        step(model, "d", 33)
        model.module.set_adapter("b")  # a user switching through PEFT behind the model's back
        model.module.eval()  # and putting the network in eval mode: the next training forward undoes it
        step(model, "c", 34)
        seen.append(peft_state(model))
        assert model.module.training and all(m.training for m in model.module.modules())
        step(model, "b", 35)
        seen.append(peft_state(model))
    assert states[0] == states[1]
    fast, slow = models
    for name in fast.tenants():
        expected = slow.get_state_dict(adapter_name=name)
        got = fast.get_state_dict(adapter_name=name)
        assert expected.keys() == got.keys()
        for key in expected:
            assert torch.equal(expected[key], got[key]), (name, key)


def test_a_tenant_removed_and_added_again_trains_alone_and_its_old_weights_are_freed():
    model = make(("a", "b", "c"))
    for i, name in enumerate("abcab"):
        step(model, name, i)
    before_a = {k: v.clone() for k, v in model.get_state_dict(adapter_name="a").items()}
    removed = [weakref.ref(p) for p in model.trainable_parameters(adapter_name="c")]
    model.remove_adapter("c")
    assert model._switch is None  # its records name the removed weights
    add(model, "c")  # the same tenant set as before: only dropping the switch's records tells them apart
    start = {k: v.clone() for k, v in model.get_state_dict(adapter_name="c").items()}
    step(model, "c", 10)
    lora_layers = [m for m in model.module.modules() if isinstance(m, BaseTunerLayer)]
    assert model._switch.layers == lora_layers and model._switch.trainable.keys() == {"c"}
    assert all(torch.equal(v, model.get_state_dict(adapter_name="a")[k]) for k, v in before_a.items())
    changed = [k for k, v in model.get_state_dict(adapter_name="c").items() if not torch.equal(v, start[k])]
    assert changed, "the new tenant's weights did not train"
    assert {n for n, p in model.module.named_parameters() if p.requires_grad} == \
        set(model.adapter_parameter_names("c"))
    gc.collect()
    assert not any(ref() is not None for ref in removed), "the removed tenant's weights are still held"


def test_merged_layers_fall_back_to_peft_which_unmerges():
    model = make(("a", "b"))
    for i, name in enumerate("ab"):
        step(model, name, i)
    model.module.merge_adapter()  # b's weights folded into the base
    with pytest.warns(UserWarning, match="merged"):
        step(model, "a", 5)
    assert not any(m.merged for m in model.module.modules() if isinstance(m, BaseTunerLayer))
