"""``train_vision`` / ``train_projector`` / ``train_language``: frozen weights stay bitwise unchanged, LoRA lands
only on the parts that ask for it, full parts train (through ``modules_to_save`` under an adapter), gradient
checkpointing gives the same gradients, and the core seams (``Task.model_inputs``, ``Task.adapter_config``)
carry it all."""

from __future__ import annotations

import re

import pytest
import torch
from twinkle_vlm.families import FAMILIES, part_of
from twinkle_vlm.parts import plan_from_options, require_adapter
from twinkle_vlm.testing import build_vlm_model, train_steps, vlm_batch

from twinkle_core.errors import ConfigError
from twinkle_core.task import Task

LORA = {"type": "lora", "r": 4, "lora_alpha": 8}
QWEN = FAMILIES["qwen2_5_vl"]


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def _changed(model, before):
    return {n for n, p in model.module.named_parameters() if not torch.equal(p, before[n])}


def _parts(names):
    return {part_of(n, QWEN) for n in names}


def test_default_plan_freezes_vision_bitwise_and_trains_projector_and_language_lora(tiny_vlm_dir, colour_rows):
    model, task = build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), adapter=LORA)
    batch = vlm_batch(task, model, colour_rows)
    before = _snapshot(model)
    train_steps(model, batch, 3, "default")
    changed = _changed(model, before)
    assert _parts(changed) == {"projector", "language"}
    # the language model trains through LoRA only (its base weights are bitwise unchanged), the projector fully
    assert all("lora_" in n for n in changed if part_of(n, QWEN) == "language")
    assert all(".modules_to_save." in n for n in changed if part_of(n, QWEN) == "projector")
    lora_layers = {n.split(".lora_")[0] for n, _ in model.module.named_parameters() if ".lora_" in n}
    assert lora_layers and _parts(lora_layers) == {"language"}


def test_full_fine_tuning_without_adapter_leaves_frozen_parts_out_of_the_optimizer(tiny_vlm_dir, colour_rows):
    options = {"train_vision": "frozen", "train_projector": "full", "train_language": "full"}
    model, task = build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), task_options=options)
    batch = vlm_batch(task, model, colour_rows)
    before = _snapshot(model)
    train_steps(model, batch, 2)
    assert _parts(_changed(model, before)) == {"projector", "language"}
    vision = {id(p) for n, p in model.module.named_parameters() if part_of(n, QWEN) == "vision"}
    assert not vision & {id(p) for p in model.trainable_parameters()}


def test_lora_on_vision_spares_the_nested_merger(tiny_vlm_dir, colour_rows):
    options = {"train_vision": "lora", "train_projector": "frozen", "train_language": "frozen"}
    model, task = build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), adapter=LORA, task_options=options)
    targets = model.module.peft_config["default"].target_modules
    assert re.fullmatch(targets, "model.visual.blocks.0.attn.qkv")
    assert not re.fullmatch(targets, "model.visual.merger.mlp.0")
    assert not re.fullmatch(targets, "model.language_model.layers.0.self_attn.q_proj")
    before = _snapshot(model)
    train_steps(model, vlm_batch(task, model, colour_rows), 2, "default")
    changed = _changed(model, before)
    assert changed and _parts(changed) == {"vision"} and all("lora_" in n for n in changed)


