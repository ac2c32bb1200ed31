"""Multi-tenant LoRA: per-tenant state, runtime add/remove, bitwise isolation, plain-PEFT export."""

from __future__ import annotations

import math

import pytest
import torch
from twinkle_backend_hf.multi_lora import MultiLoraTransformersModel
from twinkle_backend_hf.testing import tiny_qwen2_config

from twinkle_core.errors import ConfigError
from twinkle_core.testing.conformance import make_batch


def lora(r=4, targets=("q_proj", "v_proj")):
    return {"r": r, "lora_alpha": 2 * r, "target_modules": list(targets)}


def make(**kw):
    return MultiLoraTransformersModel(config=tiny_qwen2_config(), seed=0, max_lora_rank=8, **kw)


def tenant_snapshot(model, name):
    weights = {k: v.clone() for k, v in model.get_state_dict(adapter_name=name).items()}
    opt = model._states[name].optimizer
    opt_state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                 for i, s in enumerate(opt.state.values())} if opt is not None else {}
    return weights, opt_state


def assert_bitwise_equal(a, b):
    (wa, oa), (wb, ob) = a, b
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert oa.keys() == ob.keys()
    for i in oa:
        for k in oa[i]:
            va, vb = oa[i][k], ob[i][k]
            assert torch.equal(va, vb) if torch.is_tensor(va) else va == vb, (i, k)


def train(model, name, seed, steps=2):
    for s in range(steps):
        model.forward_backward(inputs=make_batch(seed + s), adapter_name=name)
        model.clip_grad_and_step(adapter_name=name)


def test_each_tenant_has_its_own_config_optimizer_scheduler_loss_and_counters():
    model = make()
    model.add_adapter_to_model("a", lora(4, ("q_proj", "v_proj")))
    model.add_adapter_to_model("b", lora(8, ("gate_proj", "up_proj", "down_proj")))
    model.set_optimizer("AdamW", lr=1e-2, adapter_name="a")
    model.set_optimizer("SGD", lr=0.1, adapter_name="b", gradient_accumulation_steps=2)
    model.set_lr_scheduler("cosine", num_training_steps=10, adapter_name="a")
    model.set_loss("cross_entropy", adapter_name="b", reduction="sum")
    train(model, "a", 0, steps=3)
    train(model, "b", 10, steps=2)
    a, b = model.get_train_configs(adapter_name="a"), model.get_train_configs(adapter_name="b")
    assert (a["optimizer"]["name"], b["optimizer"]["name"]) == ("AdamW", "SGD")
    assert a["lr_scheduler"]["name"] == "cosine" and b["lr_scheduler"] is None
    assert (a["step"], b["step"]) == (3, 1)  # b accumulates 2 micro-batches per step
    assert b["gradient_accumulation_steps"] == 2
    assert a["adapter_config"].r == 4 and b["adapter_config"].r == 8
    assert a["trainable_parameters"] != b["trainable_parameters"]


def test_training_nan_and_bad_batches_of_one_tenant_never_touch_another():
    model = make()
    for name in ("a", "b"):
        model.add_adapter_to_model(name, lora())
        model.set_optimizer("AdamW", lr=1e-2, adapter_name=name, weight_decay=0.1)
    train(model, "b", 100)  # b has real optimizer state
    before_b = tenant_snapshot(model, "b")
    # ordinary training of a
    train(model, "a", 0, steps=3)
    # a NaN loss for a: the step is skipped, a's weights and b's are untouched
    model.set_loss(lambda outputs, inputs: outputs["logits"].sum() * float("nan"), adapter_name="a")
    before_a = tenant_snapshot(model, "a")
    model.forward_backward(inputs=make_batch(5), adapter_name="a")
    norm = model.clip_grad_and_step(adapter_name="a")
    assert math.isnan(norm)
    assert_bitwise_equal(before_a, tenant_snapshot(model, "a"))
    assert model.get_train_configs(adapter_name="a")["skipped_steps"] == 1
    # a malformed batch for a raises, and leaves everything intact
    with pytest.raises((IndexError, RuntimeError)):
        model.forward_backward(inputs={"input_ids": torch.full((2, 5), 10_000), "labels": torch.zeros(2, 5).long()},
                               adapter_name="a")
    assert_bitwise_equal(before_b, tenant_snapshot(model, "b"))
    # b still trains normally afterwards
    model.set_loss("cross_entropy", adapter_name="a")
    train(model, "b", 200, steps=1)
    assert model.get_train_configs(adapter_name="b")["step"] == 3


