"""The ``vlm_preference`` task: image preference rows -> pairs of VLM chats in the preference layout, and a DPO step
on a tiny Qwen2.5-VL equal to per-sequence plain transformers forwards with the DPO formula written out here."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image
from twinkle_vlm.families import FAMILIES, part_of
from twinkle_vlm.preference import VLMPreferenceTask

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError, DataFormatError
from twinkle_core.testing.tolerance import forward_tolerance, max_abs_diff

pytest.importorskip("twinkle_rl")

QWEN = FAMILIES["qwen2_5_vl"]
FULL = {"train_vision": "full", "train_projector": "full", "train_language": "full"}
LORA = {"type": "lora", "r": 4, "lora_alpha": 8}
BETA = 0.1


def _pair_rows(colour_rows):
    """The colour chats as pairs: the picture's colour is chosen, the next colour rejected."""
    names = [row["messages"][1]["content"] for row in colour_rows]
    return [{"messages": row["messages"][:1], "chosen": name, "rejected": names[(i + 1) % len(names)]}
            for i, (row, name) in enumerate(zip(colour_rows, names, strict=True))]


def _model(model_dir, *, task_options=None, adapter=None, **options):
    from twinkle_backend_hf.model import TransformersModel

    task = VLMPreferenceTask(**(task_options or {}), **options)
    tokenizer = TransformersModel.load_tokenizer(str(model_dir))
    model = TransformersModel(model_id=str(model_dir), task=task, tokenizer=tokenizer)
    task.prepare_model(model)
    name = None
    if adapter is not None:
        name = "default"
        model.add_adapter_to_model(name, adapter)
    model.set_loss("dpo", adapter_name=name, beta=BETA)
    model.set_optimizer("SGD", adapter_name=name, lr=0.5)
    return model, task


def _batch(task, model, rows):
    features = task.load_dataset(rows, model.tokenizer)
    task.prepare_dataset(model, features, split="train", output_dir="unused")
    return task.prepare_batch(model, task.collate(features))


# ---------------------------------------------------------------------- encoding and batches
def test_a_row_becomes_two_chats_sharing_the_prompt_and_its_image(tiny_vlm_dir, colour_rows):
    from twinkle_backend_hf.model import TransformersModel

    tokenizer = TransformersModel.load_tokenizer(str(tiny_vlm_dir("qwen2_5_vl")))
    task = VLMPreferenceTask()
    features = task.load_dataset(_pair_rows(colour_rows), tokenizer)
    assert task.stats == {"pairs": 4, "truncated": 0, "skipped_over_length": 0, "skipped_identical": 0}
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for feature, row in zip(features, _pair_rows(colour_rows), strict=True):
        chosen, rejected = feature.chosen, feature.rejected
        prompt = next(i for i, label in enumerate(chosen.labels) if label != IGNORE_INDEX)
        assert chosen.input_ids[:prompt] == rejected.input_ids[:prompt]
        assert image_token in chosen.input_ids[:prompt]
        for key, value in chosen.vision.items():
            assert torch.equal(value, rejected.vision[key]), key
        for sequence, answer in ((chosen, row["chosen"]), (rejected, row["rejected"])):
            trained = [label for label in sequence.labels if label != IGNORE_INDEX]
            assert tokenizer.decode(trained) == f"{answer}<|im_end|>"


