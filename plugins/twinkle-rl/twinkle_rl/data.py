"""Preference data: reading and validating ``{prompt, chosen, rejected}`` rows, tokenising each pair
into a :class:`PreferenceFeature`, fitting it into ``max_length``, and collating pairs into batches in
the layout of :mod:`twinkle_rl.layout`.

A row (JSONL line, or a dict in a list handed to the Python API)::

    {"messages": [{"role": "user", "content": "reverse: kdoq"}], "chosen": "qodk", "rejected": "kdoq"}

* the prompt is ``messages`` (a conversation ending with a user or tool turn; ShareGPT ``conversations``
  work too) or ``prompt`` (a plain string: one user turn), never both;
* ``system`` (optional string) is put in front as a system message;
* ``chosen`` / ``rejected``: a string (one assistant turn) or a list of messages (the answer turns:
  assistant turns, with tool results between them, ending with an assistant turn).

Every malformed row raises :class:`~twinkle_core.errors.DataFormatError` naming the file, the line
and the reason, before anything is tokenised; a row whose two answers are identical teaches
nothing and is skipped (and counted).
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from twinkle_core.data.collate import collate_causal_lm
from twinkle_core.data.formats import (
    IGNORE_INDEX,
    InputFeature,
    Message,
    RowError,
    Trajectory,
    normalize_conversation,
)
from twinkle_core.data.loading import load_records
from twinkle_core.data.packing import pack_features
from twinkle_core.data.template import Template, TemplateError
from twinkle_core.errors import DataFormatError

logger = logging.getLogger("twinkle.rl")

#: where rows handed over as a Python list come from, in error messages
ROWS_SOURCE = "<rows>"
_ANSWER_KEYS = ("chosen", "rejected")
_PROMPT_ENDS = ("user", "tool")
_ANSWER_ROLES = ("assistant", "tool")


@dataclass(frozen=True)
class PreferenceRow:
    """One validated pair: the prompt conversation and the two answers, as role/content dicts."""

    prompt: list[dict[str, Any]]
    chosen: list[dict[str, Any]]
    rejected: list[dict[str, Any]]
    line: int
    #: the row's ``tools`` (function schemas), handed to the chat template as SFT rows do
    tools: Any = None


def _did_you_mean(key: str, row: dict[str, Any]) -> str:
    close = difflib.get_close_matches(key, [str(k) for k in row], n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _prompt_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    has_prompt = row.get("prompt") is not None
    has_messages = row.get("messages") is not None or row.get("conversations") is not None
    if has_prompt and has_messages:
        raise RowError("row has both 'prompt' and 'messages': give the prompt one way only")
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise RowError(f"'system' must be a string, got {type(system).__name__}")
    if has_prompt:
        prompt = row["prompt"]
        if not isinstance(prompt, str):
            raise RowError(f"'prompt' must be a string (one user turn), got {type(prompt).__name__}; "
                           "put a conversation in 'messages'")
        if not prompt.strip():
            raise RowError("'prompt' is empty")
        raw = ([{"role": "system", "content": system}] if system is not None else []) + \
              [{"role": "user", "content": prompt}]
    elif has_messages:
        conversation = row.get("messages") if row.get("messages") is not None else row.get("conversations")
        first = conversation[0] if isinstance(conversation, list) and conversation else None
        if system is not None and isinstance(first, dict) and first.get("role") == "system":
            # the core would silently keep one of the two; a pair row is small enough to say so
            raise RowError("row has 'system' and its 'messages' start with a system message: give it once")
        raw, _ = normalize_conversation(row)
    else:
        raise RowError("row has neither 'messages' nor 'prompt'" + _did_you_mean("messages", row)
                       + _did_you_mean("prompt", row))
    messages = [Message.from_dict(m, i).to_dict() for i, m in enumerate(raw)]
    if messages[-1]["role"] not in _PROMPT_ENDS:
        raise RowError(f"the prompt conversation must end with a user turn (the answers continue it), "
                       f"its last message is from {messages[-1]['role']!r}")
    return messages


def _answer_messages(row: dict[str, Any], key: str) -> list[dict[str, Any]]:
    if key not in row or row[key] is None:
        raise RowError(f"row has no {key!r}" + _did_you_mean(key, row))
    value = row[key]
    if isinstance(value, str):
        if not value.strip():
            raise RowError(f"{key!r} is empty")
        return [{"role": "assistant", "content": value}]
    if not isinstance(value, list):
        raise RowError(f"{key!r} must be a string or a list of messages, got {type(value).__name__}")
    if not value:
        raise RowError(f"{key!r} is an empty list")
    messages = []
    for i, raw in enumerate(value):
        try:
            message = Message.from_dict(raw, i).to_dict()
        except RowError as exc:
            raise RowError(f"{key!r}: {exc}") from None
        if message["role"] not in _ANSWER_ROLES:
            raise RowError(f"{key!r} message {i} is from {message['role']!r}; answer turns are assistant turns "
                           "(and tool results between them)")
        messages.append(message)
    if messages[0]["role"] != "assistant":
        raise RowError(f"{key!r} must start with an assistant turn (it answers the prompt), its first message "
                       f"is from {messages[0]['role']!r}")
    if messages[-1]["role"] != "assistant":
        raise RowError(f"{key!r} must end with an assistant turn, its last message is from "
                       f"{messages[-1]['role']!r}")
    if not any(m["content"].strip() for m in messages if m["role"] == "assistant"):
        raise RowError(f"{key!r} is empty (no assistant turn has content)")
    return messages


def parse_row(row: Any, line: int) -> PreferenceRow:
    """Validate one row; raises :class:`RowError` with the reason."""
    if not isinstance(row, dict):
        raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
    prompt = _prompt_messages(row)
    chosen, rejected = (_answer_messages(row, key) for key in _ANSWER_KEYS)
    return PreferenceRow(prompt=prompt, chosen=chosen, rejected=rejected, line=line, tools=row.get("tools"))


def read_preference_rows(path: str | os.PathLike[str] | Iterable[Any]) -> tuple[str, list[PreferenceRow], int]:
    """``(source name, valid pairs, number of skipped identical pairs)`` of a file or a list of rows.

    The whole input is validated first, so a bad row fails before any tokenisation or training.
    """
    if isinstance(path, (str, os.PathLike)):
        source = os.fspath(path)
        # load_records' own check would report a pair row as "an SFT row"; ours are stricter anyway
        records = load_records(source, validate=None)
    else:
        source = ROWS_SOURCE
        records = [(i + 1, row) for i, row in enumerate(path)]
        if not records:
            raise DataFormatError(source, None, "no rows were given")
    pairs, identical = [], 0
    for line, row in records:
        try:
            pair = parse_row(row, line)
        except RowError as exc:
            raise DataFormatError(source, line, str(exc)) from None
        if pair.chosen == pair.rejected:
            identical += 1
            continue
        pairs.append(pair)
    if identical:
        logger.warning("%s: skipped %d of %d pairs whose chosen and rejected answers are identical",
                       source, identical, len(records))
    if not pairs:
        raise DataFormatError(source, None, "no usable pair: every row has identical chosen and rejected answers")
    return source, pairs, identical


# ---------------------------------------------------------------------- tokenised pairs
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
                             line=row.line)


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
    with_reference = [f.ref_logps is not None for f in features]
    if any(with_reference):
        if not all(with_reference):
            raise ValueError("some pairs of the batch carry precomputed ref_logps and others do not; "
                             "precompute them for every pair or for none")
        for feature in features:
            if len(feature.ref_logps) != 2:
                raise ValueError(f"pair of line {feature.line}: ref_logps must be (chosen, rejected), got "
                                 f"{len(feature.ref_logps)} values")
        batch["ref_logps"] = torch.tensor([v for f in features for v in f.ref_logps], dtype=torch.float32)
    return batch


__all__ = [
    "MIN_PROMPT_SHARE",
    "OVER_LENGTH",
    "PreferenceFeature",
    "PreferenceRow",
    "collate_pairs",
    "encode_pair",
    "parse_row",
    "read_preference_rows",
    "truncate_pair",
]
