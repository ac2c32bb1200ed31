"""Two tenants on one VLM base (``MultiLoraTransformersModel``): each gets its own LoRA on the language model and its
own trained projector copy; training one never changes the other's weights or outputs."""

from __future__ import annotations

import torch
from twinkle_vlm.testing import train_steps, vlm_batch

LORA = {"type": "lora", "r": 4, "lora_alpha": 8}


def _tenant_weights(model, name):
    return {k: v.detach().clone() for k, v in model.get_state_dict(adapter_name=name).items()}


def test_two_tenants_on_one_vlm_are_isolated(tiny_vlm_dir, colour_rows):
    from twinkle_backend_hf.multi_lora import MultiLoraTransformersModel
    from twinkle_vlm.task import VLMTask

    model_dir = str(tiny_vlm_dir("qwen2_5_vl"))
    task = VLMTask()
    model = MultiLoraTransformersModel(model_id=model_dir, task=task, max_lora_rank=8,
                                       tokenizer=MultiLoraTransformersModel.load_tokenizer(model_dir))
    task.prepare_model(model)
    for name in ("alice", "bob"):
        model.add_adapter_to_model(name, LORA)
        model.set_loss("cross_entropy", adapter_name=name)
        model.set_optimizer("SGD", adapter_name=name, lr=0.5)
    batch = vlm_batch(task, model, colour_rows)

    bob_weights = _tenant_weights(model, "bob")
    assert any("merger" in k for k in bob_weights) and any("lora_A" in k for k in bob_weights)
    bob_logits = model.forward_only(inputs=batch, adapter_name="bob")["logits"]
    alice_logits = model.forward_only(inputs=batch, adapter_name="alice")["logits"]

    losses = train_steps(model, batch, 3, "alice")
    assert losses[-1] < losses[0]
    after = _tenant_weights(model, "bob")
    assert all(torch.equal(after[k], v) for k, v in bob_weights.items())
    assert torch.equal(model.forward_only(inputs=batch, adapter_name="bob")["logits"], bob_logits)
    assert not torch.allclose(model.forward_only(inputs=batch, adapter_name="alice")["logits"], alice_logits)

    train_steps(model, batch, 1, "bob")  # and bob trains in turn
    assert not all(torch.equal(model.get_state_dict(adapter_name="bob")[k], v) for k, v in bob_weights.items())
