"""Tokenised preference pairs: a validated row (:mod:`twinkle_rl.rows`) through the chat template into a
:class:`PreferenceFeature`, fitted into ``max_length``, and pairs collated into batches in the layout of
:mod:`twinkle_rl.layout`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from twinkle_core.data.collate import collate_causal_lm
from twinkle_core.data.formats import IGNORE_INDEX, InputFeature, Trajectory
from twinkle_core.data.packing import pack_features
from twinkle_core.data.template import Template, TemplateError
from twinkle_rl.rows import PreferenceRow

#: what happens to a pair longer than ``max_length``
OVER_LENGTH = ("truncate", "skip")
#: a truncated prompt keeps at least this share of ``max_length`` (when it is that long): cutting the prompt
#: to nothing to fit long answers would train answers to a question the model no longer sees
MIN_PROMPT_SHARE = 0.5


@dataclass(frozen=True)
class PreferenceFeature:
    """One tokenised pair. Both sequences are ``prompt_ids + <answer>_ids``; the answer labels are aligned
    with the answer ids (-100 on tokens not trained: tool results, the template's text after end-of-turn).

    ``ref_logps``: optional precomputed reference log-probabilities ``(chosen, rejected)``."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    chosen_labels: list[int]
    rejected_ids: list[int]
    rejected_labels: list[int]
    line: int = 0
    ref_logps: tuple[float, float] | None = None
    #: the row's margin (how much better the chosen answer is), for a reward model's margin loss
    margin: float | None = None

    @property
    def longest(self) -> int:
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))

    def sequences(self) -> tuple[InputFeature, InputFeature]:
        """The chosen and the rejected sequence, labelled on answer tokens only."""
        prompt_labels = [IGNORE_INDEX] * len(self.prompt_ids)
        out = []
        for ids, labels in ((self.chosen_ids, self.chosen_labels), (self.rejected_ids, self.rejected_labels)):
            sequence_labels = prompt_labels + list(labels)
            sequence_labels[0] = IGNORE_INDEX  # nothing predicts the first token
            out.append(InputFeature(input_ids=list(self.prompt_ids) + list(ids), labels=sequence_labels))
        return out[0], out[1]


