"""Held-out answer accuracy of a VLM: greedy answers to the held-out questions, with their images.

For every held-out sample the prompt is everything before its last trained span (the last assistant turn,
with all the sample's images: they sit in earlier user turns) and the reference is that turn's text. The answer
is generated greedily through the model's ``generation_module`` seam (the network in evaluation mode, with the
active adapter) by transformers' own ``generate``, which is what computes each family's image features and
multimodal positions (and Qwen's RoPE offsets while decoding). A sample counts as correct when the stripped,
lower-cased answer equals the stripped, lower-cased reference.

Questions are generated in left-padded batches of ``batch_size`` (the attention mask keeps padding out of
attention and out of Qwen's multimodal positions). Every rank evaluates every sample with the same weights, so greedy decoding takes the same number of steps
everywhere (what a sharded model, whose every forward is collective, needs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twinkle_core.data.formats import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_vlm.collate import VLMFeature, concat_vision


def _last_trained_span(labels: Sequence[int]) -> tuple[int, int] | None:
    end = len(labels)
    while end and labels[end - 1] == IGNORE_INDEX:
        end -= 1
    if not end:
        return None
    start = end
    while start and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return start, end


def unpacked(features: Sequence[VLMFeature]) -> list[VLMFeature]:
    """The samples of ``features``, packed rows split back into the samples they hold."""
    return [part for feature in features for part in (feature.parts or (feature,))]


def question_and_answer(feature: VLMFeature, encoder: Any) -> tuple[VLMFeature, str] | None:
    """``(the question: the sample up to its last trained span, reference answer)``, or None without one."""
    span = _last_trained_span(feature.labels)
    if span is None:
        return None
    start, end = span
    answer = [t for t in feature.input_ids[start:end] if t not in encoder.end_of_turn_ids]
    question = VLMFeature(feature.input_ids[:start], [IGNORE_INDEX] * start,
                          {k: v[:start] for k, v in feature.token_values.items()}, feature.vision, feature.num_images)
    return question, encoder.processor.tokenizer.decode(answer, skip_special_tokens=True)


def left_padded(questions: Sequence[VLMFeature], pad_token_id: int) -> dict[str, Any]:
    """One generation batch: questions left-padded (generation appends on the right), their images stacked."""
    import torch

    width = max(len(q.input_ids) for q in questions)
    batch = {"input_ids": torch.full((len(questions), width), int(pad_token_id), dtype=torch.long),
             "attention_mask": torch.zeros((len(questions), width), dtype=torch.long)}
    keys = sorted({k for q in questions for k in q.token_values})
    batch.update({k: torch.zeros((len(questions), width), dtype=torch.long) for k in keys})
    for row, question in enumerate(questions):
        n = len(question.input_ids)
        batch["input_ids"][row, width - n:] = torch.tensor(question.input_ids, dtype=torch.long)
        batch["attention_mask"][row, width - n:] = 1
        for key in keys:
            if key in question.token_values:
                batch[key][row, width - n:] = torch.tensor(question.token_values[key], dtype=torch.long)
    batch.update(concat_vision(questions))
    return batch


def _normalise(text: str) -> str:
    return text.strip().lower()


def answer_accuracy(model: Any, features: Sequence[VLMFeature], encoder: Any, *, max_new_tokens: int = 16,
                    limit: int | None = None, batch_size: int = 8, adapter_name: str | None = None) -> dict[str, float]:
    """``answer_accuracy`` (exact match, see the module doc) and ``num_examples`` over ``features``."""
    examples = [pair for pair in (question_and_answer(f, encoder) for f in unpacked(features)) if pair is not None]
    if limit is not None:
        examples = examples[: int(limit)]
    if not examples:
        return {"answer_accuracy": 0.0, "num_examples": 0}
    if not hasattr(model, "generation_module"):
        raise ConfigError(f"{type(model).__name__} cannot lend its network for generation; the vlm task's "
                          "answer accuracy needs a model with generation_module() (the HF backend)")
    if int(batch_size) < 1:
        raise ConfigError(f"evaluate_options.batch_size must be positive, got {batch_size}")
    tokenizer = encoder.processor.tokenizer
    stop = sorted(encoder.end_of_turn_ids)
    correct = 0
    with model.generation_module(adapter_name=adapter_name) as gen:
        for begin in range(0, len(examples), int(batch_size)):
            chunk = examples[begin:begin + int(batch_size)]
            inputs = {k: v.to(gen.device) for k, v in left_padded([q for q, _ in chunk], encoder.pad_token_id).items()}
            output = gen.module.generate(**inputs, max_new_tokens=int(max_new_tokens), do_sample=False,
                                         use_cache=True, eos_token_id=stop, pad_token_id=encoder.pad_token_id)
            for generated, (_, reference) in zip(output[:, inputs["input_ids"].shape[1]:].tolist(), chunk, strict=True):
                text = tokenizer.decode([t for t in generated if t not in stop], skip_special_tokens=True)
                correct += int(_normalise(text) == _normalise(reference))
    return {"answer_accuracy": correct / len(examples), "num_examples": len(examples)}


__all__ = ["answer_accuracy", "left_padded", "question_and_answer", "unpacked"]
