"""LoRA on the LM head (``lm_head``, Megatron's ``output_layer``): the same adapter as PEFT's, read and written both
ways, with tied and untied embeddings, and the targets by kind (``lora_target_modules``)."""

from __future__ import annotations

import pytest
import torch
import transformers
from twinkle_backend_hf.model import TransformersModel
from twinkle_backend_megatron.lora import ALL_LINEAR, HEAD
from twinkle_backend_megatron.testing import make_tiny_model, tiny_qwen2_config

from twinkle_core.testing.conformance import make_batch
from twinkle_core.testing.tolerance import forward_tolerance

ADAPTER = {"type": "lora", "r": 4, "lora_alpha": 8, "target_modules": [*ALL_LINEAR, HEAD], "init_lora_weights": False}


def _tolerance(logits: torch.Tensor, config: dict) -> float:
    return forward_tolerance(float(logits.abs().max()), depth=config["num_hidden_layers"],
                             width=max(config["hidden_size"], config["intermediate_size"]))


def test_targets_by_kind_name_the_head():
    model = make_tiny_model(seed=0)
    assert model.lora_target_modules() == {"attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
                                           "mlp": ["gate_proj", "up_proj", "down_proj"], "unembed": ["lm_head"]}
    model.add_adapter_to_model("head", {"r": 2, "target_modules": ["lm_head"]})
    assert {k.split(".lora_")[0] for k in model.get_state_dict(adapter_name="head")} == {"base_model.model.lm_head"}


@pytest.mark.parity
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_head_adapter_is_peft_both_ways(tmp_path, tied):
    import peft

    config = tiny_qwen2_config(tie_word_embeddings=tied)
    batch = make_batch(3)
    hf = TransformersModel(config=config, seed=0)
    hf.add_adapter_to_model("t", dict(ADAPTER))
    from_peft = hf.save("from_peft", output_dir=str(tmp_path), adapter_name="t", save_optimizer=False)
    megatron = make_tiny_model(seed=0, config=config)
    megatron.add_adapter_to_model("t", dict(ADAPTER))
    megatron.load(from_peft, adapter_name="t")
    want = hf.forward_only(inputs=batch, adapter_name="t")["logits"]
    base = hf.forward_only(inputs=batch, adapter_name="t", disable_adapters=True)["logits"]
    head_only = TransformersModel(config=config, seed=0)
    head_only.add_adapter_to_model("h", {**ADAPTER, "target_modules": [HEAD]})
    head_only.load(from_peft, adapter_name="h")  # the head's part of the same adapter: it changes the logits
    assert float((head_only.forward_only(inputs=batch, adapter_name="h")["logits"] - base).abs().max()) > 1e-3
    tolerance = _tolerance(want, config)
    torch.testing.assert_close(megatron.forward_only(inputs=batch, adapter_name="t")["logits"], want,
                               atol=tolerance, rtol=0)
    megatron.set_optimizer("AdamW", lr=1e-2, adapter_name="t")
    before = megatron.get_state_dict(adapter_name="t")["base_model.model.lm_head.lora_B.t.weight"].clone()
    for _ in range(2):
        megatron.forward_backward(inputs=batch, adapter_name="t")
        megatron.clip_grad_and_step(adapter_name="t")
    assert not torch.equal(megatron.get_state_dict(adapter_name="t")["base_model.model.lm_head.lora_B.t.weight"],
                           before), "the head's LoRA trains"
    trained = megatron.save("trained", output_dir=str(tmp_path), adapter_name="t", save_optimizer=False)
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config),
                                                          dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(plain, trained).eval()
    with torch.no_grad():
        got = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want = megatron.forward_only(inputs=batch, adapter_name="t")["logits"]
    torch.testing.assert_close(got, want, atol=_tolerance(want, config), rtol=0)