def test_the_batch_gives_each_of_the_2p_rows_its_own_copy_of_the_image(tiny_vlm_dir, colour_rows):
    from twinkle_backend_hf.model import TransformersModel

    tokenizer = TransformersModel.load_tokenizer(str(tiny_vlm_dir("qwen2_5_vl")))
    task = VLMPreferenceTask()
    features = task.load_dataset(_pair_rows(colour_rows), tokenizer)
    batch = task.collate(features)
    assert batch["input_ids"].shape[0] == 8
    assert batch["pair_index"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert batch["is_chosen"].tolist() == [True, False] * 4
    grids = batch["image_grid_thw"]
    assert grids.shape[0] == 8 and torch.equal(grids[0::2], grids[1::2])
    patches = grids.prod(-1).tolist()
    assert batch["pixel_values"].shape[0] == sum(patches)
    # the image tensors come in row order: rows 2k and 2k+1 hold the same picture
    pieces = torch.split(batch["pixel_values"], patches)
    assert all(torch.equal(pieces[2 * k], pieces[2 * k + 1]) for k in range(4))


def test_packing_and_unknown_options_are_refused():
    with pytest.raises(ConfigError, match="packing: false"):
        VLMPreferenceTask(packing=True)
    with pytest.raises(ConfigError, match="not an option of the vlm_preference task"):
        VLMPreferenceTask(train_vison="full")


def test_bad_rows_are_reported_with_their_line_and_identical_pairs_skipped(tiny_vlm_dir, colour_rows, tmp_path):
    from twinkle_backend_hf.model import TransformersModel

    tokenizer = TransformersModel.load_tokenizer(str(tiny_vlm_dir("qwen2_5_vl")))
    rows = _pair_rows(colour_rows)
    bad = [rows[0], {"messages": rows[1]["messages"], "chosen": "x"},
           {**rows[2], "messages": [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "no.png")},
                                                                 {"type": "text", "text": "?"}]}]}]
    with pytest.raises(DataFormatError) as caught:
        VLMPreferenceTask().load_dataset(bad, tokenizer)
    assert "<rows>:2: row has no 'rejected'" in str(caught.value) and "<rows>:3:" in str(caught.value)
    task = VLMPreferenceTask()
    task.load_dataset([rows[0], {**rows[1], "rejected": rows[1]["chosen"]}], tokenizer)
    assert task.stats["pairs"] == 1 and task.stats["skipped_identical"] == 1


def test_long_pairs_are_cut_on_the_right_never_through_the_image(tiny_vlm_dir, colour_rows):
    from twinkle_backend_hf.model import TransformersModel

    tokenizer = TransformersModel.load_tokenizer(str(tiny_vlm_dir("qwen2_5_vl")))
    rows = _pair_rows(colour_rows)[:2]
    whole = VLMPreferenceTask().load_dataset(rows, tokenizer)
    prompt = next(i for i, label in enumerate(whole[0].chosen.labels) if label != IGNORE_INDEX)
    task = VLMPreferenceTask(max_length=prompt + 2)
    features = task.load_dataset(rows, tokenizer)
    assert task.stats["truncated"] == 2

    def trained(sequence):
        return [x for x in sequence.labels if x != IGNORE_INDEX]

    for cut, full in zip(features, whole, strict=True):
        for side in ("chosen", "rejected"):  # the prompt and its image whole, the answer's first two tokens
            assert getattr(cut, side).input_ids == getattr(full, side).input_ids[:prompt + 2]
            assert trained(getattr(cut, side)) == trained(getattr(full, side))[:2]
    with pytest.raises(DataFormatError, match="no usable pair"):  # every pair too long, and skip drops it
        VLMPreferenceTask(max_length=prompt + 2, over_length="skip").load_dataset(rows, tokenizer)
    with pytest.raises(DataFormatError, match="no usable pair"):  # the cut would go through the image
        VLMPreferenceTask(max_length=4).load_dataset(rows, tokenizer)


