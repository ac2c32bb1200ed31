"""Rollouts as training tensors: prompt + completion rows, and the order they are trained in.

Row ``s`` of an experience batch is one completion: ``input_ids = prompt_ids + completion_ids`` (right
padded), ``labels`` the completion tokens (the prompt and padding are ``-100``). The per-token tensors
the policy losses read are aligned with the shifted labels (``[S, T - 1]``: position ``t`` holds the value
for the label at ``t + 1``):

* ``old_logps``: the sampler's log-probabilities of the completion tokens (the behaviour policy);
* ``ref_logps``: the reference model's, when a KL term needs them;
* ``advantages``: ``[S]`` per sequence (GRPO family), or ``[S, T - 1]`` per token.

Prompts that carry more than token ids (a vision-language prompt's pictures,
:class:`~twinkle_core.prompt_inputs.PromptInputs`) put them in the batch as a list, one entry per row
(``prompt_inputs``), with the prompts' lengths (``prompt_lengths``); :func:`select_rows` lays a micro-batch's
entries out as model inputs (:func:`~twinkle_core.prompt_inputs.batch_prompt_inputs`: per-token values, the
positions the completion was sampled at, the pictures of its rows), so a queued micro-batch holds tensors only.

Sequence ``s`` of a rollout of ``P`` prompts with ``n`` completions each is completion ``s % n`` of prompt
``s // n``: a group is contiguous and never split by the rollout itself. The advantages are computed over the
whole rollout before it is cut into micro-batches (:func:`micro_batch_order`), so a micro-batch need not hold
whole groups. The order of training shuffles sequences only when a rollout is trained for several epochs or in
several mini-batches, with a permutation that depends on the seed, the rollout and the epoch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_core.prompt_inputs import PromptInputs, batch_prompt_inputs
from twinkle_core.sampling import Completion, sample_seed

#: the batch keys of prompts with model inputs besides their ids (see the module doc)
PROMPT_INPUTS, PROMPT_LENGTHS = "prompt_inputs", "prompt_lengths"


def experience_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Completion], *,
                     pad_token_id: int, train_masks: Sequence[Sequence[bool] | None] | None = None,
                     inputs: Sequence[PromptInputs | None] | None = None) -> dict[str, Any]:
    """Tensors of ``len(completions)`` rows; ``prompts[s]`` is the prompt of ``completions[s]``.

    ``train_masks[s]`` (default: ``completions[s].extra["train_mask"]`` where a completion has one) marks which of
    its tokens are trained: a multi-turn agent rollout's completion holds the environment's tokens too, which get
    no label and an old log-prob of 0 (:mod:`twinkle_rl.agent_rollout`). ``inputs[s]``: the model inputs of
    ``prompts[s]`` besides its ids, or None (see the module doc)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    if train_masks is None:
        train_masks = [c.extra.get("train_mask") for c in completions]
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
            if train_masks[s] is not None:
                _mask_untrained(labels[s, start:end], old_logps[s, start - 1:end - 1], train_masks[s])
    batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                             "old_logps": old_logps}
    if inputs is not None and any(item is not None for item in inputs):
        if len(inputs) != rows:
            raise ValueError(f"{len(inputs)} prompt inputs for {rows} completions")
        batch[PROMPT_INPUTS] = list(inputs)
        batch[PROMPT_LENGTHS] = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    return batch


def _mask_untrained(labels: torch.Tensor, old_logps: torch.Tensor, mask: Sequence[bool]) -> None:
    """Unlabel (in place) the completion tokens whose ``mask`` entry is False."""
    if len(mask) != labels.numel():
        raise ValueError(f"a train mask of {len(mask)} entries for a completion of {labels.numel()} tokens")
    untrained = ~torch.tensor(list(mask), dtype=torch.bool)
    labels[untrained] = IGNORE_INDEX
    old_logps[untrained] = 0.0


def select_rows(batch: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """The rows ``rows`` of every per-sequence entry, trimmed to the longest remaining sequence; prompt inputs
    become the rows' model inputs (see the module doc)."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key == PROMPT_INPUTS:
            continue
        out[key] = value[rows] if isinstance(value, torch.Tensor) and value.dim() >= 1 else value
    width = int(out["attention_mask"].sum(-1).max().item()) if rows.numel() else 1
    width = max(width, 2)
    for key in ("input_ids", "attention_mask", "labels"):
        out[key] = out[key][:, :width]
    for key in ("old_logps", "ref_logps", "advantages", "old_values", "returns"):
        value = out.get(key)
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            out[key] = value[:, :width - 1]
    if PROMPT_INPUTS in batch:
        lengths = out.pop(PROMPT_LENGTHS).tolist()
        chosen = [batch[PROMPT_INPUTS][i] for i in rows.tolist()]
        out.update(batch_prompt_inputs(chosen, starts=[0] * len(chosen), lengths=lengths, width=width))
    return out


def micro_batch_order(num_sequences: int, *, micro_batches: int, epochs: int, shuffle: bool, seed: int,
                      rollout: int) -> list[torch.Tensor]:
    """The rows of each micro-batch, epoch after epoch: each epoch's rows cut into ``micro_batches`` parts of
    (nearly) equal size, so a shorter rollout (the last data batch of an epoch) still makes as many micro-batches
    as a full one; with fewer rows than parts some parts are empty (see :func:`masked_rows`). The losses sum over
    the micro-batches of an optimizer step and divide once, so parts of unequal size train exactly as the whole
    rollout would. Without ``shuffle`` the rollout's order is kept."""
    if micro_batches < 1:
        raise ConfigError(f"a rollout needs at least one micro-batch, got {micro_batches}")
    order: list[torch.Tensor] = []
    for epoch in range(epochs):
        if shuffle:
            generator = torch.Generator().manual_seed(sample_seed(seed, rollout, epoch, -1))
            rows = torch.randperm(num_sequences, generator=generator)
        else:
            rows = torch.arange(num_sequences)
        order.extend(rows.tensor_split(micro_batches))
    return order


def masked_rows(batch: dict[str, Any]) -> dict[str, Any]:
    """A stand-in for an empty micro-batch: the first row with every label masked. It trains nothing (no label
    token, no sequence) but keeps the number of forward / backward passes (and collectives) of every step."""
    out = select_rows(batch, torch.tensor([0]))
    out["labels"] = torch.full_like(out["labels"], IGNORE_INDEX)
    return out


def completion_lengths(completions: Sequence[Completion]) -> torch.Tensor:
    return torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)


__all__ = ["IGNORE_INDEX", "PROMPT_INPUTS", "PROMPT_LENGTHS", "completion_lengths", "experience_batch", "masked_rows", "micro_batch_order",
           "select_rows"]