def test_tenants_interleave_mid_accumulation():
    model = make()
    for name in ("a", "b"):
        model.add_adapter_to_model(name, lora())
        model.set_optimizer("SGD", lr=0.5, adapter_name=name, gradient_accumulation_steps=2)
    reference = make()
    reference.add_adapter_to_model("a", lora())  # same adapters, so b starts from the same weights
    reference.add_adapter_to_model("b", lora())
    reference.set_optimizer("SGD", lr=0.5, adapter_name="b", gradient_accumulation_steps=2)
    for m in (model, reference):
        m.forward_backward(inputs=make_batch(1), adapter_name="b")
        m.clip_grad_and_step(adapter_name="b")
    train(model, "a", 50, steps=3)  # a trains while b is half-way through its accumulation
    for m in (model, reference):
        m.forward_backward(inputs=make_batch(2), adapter_name="b")
        m.clip_grad_and_step(adapter_name="b")
    for k, v in reference.get_state_dict(adapter_name="b").items():
        assert torch.equal(v, model.get_state_dict(adapter_name="b")[k]), k


def test_tenants_can_be_added_and_removed_at_run_time():
    model = make()
    model.add_adapter_to_model("a", lora())
    model.set_optimizer("AdamW", lr=1e-2, adapter_name="a")
    train(model, "a", 0)
    model.add_adapter_to_model("late", lora(2))
    model.set_optimizer("AdamW", lr=1e-2, adapter_name="late")
    train(model, "late", 3)
    before = tenant_snapshot(model, "a")
    model.remove_adapter("late")
    assert model.tenants() == ["a"]
    assert not any(".late." in n for n, _ in model.module.named_parameters())
    assert_bitwise_equal(before, tenant_snapshot(model, "a"))
    train(model, "a", 7, steps=1)
    with pytest.raises(ConfigError, match="no adapter named 'late'"):
        model.forward(inputs=make_batch(0), adapter_name="late")


def test_rank_limit_and_tenant_limit_are_clear_errors():
    model = make(max_tenants=1)
    with pytest.raises(ConfigError, match="max_lora_rank=8"):
        model.add_adapter_to_model("big", lora(16))
    model.add_adapter_to_model("one", lora())
    with pytest.raises(ConfigError, match="max_tenants=1"):
        model.add_adapter_to_model("two", lora())


def test_each_tenant_saves_a_plain_peft_adapter(tmp_path):
    import peft
    import transformers

    model = make()
    for name, r in (("a", 4), ("b", 2)):
        model.add_adapter_to_model(name, lora(r))
        model.set_optimizer("AdamW", lr=1e-2, adapter_name=name)
        train(model, name, r)
    batch = make_batch(9)
    for name in ("a", "b"):
        path = model.save(f"tenant-{name}", output_dir=str(tmp_path), adapter_name=name)
        config = transformers.AutoConfig.for_model(**tiny_qwen2_config())
        torch.manual_seed(0)
        base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        base.load_state_dict(_base_weights(model))
        loaded = peft.PeftModel.from_pretrained(base, path)
        with torch.no_grad():
            expected = model.forward_only(inputs=batch, adapter_name=name)["logits"]
            got = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _base_weights(model):
    """The frozen base weights under plain transformers names."""
    out = {}
    for k, v in model.module.state_dict().items():
        if "lora_" in k:
            continue
        out[k.removeprefix("base_model.model.").replace(".base_layer.", ".")] = v
    return out


def test_data_parallel_strategies_are_refused_with_a_reason(monkeypatch):
    from twinkle_core.strategy import SingleProcessStrategy

    class FakeDDP(SingleProcessStrategy):
        name = "ddp"

    with pytest.raises(ConfigError, match=r"got strategy 'ddp'.*several processes use 'grad_allreduce'"):
        MultiLoraTransformersModel(config=tiny_qwen2_config(), strategy=FakeDDP())