# ---------------------------------------------------------------------- parity with plain transformers
def _plain_sequence(processor, row, answer):
    """One sequence encoded independently of the task: the processor over the whole chat, labels on the answer up to
    and including its end-of-turn token."""
    image = Image.open(row["messages"][0]["content"][0]["image"]).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    full = processor.apply_chat_template(messages + [{"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                                         tokenize=False)
    inputs = dict(processor(text=[full], images=[image], return_tensors="pt", add_special_tokens=False))
    start = processor(text=[prompt], images=[image], return_tensors="pt", add_special_tokens=False)["input_ids"].shape[1]
    ids = inputs["input_ids"][0].tolist()
    end = ids.index(processor.tokenizer.convert_tokens_to_ids("<|im_end|>"), start)
    labels = torch.full_like(inputs["input_ids"], IGNORE_INDEX)
    labels[0, start:end + 1] = inputs["input_ids"][0, start:end + 1]
    return inputs, labels


def _sequence_logp(network, inputs, labels):
    logits = network(**inputs).logits.float()
    logps = torch.log_softmax(logits[:, :-1], dim=-1)
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    return logps.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)[mask].sum()


def _plain_dpo(policy, reference, processor, rows):
    """The DPO loss written out: mean over pairs of -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))), every log
    probability a sum over one sequence's answer tokens from its own forward."""
    losses, magnitude = [], 0.0
    for row in rows:
        logps = {}
        for side in ("chosen", "rejected"):
            inputs, labels = _plain_sequence(processor, row, row[side])
            with torch.no_grad():
                ref = _sequence_logp(reference, inputs, labels)
            logps[side] = _sequence_logp(policy, inputs, labels) - ref
            magnitude = max(magnitude, float(ref.abs()))
        losses.append(-torch.nn.functional.logsigmoid(BETA * (logps["chosen"] - logps["rejected"])))
    return torch.stack(losses).mean(), magnitude


def test_a_dpo_step_equals_per_sequence_transformers_forwards(tiny_vlm_dir, colour_rows):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir = tiny_vlm_dir("qwen2_5_vl")
    rows = _pair_rows(colour_rows)
    model, task = _model(model_dir, task_options=FULL, reference="model")
    batch = _batch(task, model, rows)
    model.forward_backward(inputs=batch)  # a first step, so the policy differs from the (initial) reference
    model.clip_grad_and_step(None)
    model.module.zero_grad(set_to_none=True)
    loss = float(model.forward_backward(inputs=batch)["loss"])
    grads = {n: p.grad.detach().clone() for n, p in model.module.named_parameters() if p.grad is not None}

    reference = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    policy = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    policy.load_state_dict(model.module.state_dict())
    want, magnitude = _plain_dpo(policy, reference, AutoProcessor.from_pretrained(model_dir), rows)
    want.backward()
    want = float(want.detach())

    text = reference.config.text_config
    width = max(text.vocab_size, text.intermediate_size, text.hidden_size)
    depth = text.num_hidden_layers + reference.config.vision_config.depth
    # four summed log-probs per pair, each within the forward bound; the sigmoid's slope is at most 1
    tolerance = 4 * BETA * forward_tolerance(magnitude, width=width, depth=depth)
    assert abs(loss - want) <= tolerance, (loss, want, tolerance)
    assert 0.0 < abs(loss - math.log(2)), "the step before must have moved the policy away from the reference"
    plain = dict(policy.named_parameters())
    checked = {part_of(n, QWEN) for n in grads}
    assert checked == {"vision", "projector", "language"}
    for name, grad in grads.items():
        expected = plain[name].grad
        bound = forward_tolerance(float(expected.abs().sum()) + 1e-12, width=width, depth=depth)
        assert max_abs_diff(grad, expected) <= bound, name


def test_lora_language_and_frozen_vision_apply(tiny_vlm_dir, colour_rows):
    model, task = _model(tiny_vlm_dir("qwen2_5_vl"), task_options={"train_vision": "frozen"}, adapter=LORA)
    batch = _batch(task, model, _pair_rows(colour_rows))
    out = model.forward_backward(inputs=batch, adapter_name="default")
    # the reference is the base model under the adapter: at the start (LoRA B = 0) it is the policy itself
    assert float(out["loss"]) == pytest.approx(math.log(2), abs=1e-6)
    with_grad = {n for n, p in model.module.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert {part_of(n, QWEN) for n in with_grad} == {"projector", "language"}
    assert all("lora_" in n for n in with_grad if part_of(n, QWEN) == "language")
    assert not any(p.grad is not None for n, p in model.module.named_parameters() if part_of(n, QWEN) == "vision")
