"""MegatronModel in one process: the core's conformance suite, LoRA <-> PEFT, options, errors, multi-tenant LoRA."""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import sys

import pytest
import torch
import transformers
from twinkle_backend_hf.model import TransformersModel
from twinkle_backend_megatron.model import MegatronModel
from twinkle_backend_megatron.multi_lora import MultiLoraMegatronModel
from twinkle_backend_megatron.testing import (
    make_tiny_model,
    make_tiny_multi_lora_model,
    tiny_llama_config,
    tiny_qwen2_config,
)

from twinkle_core.errors import ConfigError, UnsupportedHardwareError
from twinkle_core.testing.conformance import (
    LORA_CONFIG,
    LoraTargetContract,
    ModelContract,
    TaskContract,
    make_batch,
)
from twinkle_core.testing.tolerance import (
    assert_within_spread,
    forward_tolerance,
    sum_tolerance,
    unit_roundoff,
)


class TestMegatronModelContract(ModelContract):
    """The core's suite, unchanged, against MegatronModel in one process."""

    @pytest.fixture
    def twinkle_factory(self):
        return make_tiny_model


class TestMegatronModelLoraTargets(LoraTargetContract):
    """LoRA targets by kind: q/k/v/o_proj, gate/up/down_proj, the output layer."""

    @pytest.fixture
    def twinkle_factory(self):
        return make_tiny_model


class TestMegatronModelTasks(TaskContract):
    """The task side: the causal LM it declares builds; the other kinds are refused before building."""

    @pytest.fixture
    def twinkle_factory(self):
        return make_tiny_model


# ---------------------------------------------------------------------- LoRA <-> PEFT
@pytest.mark.parity
def test_lora_adapter_loads_in_plain_peft_with_the_same_logits(tmp_path):
    import peft

    model = make_tiny_model(seed=0, config=tiny_llama_config())
    model.add_adapter_to_model("default", {**LORA_CONFIG, "init_lora_weights": False})
    model.set_optimizer("AdamW", lr=1e-2)
    batch = make_batch(0)
    for _ in range(2):
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
    path = model.save("lora", output_dir=str(tmp_path))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(path))
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**tiny_llama_config()), dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, path).eval()
    with torch.no_grad():
        got = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    config = tiny_llama_config()
    tolerance = forward_tolerance(float(got.abs().max()), depth=config["num_hidden_layers"],
                                  width=max(config["hidden_size"], config["intermediate_size"]))
    torch.testing.assert_close(got, model.forward_only(inputs=batch)["logits"], atol=tolerance, rtol=0)


@pytest.mark.parity
def test_peft_adapter_from_the_hf_backend_trains_identically_on_megatron(tmp_path):
    """Same base, same adapter weights (a PEFT file), same optimizer: the same losses on both backends."""
    hf = TransformersModel(config=tiny_qwen2_config(), seed=0)
    hf.add_adapter_to_model("t", {**LORA_CONFIG, "init_lora_weights": False})
    hf.set_optimizer("AdamW", lr=1e-2)
    path = hf.save("start", output_dir=str(tmp_path))
    models = []
    # the second HF model trains on the same batches with their rows reversed: the reference's own float spread
    for cls in (TransformersModel, MegatronModel, TransformersModel):
        model = cls(config=tiny_qwen2_config(), seed=0)
        model.add_adapter_to_model("t", copy.deepcopy(LORA_CONFIG))
        model.load(path, adapter_name="t")
        model.set_optimizer("AdamW", lr=1e-2, adapter_name="t")
        models.append(model)
    hf_state, mg_state = (m.get_state_dict(adapter_name="t") for m in models[:2])
    assert hf_state.keys() == mg_state.keys()
    for key in hf_state:
        assert torch.equal(hf_state[key], mg_state[key]), key
    losses = [[], [], []]
    for step in range(5):
        for model, out, batch in zip(models, losses, _with_reversed_rows(make_batch(50 + step))):
            result = model.forward_backward(inputs=batch, adapter_name="t")
            model.clip_grad_and_step(max_grad_norm=1.0, adapter_name="t")
            out.append(float(result["loss"]))
    hf, megatron, reordered = losses
    assert_within_spread("losses", megatron, hf, reordered, floor=sum_tolerance(8 * 12, max(hf)))


def _with_reversed_rows(batch):
    """The batch for the reference, the model under test, and the reference's reordered run."""
    return batch, batch, {key: value.flip(0) for key, value in batch.items()}


