"""Distillation batches: a chat's last assistant answer as the completion of everything before it.

A row of SFT data (``messages`` ending with an assistant turn) is tokenised by the chat template
(:class:`~twinkle_core.data.template.Template`), which labels every assistant turn. For distillation the
completion is the last labelled span (the last answer, up to and including its end-of-turn token) and the
prompt is every token before it (the earlier turns and the generation prompt), so a sampled completion of
that prompt and the data's own answer make rows of the same layout: ``input_ids = prompt + completion``
(right padded), ``labels`` on the completion only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.sampling import Completion
from twinkle_core.tasks.causal_lm import last_labelled_span
from twinkle_rl.experience import experience_batch


def split_feature(feature: Any) -> tuple[list[int], list[int]]:
    """``(prompt_ids, answer_ids)`` of a tokenised chat (an ``InputFeature``) with at least one labelled token."""
    span = last_labelled_span(feature.labels)
    if span is None:
        raise ValueError("the feature has no labelled answer")
    start, end = span
    return list(feature.input_ids[:start]), list(feature.input_ids[start:end])


def completion_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *,
                     pad_token_id: int) -> dict[str, torch.Tensor]:
    """``input_ids`` / ``attention_mask`` / ``labels`` of ``prompts[s] + completions[s]``, labels on the completion."""
    rows = [Completion(token_ids=list(ids), logprobs=[0.0] * len(ids), finish_reason="stop") for ids in completions]
    batch = experience_batch(prompts, rows, pad_token_id=pad_token_id)
    batch.pop("old_logps")  # no behaviour policy: the teacher's logits are the target
    return batch


def batch_prompts(batch: dict[str, Any]) -> list[list[int]]:
    """The prompt of every row of a :func:`completion_batch`: the tokens before its first label."""
    labels, input_ids = batch["labels"], batch["input_ids"]
    prompts = []
    for s in range(labels.shape[0]):
        labelled = (labels[s] != IGNORE_INDEX).nonzero(as_tuple=True)[0]
        if not labelled.numel():
            raise ValueError(f"row {s} of the batch has no labelled completion")
        prompts.append(input_ids[s, : int(labelled[0])].tolist())
    return prompts


__all__ = ["batch_prompts", "completion_batch", "split_feature"]
