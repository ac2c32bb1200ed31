"""Rollouts as training tensors: prompt + completion rows, and the order they are trained in.

Row ``s`` of an experience batch is one completion: ``input_ids = prompt_ids + completion_ids`` (right
padded), ``labels`` the completion tokens (the prompt and padding are ``-100``). The per-token tensors
the policy losses read are aligned with the shifted labels (``[S, T - 1]``: position ``t`` holds the value
for the label at ``t + 1``):

* ``old_logps``: the sampler's log-probabilities of the completion tokens (the behaviour policy);
* ``ref_logps``: the reference model's, when a KL term needs them;
* ``advantages``: ``[S]`` per sequence (GRPO family), or ``[S, T - 1]`` per token.

Sequence ``s`` of a rollout of ``P`` prompts with ``n`` completions each is completion ``s % n`` of prompt
``s // n``: a group is contiguous and never split by the rollout itself. The order of training
(:func:`micro_batch_order`) shuffles sequences only when a rollout is trained for several epochs or in
several mini-batches, with a permutation that depends on the seed, the rollout and the epoch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_core.sampling import Completion, sample_seed


def experience_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Completion], *,
                     pad_token_id: int) -> dict[str, torch.Tensor]:
    """Tensors of ``len(completions)`` rows; ``prompts[s]`` is the prompt of ``completions[s]``."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    width = max(len(p) + max(len(c.token_ids), 1) for p, c in zip(prompts, completions, strict=True))
    rows = len(completions)
    input_ids = torch.full((rows, width), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
    old_logps = torch.zeros((rows, width - 1), dtype=torch.float32)
    for s, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        ids = list(prompt) + list(completion.token_ids)
        start, end = len(prompt), len(ids)
        input_ids[s, :end] = torch.tensor(ids, dtype=torch.long)
        attention_mask[s, :end] = 1
        if end > start:
            labels[s, start:end] = input_ids[s, start:end]
            old_logps[s, start - 1:end - 1] = torch.tensor(completion.logprobs, dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "old_logps": old_logps}


def select_rows(batch: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """The rows ``rows`` of every per-sequence entry, trimmed to the longest remaining sequence."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        out[key] = value[rows] if isinstance(value, torch.Tensor) and value.dim() >= 1 else value
    width = int(out["attention_mask"].sum(-1).max().item()) if rows.numel() else 1
    width = max(width, 2)
    for key in ("input_ids", "attention_mask", "labels"):
        out[key] = out[key][:, :width]
    for key in ("old_logps", "ref_logps", "advantages", "old_values", "returns"):
        value = out.get(key)
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            out[key] = value[:, :width - 1]
    return out


def micro_batch_order(num_sequences: int, *, micro_batch_size: int, epochs: int, shuffle: bool, seed: int,
                      rollout: int) -> list[torch.Tensor]:
    """The rows of each micro-batch, epoch after epoch. Without ``shuffle`` the rollout's order is kept."""
    if micro_batch_size < 1 or num_sequences % micro_batch_size:
        raise ConfigError(f"task_options.micro_batch_size={micro_batch_size} must divide the {num_sequences} "
                          f"completions of a rollout (data.batch_size prompts x num_generations)")
    order: list[torch.Tensor] = []
    for epoch in range(epochs):
        if shuffle:
            generator = torch.Generator().manual_seed(sample_seed(seed, rollout, epoch, -1))
            rows = torch.randperm(num_sequences, generator=generator)
        else:
            rows = torch.arange(num_sequences)
        order.extend(rows.split(micro_batch_size))
    return order


def completion_lengths(completions: Sequence[Completion]) -> torch.Tensor:
    return torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)


__all__ = ["IGNORE_INDEX", "completion_lengths", "experience_batch", "micro_batch_order", "select_rows"]
