"""``TransformersModel.lora_target_modules()``: a Qwen2's projections by kind, the same once PEFT wraps them."""

from __future__ import annotations

from twinkle_backend_hf.testing import make_tiny_model

QWEN2 = {"attn": ["k_proj", "o_proj", "q_proj", "v_proj"], "mlp": ["down_proj", "gate_proj", "up_proj"],
         "unembed": ["lm_head"]}


def test_qwen2_projections_by_kind():
    assert make_tiny_model(seed=0).lora_target_modules() == QWEN2


def test_layers_wrapped_by_an_adapter_are_still_their_kind():
    model = make_tiny_model(seed=0)
    model.add_adapter_to_model("a", {"type": "lora", "r": 2, "target_modules": ["q_proj", "up_proj", "lm_head"]})
    assert model.lora_target_modules() == QWEN2  # not base_layer, lora_A or the adapter's name
