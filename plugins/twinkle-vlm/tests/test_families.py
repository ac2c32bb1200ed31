"""Every supported family: its tiny model loads offline, every weight belongs to a part, and it trains a step
with the ``vlm`` task (default plan: vision frozen, projector full, LoRA on the language model), saves, reloads
and gives the same logits."""

from __future__ import annotations

import pytest
import torch
from twinkle_vlm.families import FAMILIES, PARTS, family_for, part_of, strip_wrappers
from twinkle_vlm.testing import TINY_MODEL_TYPES, build_tiny_vlm, train_steps
from twinkle_vlm.testing import build_vlm_model as build_model
from twinkle_vlm.testing import vlm_batch as batch_of

from twinkle_core.errors import ConfigError

LORA = {"type": "lora", "r": 4, "lora_alpha": 8}


def test_every_family_has_a_tiny_model():
    assert set(TINY_MODEL_TYPES) == set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_weight_belongs_to_one_part(model_type):
    model, processor = build_tiny_vlm(model_type)
    family = family_for(model)
    counts = dict.fromkeys(PARTS, 0)
    for name, param in model.named_parameters():
        part = part_of(name, family)
        assert part is not None, name
        counts[part] += param.numel()
    assert all(counts.values()), counts  # no part is empty: the prefixes match the real module tree
    assert model.get_output_embeddings() is not None
    # the placeholder the family names is the token whose embeddings the model replaces by image features
    config = model.config
    image_token_id = getattr(config, "image_token_id", None) or config.image_token_index
    assert processor.tokenizer.convert_tokens_to_ids(family.image_token) == image_token_id
    assert type(processor).__name__ == family.processor_class


def test_part_of_sees_through_peft_names():
    family = FAMILIES["qwen2_5_vl"]
    assert part_of("base_model.model.model.visual.merger.modules_to_save.default.mlp.0.weight", family) == "projector"
    assert part_of("base_model.model.model.visual.blocks.0.attn.qkv.weight", family) == "vision"
    assert part_of("base_model.model.lm_head.weight", family) == "language"
    assert strip_wrappers("base_model.model.model.visual.merger.original_module.ln_q.weight") == \
        "model.visual.merger.ln_q.weight"


def test_unknown_model_type_is_refused_with_the_supported_list():
    class Config:
        model_type = "llava"

    with pytest.raises(ConfigError, match="qwen2_5_vl"):
        family_for(Config())


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_trains_saves_and_reloads(model_type, tiny_vlm_dir, colour_rows, tmp_path):
    model, task = build_model(tiny_vlm_dir(model_type), adapter=LORA)
    batch = batch_of(task, model, colour_rows[:2])
    before = {n: p.detach().clone() for n, p in model.module.named_parameters() if p.requires_grad}
    losses = train_steps(model, batch, 2, "default")
    assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0]
    changed = [n for n, p in model.module.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert any("lora_B" in n for n in changed) and any("modules_to_save" in n for n in changed)

    logits = model.forward_only(inputs=batch, adapter_name="default")["logits"]
    path = model.save("step-2", output_dir=str(tmp_path), adapter_name="default", save_optimizer=False)
    reloaded, _ = build_model(tiny_vlm_dir(model_type), adapter=LORA)
    reloaded.load(path, adapter_name="default")
    again = reloaded.forward_only(inputs=batch, adapter_name="default")["logits"]
    torch.testing.assert_close(again, logits, rtol=1e-5, atol=1e-5)


def test_megatron_refuses_a_family_it_does_not_build_naming_the_hf_backend():
    # gemma3, not qwen2_5_vl: Megatron builds Qwen2.5-VL, and a default-size config of it is a 7B model
    pytest.importorskip("megatron.core")
    from twinkle_backend_megatron.model import MegatronModel
    from twinkle_vlm.task import VLMTask

    with pytest.raises(ConfigError, match="TransformersModel"):
        MegatronModel(config={"model_type": "gemma3"}, task=VLMTask())