def test_lora_targets_follow_peft_matching():
    model = make_tiny_model(seed=0)
    model.add_adapter_to_model("qv", {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]})
    names = model.get_state_dict(adapter_name="qv")
    assert {k.split(".")[-4] for k in names} == {"q_proj", "v_proj"}
    # only the adapted projections of the fused linear_qkv get a delta (k stays the base's)
    batch = make_batch(1)
    base = model.forward_only(inputs=batch)["logits"]
    torch.testing.assert_close(base, make_tiny_model(seed=0).forward_only(inputs=batch)["logits"])
    with pytest.raises(ConfigError, match="match no layer"):
        model.add_adapter_to_model("none", {"r": 2, "target_modules": ["nothing_here"]})
    with pytest.raises(ConfigError, match="use_dora"):
        model.add_adapter_to_model("dora", {"r": 2, "target_modules": "all-linear", "use_dora": True})


# ---------------------------------------------------------------------- options and errors
def test_clear_errors():
    with pytest.raises(ConfigError, match="model_id= .* or config="):
        MegatronModel()
    with pytest.raises(ConfigError, match="'megatron' strategy"):
        make_tiny_model(strategy="ddp")
    with pytest.raises(ConfigError, match="no fsdp dimension"):
        make_tiny_model(mesh={"fsdp": 2})
    with pytest.raises(ConfigError, match="no Ulysses sequence parallelism"):
        make_tiny_model(mesh={"sp": 2})
    with pytest.raises(UnsupportedHardwareError, match="context parallelism"):
        make_tiny_model(mesh={"cp": 2})
    with pytest.raises(ConfigError, match="sequence_parallel=True needs tensor parallelism"):
        make_tiny_model(strategy_options={"sequence_parallel": True})
    with pytest.raises(UnsupportedHardwareError, match="fp8"):
        make_tiny_model(precision="fp8")
    with pytest.raises(ConfigError, match="recompute"):
        make_tiny_model(recompute="everything")


def test_unknown_strategy_option_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown option"):
        make_tiny_model(strategy_options={"bogus": 1})


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_activation_recompute_changes_nothing_but_memory(recompute):
    batch = make_batch(3)
    plain, recomputed = make_tiny_model(seed=0), make_tiny_model(seed=0, recompute=recompute)
    norms = []
    for model in (plain, recomputed):
        model.set_optimizer("SGD", lr=0.1)
        out = model.forward_backward(inputs=batch)
        norms.append((float(out["loss"]), model.clip_grad_norm(math.inf)))
    assert norms[1] == pytest.approx(norms[0], rel=1e-6)


@pytest.mark.parity
def test_bf16_trains_close_to_fp32():
    batch = make_batch(4)
    losses = []
    for precision in ("no", "bf16"):
        model = make_tiny_model(seed=0, precision=precision)
        model.set_optimizer("AdamW", lr=1e-2)
        for _ in range(3):
            out = model.forward_backward(inputs=batch)
            model.clip_grad_and_step()
        losses.append(float(out["loss"]))
    # bf16 keeps 8 significant bits (unit roundoff u = 2^-8): after the same three steps the loss is within a few
    # u * |loss| of fp32's (0.4 u measured here); a wrong cast or a skipped step moves it by ~0.5
    assert losses[1] == pytest.approx(losses[0], abs=8 * unit_roundoff(torch.bfloat16) * abs(losses[0]))


def test_train_configs_describe_megatron():
    cfg = make_tiny_model(seed=0, recompute="full").get_train_configs()
    assert cfg["class"] == "MegatronModel" and cfg["megatron_core"] == "0.16.1"
    assert cfg["strategy"]["name"] == "megatron" and cfg["strategy"]["cpu_compat_layer"] is True
    assert (cfg["tp"], cfg["pp"], cfg["recompute"]) == (1, 1, "full")


