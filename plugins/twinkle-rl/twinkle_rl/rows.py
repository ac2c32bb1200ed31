"""Preference rows: reading and validating ``{prompt, chosen, rejected}`` rows (tokenising them is
:mod:`twinkle_rl.pairs`).

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
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from twinkle_core.data.formats import (
    Message,
    RowError,
    normalize_conversation,
)
from twinkle_core.data.loading import load_records
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
    #: the row's ``margin``: how much better the chosen answer is (a reward model's margin loss; TRL's column)
    margin: float | None = None


def _did_you_mean(key: str, row: dict[str, Any]) -> str:
    close = difflib.get_close_matches(key, [str(k) for k in row], n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def prompt_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
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
    prompt = prompt_messages(row)
    chosen, rejected = (_answer_messages(row, key) for key in _ANSWER_KEYS)
    margin = row.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not math.isfinite(margin)):
        raise RowError(f"'margin' must be a finite number, got {margin!r}")
    return PreferenceRow(prompt=prompt, chosen=chosen, rejected=rejected, line=line, tools=row.get("tools"),
                         margin=None if margin is None else float(margin))


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


__all__ = ["ROWS_SOURCE", "PreferenceRow", "parse_row", "prompt_messages", "read_preference_rows"]