def _tokenize(tokenizer: Any, text: str) -> list[int]:
    # segment by segment without automatic special tokens, as the core's Template does, so label spans
    # fall on token boundaries and the prompt is tokenised exactly as at inference time
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _encode_answer(template: Template, row: PreferenceRow, prompt_text: str,
                   answer: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """Tokens and labels of ``answer`` as the continuation of the rendered prompt."""
    trajectory = Trajectory.from_dict({"messages": row.prompt + answer}, require_assistant_last=True)
    if row.tools is not None:
        trajectory.extra["tools"] = row.tools
    full, spans = template.assistant_spans(trajectory)  # checks the template is prefix-stable
    if not full.startswith(prompt_text):
        raise TemplateError("the chat template renders the prompt differently once an answer follows it; "
                            "the answer cannot be located (pass a prefix-stable chat template)")
    ids: list[int] = []
    labels: list[int] = []
    cursor = len(prompt_text)
    for start, end in spans:
        if end <= len(prompt_text):  # an assistant turn of the prompt conversation: context, not trained
            continue
        context = _tokenize(template.tokenizer, full[cursor:start])
        tokens = _tokenize(template.tokenizer, full[start:end])
        # train up to and including the turn's last end-of-turn token (as SFT does), not the text after it
        cut = next((j + 1 for j in range(len(tokens) - 1, -1, -1) if tokens[j] in template.end_of_turn_ids),
                   len(tokens))
        ids += context + tokens
        labels += [IGNORE_INDEX] * len(context) + tokens[:cut] + [IGNORE_INDEX] * (len(tokens) - cut)
        cursor = end
    tail = _tokenize(template.tokenizer, full[cursor:])
    return ids + tail, labels + [IGNORE_INDEX] * len(tail)


def encode_pair(template: Template, row: PreferenceRow) -> PreferenceFeature:
    """Tokenise the prompt once (with the generation prompt) and each answer as its continuation."""
    prompt_text = template.render(row.prompt, add_generation_prompt=True, tools=row.tools)
    chosen = _encode_answer(template, row, prompt_text, row.chosen)
    rejected = _encode_answer(template, row, prompt_text, row.rejected)
    return PreferenceFeature(prompt_ids=_tokenize(template.tokenizer, prompt_text), chosen_ids=chosen[0],
                             chosen_labels=chosen[1], rejected_ids=rejected[0], rejected_labels=rejected[1],
                             line=row.line, margin=row.margin)


def truncate_pair(feature: PreferenceFeature, max_length: int) -> PreferenceFeature:
    """Fit both sequences of a pair into ``max_length`` with the same cuts on both sides.

    The shared prompt loses tokens from its start (keeping its end, the turn being answered) down to
    ``MIN_PROMPT_SHARE`` of ``max_length``; if that is not enough, both answers are cut to the same
    length from their ends. Every answer keeps at least one trained token."""
    if feature.longest <= max_length:
        return feature
    prompt_length = len(feature.prompt_ids)
    answer_length = max(len(feature.chosen_ids), len(feature.rejected_ids))
    keep_prompt = max(min(prompt_length, max(1, int(max_length * MIN_PROMPT_SHARE))), max_length - answer_length)
    keep_answer = max_length - keep_prompt
    return replace(feature, prompt_ids=feature.prompt_ids[prompt_length - keep_prompt:],
                   chosen_ids=feature.chosen_ids[:keep_answer], chosen_labels=feature.chosen_labels[:keep_answer],
                   rejected_ids=feature.rejected_ids[:keep_answer],
                   rejected_labels=feature.rejected_labels[:keep_answer])


def is_identical(feature: PreferenceFeature) -> bool:
    """Whether both answers are the same tokens with the same labels: such a pair teaches nothing (its DPO
    margin is 0 whatever the model), like a row whose two answers are the same text (:mod:`twinkle_rl.rows`)."""
    return feature.chosen_ids == feature.rejected_ids and feature.chosen_labels == feature.rejected_labels


# ---------------------------------------------------------------------- batches
def collate_pairs(features: list[PreferenceFeature], pad_token_id: int, *, packing: bool = False,
                  pad_to_multiple_of: int | None = None) -> dict[str, Any]:
    """A batch of ``2 * len(features)`` sequences, pair by pair (chosen, then rejected).

    Padded: one right-padded row per sequence, with ``attention_mask``. Packed: every sequence in one
    row with ``position_ids`` restarting per sequence and ``sequence_index`` (-1 on padding), built by
    the core's packing so backends see their usual padding-free batch."""
    import torch

    if not features:
        raise ValueError("cannot collate an empty list of pairs")
    for feature in features:
        if not isinstance(feature, PreferenceFeature):
            raise TypeError(f"the preference task collates PreferenceFeature, got {type(feature).__name__}")
    sequences = [sequence for feature in features for sequence in feature.sequences()]
    if packing:
        total = sum(len(s) for s in sequences)
        rows = pack_features(sequences, total, strategy="sequential")  # one row, order kept
        batch = collate_causal_lm(rows, pad_token_id, pad_to_multiple_of=pad_to_multiple_of)
        sequence_index = torch.full_like(batch["input_ids"], -1)
        start = 0
        for index, sequence in enumerate(sequences):
            sequence_index[0, start:start + len(sequence)] = index
            start += len(sequence)
        batch["sequence_index"] = sequence_index
    else:
        batch = collate_causal_lm(sequences, pad_token_id, pad_to_multiple_of=pad_to_multiple_of)
    batch["pair_index"] = torch.arange(len(features), dtype=torch.long).repeat_interleave(2)
    batch["is_chosen"] = torch.tensor([True, False] * len(features), dtype=torch.bool)
    batch.update(pair_values(features))
    return batch



def pair_values(features: list[PreferenceFeature]) -> dict[str, Any]:
    """The optional per-pair values of a batch, one entry per sequence (both of a pair's) so that a batch splits
    by rows: ``ref_logps`` (precomputed reference log-probs) and ``margin``; each is given for every pair or none."""
    import torch

    values: dict[str, Any] = {}
    with_reference = [f.ref_logps is not None for f in features]
    if any(with_reference):
        if not all(with_reference):
            raise ValueError("some pairs of the batch carry precomputed ref_logps and others do not; "
                             "precompute them for every pair or for none")
        for feature in features:
            if len(feature.ref_logps) != 2:
                raise ValueError(f"pair of line {feature.line}: ref_logps must be (chosen, rejected), got "
                                 f"{len(feature.ref_logps)} values")
        values["ref_logps"] = torch.tensor([v for f in features for v in f.ref_logps], dtype=torch.float32)
    with_margin = [f.margin is not None for f in features]
    if any(with_margin):
        if not all(with_margin):
            lines = [f.line for f in features if f.margin is None][:5]
            raise ValueError(f"some pairs of the batch have a margin and others (lines {lines}) do not; give every "
                             f"row a margin or none")
        values["margin"] = torch.tensor([f.margin for f in features], dtype=torch.float32).repeat_interleave(2)
    return values


__all__ = [
    "MIN_PROMPT_SHARE",
    "OVER_LENGTH",
    "PreferenceFeature",
    "collate_pairs",
    "encode_pair",
    "is_identical",
    "pair_values",
    "truncate_pair",
]
