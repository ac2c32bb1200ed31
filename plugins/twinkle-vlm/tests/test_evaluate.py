"""Held-out answer accuracy: greedy answers with the images, exact match (stripped, lower-cased)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoProcessor
from twinkle_vlm.testing import build_vlm_model


def _plain_transformers_answers(model_dir, hf_model, rows, max_new_tokens):
    """What plain transformers answers to each row's question: the reference behaviour we must match."""
    from PIL import Image

    processor = AutoProcessor.from_pretrained(model_dir)
    answers = []
    for row in rows:
        question = [{"role": "user", "content": [{"type": "image"}, row["messages"][0]["content"][1]]}]
        text = processor.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
        image = Image.open(row["messages"][0]["content"][0]["image"]).convert("RGB")
        inputs = processor(text=[text], images=[image], return_tensors="pt")
        with torch.no_grad():
            out = hf_model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                                    eos_token_id=processor.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        answers.append(processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    return answers


def _with_answers(rows, answers):
    rows = copy.deepcopy(rows)
    for row, answer in zip(rows, answers, strict=True):
        row["messages"][-1]["content"] = answer
    return rows


@pytest.fixture(scope="module")
def model_and_task(tiny_vlm_dir):
    model_dir = tiny_vlm_dir("qwen2_5_vl")
    model, task = build_vlm_model(model_dir, task_options={"train_language": "full"})
    return model_dir, model, task


def test_answer_accuracy_counts_exact_answers(model_and_task, colour_rows):
    model_dir, model, task = model_and_task
    answers = _plain_transformers_answers(model_dir, model.hf_model, colour_rows, max_new_tokens=6)
    # half the references are the model's own answers (upper-cased and padded: still exact), half are not
    references = [f"  {a.upper()} " if i % 2 == 0 else "certainly not this" for i, a in enumerate(answers)]
    assert all(a.strip().lower() != "certainly not this" for a in answers)
    rows = _with_answers(colour_rows, references)
    result = task.evaluate(model, rows, model.tokenizer, max_new_tokens=6)
    assert result == {"answer_accuracy": 0.5, "num_examples": 4}
    assert task.evaluate(model, rows, model.tokenizer, max_new_tokens=6, limit=1)["answer_accuracy"] == 1.0


def test_packed_held_out_sets_are_evaluated_sample_by_sample(model_and_task, colour_rows):
    model_dir, model, task = model_and_task
    answers = _plain_transformers_answers(model_dir, model.hf_model, colour_rows, max_new_tokens=6)
    features = task.load_dataset(_with_answers(colour_rows, answers), model.tokenizer, packing=True, max_length=512)
    assert len(features) < len(colour_rows)  # really packed
    assert task.evaluate(model, features, model.tokenizer, max_new_tokens=6) == {"answer_accuracy": 1.0,
                                                                                  "num_examples": 4}


def test_training_on_the_images_makes_the_answers_right(tiny_vlm_dir, colour_rows):
    """End to end: the four questions are the same text, only the image tells the colour; after a few dozen
    packed steps the held-out accuracy (here: the training rows) goes from 0 to 1."""
    model, task = build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), task_options={"train_language": "full"})
    model.set_optimizer("AdamW", lr=3e-3)
    features = task.load_dataset(colour_rows, model.tokenizer, packing=True, max_length=512)
    assert task.evaluate(model, colour_rows, model.tokenizer, max_new_tokens=4)["answer_accuracy"] == 0.0
    batch = task.prepare_batch(model, task.collate(features))
    for _ in range(40):
        model.forward_backward(inputs=batch)
        model.step()
        model.zero_grad()
    assert task.evaluate(model, colour_rows, model.tokenizer, max_new_tokens=4)["answer_accuracy"] == 1.0