def test_full_vision_with_frozen_merger_trains_the_blocks_only(tiny_vlm_dir, colour_rows):
    options = {"train_vision": "full", "train_projector": "frozen", "train_language": "lora"}
    model, task = build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), adapter=LORA, task_options=options)
    saved = model.module.peft_config["default"].modules_to_save
    assert {"model.visual.patch_embed", "model.visual.blocks.0", "model.visual.blocks.1"} <= set(saved)
    assert not any("merger" in m for m in saved)
    before = _snapshot(model)
    train_steps(model, vlm_batch(task, model, colour_rows), 2, "default")
    assert _parts(_changed(model, before)) == {"vision", "language"}


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_vlm_dir, colour_rows):
    grads = []
    for checkpointing in (False, True):
        model, task = build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), adapter=LORA, gradient_checkpointing=checkpointing)
        out = model.forward_backward(inputs=vlm_batch(task, model, colour_rows), adapter_name="default")
        grads.append((float(out["loss"]), {n: p.grad.clone() for n, p in model.module.named_parameters()
                                           if p.grad is not None}))
    (loss, plain), (loss_ckpt, ckpt) = grads
    assert loss == pytest.approx(loss_ckpt, rel=1e-6)
    assert plain.keys() == ckpt.keys() and plain
    for name in plain:  # recomputation repeats the same fp32 arithmetic
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-5, atol=1e-7)


def test_bad_plans_fail_with_the_fix():
    with pytest.raises(ConfigError, match="train_vision must be one of full, lora, frozen"):
        plan_from_options({"train_vision": "partly"})
    with pytest.raises(ConfigError, match="needs a LoRA adapter: set model.adapter"):
        require_adapter(plan_from_options({}), adapters=[])
    require_adapter(plan_from_options({"train_language": "full"}), adapters=[])


def test_adapter_options_that_cannot_apply_are_refused(tiny_vlm_dir):
    with pytest.raises(ConfigError, match="no part trains with LoRA"):
        build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), adapter=LORA, task_options={"train_language": "full"})
    with pytest.raises(ConfigError, match="all-linear or a list of layer names"):
        build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), adapter={**LORA, "target_modules": ".*q_proj"})
    with pytest.raises(ConfigError, match="names no linear layer"):
        build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), adapter={**LORA, "target_modules": ["qkv"]})


def test_task_seams_reach_the_backend(tiny_vlm_dir, colour_rows):
    """``Task.model_inputs`` (vision tensors reach the forward) and ``Task.adapter_config`` (called with the
    recipe's config when the backend adds the adapter) are honoured by ``TransformersModel``."""
    assert Task.model_inputs == () and Task.adapter_config(None, None, {"r": 1}) == {"r": 1}
    model, task = build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), adapter={**LORA, "target_modules": ["q_proj"]})
    targets = model.module.peft_config["default"].target_modules
    assert targets.endswith("(?:q_proj)$")
    batch = vlm_batch(task, model, colour_rows[:1])
    logits = model.forward_only(inputs=batch)["logits"]
    other = model.forward_only(inputs={**batch, "pixel_values": -batch["pixel_values"]})["logits"]
    assert not torch.allclose(logits, other)  # the image reaches the network


def test_adapter_config_seam_on_a_text_model():
    """The core contract on its own: ``TransformersModel`` places the adapter the task's ``adapter_config`` returns."""
    from twinkle_backend_hf.model import TransformersModel
    from twinkle_backend_hf.testing import tiny_qwen2_config

    seen = []

    class QueriesOnly(Task):
        def load_dataset(self, path, tokenizer, **options):
            return []

        def collate(self, features):
            return {}

        def adapter_config(self, model, config):
            seen.append(config.target_modules)
            config.target_modules = ["q_proj"]
            return config

    model = TransformersModel(config=tiny_qwen2_config(), task=QueriesOnly())
    model.add_adapter_to_model("a", {"type": "lora", "r": 2, "target_modules": "all-linear"})
    layers = {n.split(".lora_A")[0] for n, _ in model.module.named_parameters() if ".lora_A" in n}
    assert seen == ["all-linear"] and layers and all(n.endswith("q_proj") for n in layers)


def test_a_lora_part_without_adapter_fails_when_training_starts(tiny_vlm_dir, colour_rows):
    model, task = build_vlm_model(tiny_vlm_dir("qwen2_5_vl"))  # default plan (LoRA on the LM), no adapter
    with pytest.raises(ConfigError, match="train_language: lora needs a LoRA adapter"):
        task.next_training_batch(model, lambda: vlm_batch(task, model, colour_rows))