@pytest.mark.parity
def test_user_loop_written_for_transformers_runs_unchanged():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    spec = importlib.util.spec_from_file_location(
        "same_loop", os.path.join(os.path.dirname(__file__), "..", "examples", "same_loop_both_backends.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    batches = [make_batch(i, rows=4) for i in range(4)]
    hf = example.train(TransformersModel(config=tiny_qwen2_config(), seed=0), batches)
    megatron = example.train(MegatronModel(config=tiny_qwen2_config(), seed=0), batches)
    reordered = example.train(TransformersModel(config=tiny_qwen2_config(), seed=0),
                              [_with_reversed_rows(batch)[2] for batch in batches])
    assert_within_spread("losses", megatron, hf, reordered, floor=sum_tolerance(2 * 4 * 12, max(hf)))


# ---------------------------------------------------------------------- multi-tenant LoRA
def _lora(r=4, targets=("q_proj", "v_proj")):
    return {"r": r, "lora_alpha": 2 * r, "target_modules": list(targets)}


def test_multi_lora_tenants_are_isolated_and_limited():
    model = MultiLoraMegatronModel(config=tiny_qwen2_config(), seed=0, max_lora_rank=8, max_tenants=2)
    model.add_adapter_to_model("a", _lora(4))
    model.add_adapter_to_model("b", _lora(8, ("gate_proj", "up_proj", "down_proj")))
    model.set_optimizer("AdamW", lr=1e-2, adapter_name="a")
    model.set_optimizer("SGD", lr=0.1, adapter_name="b")
    before_b = {k: v.clone() for k, v in model.get_state_dict(adapter_name="b").items()}
    logits_b = model.forward_only(inputs=make_batch(0), adapter_name="b")["logits"].clone()
    for step in range(2):
        model.forward_backward(inputs=make_batch(step), adapter_name="a")
        model.clip_grad_and_step(adapter_name="a")
    # a NaN in tenant a's gradients skips a's step and leaves b alone
    model.forward_backward(inputs=make_batch(5), adapter_name="a")
    for p in model.trainable_parameters(adapter_name="a"):
        p.grad.fill_(float("nan"))
    weights_a = {k: v.clone() for k, v in model.get_state_dict(adapter_name="a").items()}
    model.clip_grad_and_step(adapter_name="a")
    assert all(torch.equal(v, weights_a[k]) for k, v in model.get_state_dict(adapter_name="a").items())
    assert model.get_train_configs(adapter_name="a")["skipped_steps"] == 1
    after_b = model.get_state_dict(adapter_name="b")
    assert all(torch.equal(after_b[k], before_b[k]) for k in before_b)
    torch.testing.assert_close(model.forward_only(inputs=make_batch(0), adapter_name="b")["logits"], logits_b,
                               atol=0, rtol=0)
    assert model.get_train_configs(adapter_name="b")["step"] == 0
    with pytest.raises(ConfigError, match="max_lora_rank=8"):
        model.add_adapter_to_model("big", _lora(16))
    with pytest.raises(ConfigError, match="max_tenants=2"):
        model.add_adapter_to_model("c", _lora(4))
    model.remove_adapter("b")
    assert model.tenants() == ["a"]
    model.add_adapter_to_model("c", _lora(2))
    assert model.tenants() == ["a", "c"]


# ---------------------------------------------------------------------- distributed optimizer (one rank)
def test_distributed_optimizer_matches_the_plain_optimizer_and_refuses_others():
    options = {"distributed_optimizer": True}
    plain, sharded = make_tiny_model(seed=0), make_tiny_model(seed=0, strategy_options=options)
    results = []
    for model in (plain, sharded):
        model.set_optimizer("AdamW", lr=1e-2, weight_decay=0.1)
        model.set_lr_scheduler("linear", num_training_steps=3)
        run = []
        for step in range(3):
            out = model.forward_backward(inputs=make_batch(step))
            run += [float(out["loss"]), model.clip_grad_and_step(max_grad_norm=0.5)]
        results.append(run)
    assert results[1] == pytest.approx(results[0], rel=1e-6)
    with pytest.raises(ConfigError, match="Adam / AdamW only"):
        make_tiny_model(seed=0, strategy_options=options).set_optimizer("SGD", lr=0.1)
    with pytest.raises(ConfigError, match="full fine-tuning only"):
        model = make_tiny_model(seed=0, strategy_options=options)
        model.add_adapter_to_model("a", copy.deepcopy(LORA_CONFIG))
        model.set_optimizer("AdamW", lr=1e-2)


class TestMultiLoraTenantsDisabled:
    """``disable_adapters=True`` on a multi-tenant model: the tenant named by ``adapter_name`` runs the base."""

    test_forward_only_with_adapters_disabled_is_the_base_model = \
        ModelContract.test_forward_only_with_adapters_disabled_is_the_base_model

    @pytest.fixture
    def twinkle_factory(self):
        return make_tiny_multi_lora_model
