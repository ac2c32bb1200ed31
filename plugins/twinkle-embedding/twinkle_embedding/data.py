"""The embedding data format, its validation, tokenisation and batching.

One JSONL row per query::

    {"query": "how cold are winters in Velmora?",
     "positive": "Velmora: winters bring heavy snow ...",
     "negatives": ["Velmora exports copper ...", "Tarsk: winters are mild ..."],
     "instruction": "Given a question, retrieve the passage that answers it"}

* ``query`` and ``positive``: non-empty strings (one positive per row; write one row per positive).
* ``negatives``: optional list of non-empty strings, any number per row (hard negatives).
* ``instruction``: optional string (or null) put in front of this row's query through the task's
  ``instruction_template``; rows without one use the task option ``instruction`` if set.

Other keys are ignored, except near-misses of these names (``negative``, ``positives``, ``querry``),
which are errors so that a typo does not silently drop a column. A malformed row raises
:class:`~twinkle_core.errors.DataFormatError` naming the file, the line and what is wrong.

A batch (:func:`collate_embedding`) holds the queries first, then, per query, its positive and its
negatives, all padded to one length, plus the layout the loss needs:

* ``embedding_role``: 0 query, 1 positive, 2 negative (one per row);
* ``embedding_owner``: index (in the batch) of the query a row belongs to;
* ``embedding_hash``: a process-independent 63-bit hash of each row's text (duplicate masking).
"""

from __future__ import annotations

import difflib
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

ROLE_QUERY, ROLE_POSITIVE, ROLE_NEGATIVE = 0, 1, 2
KNOWN_KEYS = ("query", "positive", "negatives", "instruction")
#: names that look like a typo of a known key (or an unsupported variant of one)
_UNSUPPORTED = {
    "positives": "one positive per row is supported; write one row per positive",
    "pos": "the positive passage goes under 'positive'",
    "neg": "hard negatives go under 'negatives' (a list)",
    "negative": "hard negatives go under 'negatives' (a list of strings)",
    "anchor": "the query goes under 'query'",
    "question": "the query goes under 'query'",
}


class RowError(ValueError):
    """A row is malformed; the loader turns it into a DataFormatError with the file and line."""


@dataclass
class EmbeddingFeature:
    """One tokenised row. Texts are kept (formatted as they were tokenised) for evaluation and hashing."""

    query: list[int]
    positive: list[int]
    negatives: list[list[int]] = field(default_factory=list)
    query_text: str = ""
    positive_text: str = ""
    negative_texts: list[str] = field(default_factory=list)
    line: int | None = None


def text_hash(text: str) -> int:
    """A 63-bit hash of ``text`` that is the same in every process (``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") >> 1


def _non_empty_string(row: dict[str, Any], key: str) -> str:
    if key not in row or row[key] is None:
        raise RowError(f"missing '{key}' (a non-empty string); the row has keys {sorted(row)}")
    value = row[key]
    if not isinstance(value, str):
        raise RowError(f"'{key}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowError(f"'{key}' is empty")
    return value


def validate_row(row: Any) -> tuple[str, str, list[str], str | None]:
    """``(query, positive, negatives, instruction)`` of a raw row; raises :class:`RowError`."""
    if not isinstance(row, dict):
        raise RowError(f"a row must be a JSON object with 'query' and 'positive', got {type(row).__name__}")
    for key in row:
        if key in KNOWN_KEYS:
            continue
        lowered = str(key).lower()
        if lowered in _UNSUPPORTED:
            raise RowError(f"unsupported key '{key}': {_UNSUPPORTED[lowered]}")
        close = difflib.get_close_matches(lowered, KNOWN_KEYS, n=1, cutoff=0.75)
        if close:
            raise RowError(f"unknown key '{key}'; did you mean '{close[0]}'?")
    query = _non_empty_string(row, "query")
    positive = _non_empty_string(row, "positive")
    negatives = row.get("negatives")
    if negatives is None:
        negatives = []
    if isinstance(negatives, str) or not isinstance(negatives, (list, tuple)):
        raise RowError(f"'negatives' must be a list of strings, got {type(negatives).__name__}")
    for i, negative in enumerate(negatives):
        if not isinstance(negative, str):
            raise RowError(f"'negatives[{i}]' must be a string, got {type(negative).__name__}")
        if not negative.strip():
            raise RowError(f"'negatives[{i}]' is empty")
    instruction = row.get("instruction")
    if instruction is not None and not isinstance(instruction, str):
        raise RowError(f"'instruction' must be a string or null, got {type(instruction).__name__}")
    return query, positive, list(negatives), instruction


def read_rows(path: Any) -> tuple[str, list[tuple[int | None, Any]]]:
    """``(source name, [(line, row), ...])`` from a file (.jsonl/.json/.parquet/.csv) or a list of rows."""
    if isinstance(path, (str, os.PathLike)):
        from twinkle_core.data.loading import load_records

        source = os.fspath(path)
        return source, list(load_records(source, validate=None))
    return "<rows>", [(i + 1, row) for i, row in enumerate(path)]


def pad_batch(sequences: Sequence[Sequence[int]], pad_token_id: int, padding_side: str = "right",
              pad_to_multiple_of: int | None = None) -> tuple[Any, Any]:
    """``(input_ids, attention_mask)`` as ``LongTensor``s, padded on ``padding_side``."""
    import torch

    width = max((len(s) for s in sequences), default=0)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(sequences), width), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        n = len(seq)
        if n == 0:
            continue
        if padding_side == "left":
            input_ids[row, width - n:] = torch.tensor(list(seq), dtype=torch.long)
            attention_mask[row, width - n:] = 1
        else:
            input_ids[row, :n] = torch.tensor(list(seq), dtype=torch.long)
            attention_mask[row, :n] = 1
    return input_ids, attention_mask


def collate_embedding(features: Sequence[EmbeddingFeature], pad_token_id: int, padding_side: str = "right",
                      pad_to_multiple_of: int | None = None) -> dict[str, Any]:
    """One batch: queries, then each query's positive and negatives (see the module docstring)."""
    import torch

    if not features:
        raise ValueError("cannot collate an empty list of features")
    sequences: list[list[int]] = [f.query for f in features]
    roles = [ROLE_QUERY] * len(features)
    owners = list(range(len(features)))
    texts = [f.query_text for f in features]
    for i, f in enumerate(features):
        sequences.append(f.positive)
        roles.append(ROLE_POSITIVE)
        owners.append(i)
        texts.append(f.positive_text)
        for ids, text in zip(f.negatives, f.negative_texts):
            sequences.append(ids)
            roles.append(ROLE_NEGATIVE)
            owners.append(i)
            texts.append(text)
    input_ids, attention_mask = pad_batch(sequences, pad_token_id, padding_side, pad_to_multiple_of)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "embedding_role": torch.tensor(roles, dtype=torch.long),
        "embedding_owner": torch.tensor(owners, dtype=torch.long),
        "embedding_hash": torch.tensor([text_hash(t) for t in texts], dtype=torch.long),
    }
