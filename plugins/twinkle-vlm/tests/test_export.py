"""Export: ``save()`` writes what plain transformers (``AutoModelForImageTextToText`` + ``AutoProcessor``) and plain
``peft`` load, with the logits of Twinkle's ``forward_only`` on the same image and text, and it generates.

Without torchvision, transformers 5.24 cannot build the Qwen / InternVL processors at all (their video processor
needs it); ``twinkle_vlm.compat`` is active in this process for ``AutoProcessor`` (it changes nothing with
torchvision installed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from twinkle_vlm.testing import build_vlm_model, train_steps, vlm_batch

LORA = {"type": "lora", "r": 4, "lora_alpha": 8}
QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]


def _plain_inputs(processor):
    text = processor.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    return dict(processor(text=[text], images=[Image.new("RGB", (40, 36), (200, 40, 40))], return_tensors="pt"))


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_full_export_loads_in_plain_transformers_with_equal_logits(model_type, tiny_vlm_dir, colour_rows, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    options = {"train_vision": "frozen", "train_projector": "full", "train_language": "full"}
    model, task = build_vlm_model(tiny_vlm_dir(model_type), task_options=options)
    train_steps(model, vlm_batch(task, model, colour_rows), 2)
    path = model.save("final", output_dir=str(tmp_path), save_optimizer=False)

    # without torchvision there is no video processor: none is written, so an install with torchvision loads
    # the model type's default one
    assert "video_processor" not in json.loads((Path(path) / "processor_config.json").read_text())
    processor = AutoProcessor.from_pretrained(path)
    plain = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    inputs = _plain_inputs(processor)
    with torch.no_grad():
        expected = plain(**inputs).logits
    ours = model.forward_only(inputs=inputs)["logits"]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)

    # a random network may say its end of turn at once (the export's generation_config stops there): 4 new tokens
    # whatever it says, then the saved stop tokens themselves
    generated = plain.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 4
    end_of_turn = processor.tokenizer.convert_tokens_to_ids({"qwen2_5_vl": "<|im_end|>", "gemma3": "<end_of_turn>"}[
        model_type])
    eos = plain.generation_config.eos_token_id
    assert end_of_turn in (eos if isinstance(eos, list) else [eos]), "the export stops at the chat's end of turn"

    # and Twinkle's own load() (a resumed run) restores the same network
    fresh, _ = build_vlm_model(tiny_vlm_dir(model_type), task_options=options)
    fresh.load(path)
    torch.testing.assert_close(fresh.forward_only(inputs=inputs)["logits"], ours, rtol=1e-5, atol=1e-5)


def test_lora_export_loads_with_plain_peft_with_equal_logits(tiny_vlm_dir, colour_rows, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    base_dir = tiny_vlm_dir("qwen2_5_vl")
    model, task = build_vlm_model(base_dir, adapter=LORA)  # default plan: projector full, LoRA on the LM
    train_steps(model, vlm_batch(task, model, colour_rows), 2, "default")
    path = model.save("adapter", output_dir=str(tmp_path), adapter_name="default", save_optimizer=False)

    base = AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32)
    plain = PeftModel.from_pretrained(base, path).eval()
    inputs = _plain_inputs(AutoProcessor.from_pretrained(path))
    with torch.no_grad():
        expected = plain(**inputs).logits
        untrained = base.get_base_model()(**inputs).logits if hasattr(base, "get_base_model") else None
    ours = model.forward_only(inputs=inputs, adapter_name="default")["logits"]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    # the trained projector came back too (not only the LoRA weights): its copy differs from the base's
    projector = [n for n, _ in plain.named_parameters() if "merger.modules_to_save" in n]
    assert projector
    with plain.disable_adapter(), torch.no_grad():
        assert not torch.allclose(plain(**inputs).logits, expected)
    assert untrained is None or not torch.allclose(untrained, expected)
