"""Adapter edge cases users met: saving the base before adding tenants, names PEFT cannot store, and saved adapters
that peft's auto class loads."""

from __future__ import annotations

import json

import pytest
import torch
from families import FAMILIES
from twinkle_backend_hf.multi_lora import MultiLoraTransformersModel

from twinkle_core.errors import ConfigError
from twinkle_core.testing.conformance import make_batch

LORA = {"type": "lora", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def test_saving_the_base_first_still_lets_every_tenant_be_added(tmp_path):
    model = MultiLoraTransformersModel(config=dict(FAMILIES["qwen2"]), seed=0)
    model.save("base", output_dir=str(tmp_path), save_optimizer=False)
    for name in ("a", "b"):
        model.add_adapter_to_model(name, LORA)
        model.set_optimizer("AdamW", lr=1e-2, adapter_name=name)
        out = model.forward_backward(inputs=make_batch(0, rows=2, length=8), adapter_name=name)
        model.clip_grad_and_step(adapter_name=name)
        assert torch.isfinite(out["loss"])


@pytest.mark.parametrize("name", ["double", "float", "half", "train"])
def test_a_name_peft_cannot_store_is_refused_with_a_suggestion(name):
    model = MultiLoraTransformersModel(config=dict(FAMILIES["qwen2"]), seed=0)
    with pytest.raises(ConfigError, match=f"torch.nn.Module attribute.*'tenant_{name}'"):
        model.add_adapter_to_model(name, LORA)


def test_a_saved_adapter_loads_with_peft_s_auto_class(tmp_path):
    import peft

    model = MultiLoraTransformersModel(config=dict(FAMILIES["qwen2"]), seed=0)
    model.save("base", output_dir=str(tmp_path), save_optimizer=False)
    model.add_adapter_to_model("t", LORA)
    path = model.save("t", output_dir=str(tmp_path), adapter_name="t", save_optimizer=False)
    config = json.loads((tmp_path / "t" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM"
    config["base_model_name_or_path"] = str(tmp_path / "base")  # a config-built base has no path of its own
    (tmp_path / "t" / "adapter_config.json").write_text(json.dumps(config))
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(path)
    batch = make_batch(1, rows=2, length=8)
    with torch.no_grad():
        got = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want = model.forward_only(inputs=batch, adapter_name="t")["logits"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
