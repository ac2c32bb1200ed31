"""Reading a preference data set into tokenised pairs fitted into ``max_length``: what every task that trains on
answer pairs (``preference``, ``reward_model``) does with its rows, with the counts of what it cut or dropped."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from twinkle_core.data.formats import RowError
from twinkle_core.data.template import Template
from twinkle_core.errors import ConfigError, DataFormatError
from twinkle_rl.pairs import OVER_LENGTH, PreferenceFeature, encode_pair, is_identical, truncate_pair
from twinkle_rl.rows import read_preference_rows

logger = logging.getLogger("twinkle.rl")


@dataclass(frozen=True)
class LoadedPairs:
    features: list[PreferenceFeature]
    #: pairs kept, truncated, skipped for their length, skipped because both answers are the same (text, or tokens
    #: after truncation)
    stats: dict[str, int]


def no_chat_template(tokenizer: Any, task: str) -> ConfigError:
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return ConfigError(f"the {task} task renders prompts and answers with the tokenizer's chat template, but "
                       f"the tokenizer {name!r} has none; set model.tokenizer to one that has (e.g. the model's "
                       f"instruct/chat version)")


def load_pairs(path: Any, template: Template, *, max_length: int | None, over_length: str) -> LoadedPairs:
    """Read pairs (a .jsonl/.json/.parquet/.csv file, or a list of dicts), render them with ``template`` and fit
    each into ``max_length`` (``over_length``: ``truncate`` with the same cuts on both answers, or ``skip``)."""
    if over_length not in OVER_LENGTH:
        raise ConfigError(f"over_length must be one of {', '.join(OVER_LENGTH)}, got {over_length!r}")
    source, rows, identical = read_preference_rows(path)
    features, truncated, skipped, same_tokens = [], 0, 0, 0
    for row in rows:
        try:
            feature = encode_pair(template, row)
        except RowError as exc:  # TemplateError too: the template cannot locate this row's answers
            raise DataFormatError(source, row.line, str(exc)) from None
        if max_length is not None and feature.longest > max_length:
            if over_length == "skip":
                skipped += 1
                continue
            feature = truncate_pair(feature, max_length)
            truncated += 1
        if is_identical(feature):  # the answers differ only after the cut (or render to the same tokens)
            same_tokens += 1
            continue
        features.append(feature)
    if truncated or skipped:
        logger.warning("%s: %d of %d pairs are longer than max_length=%s: %d truncated (the same cuts on both "
                       "answers), %d skipped (over_length=%s)", source, truncated + skipped, len(rows),
                       max_length, truncated, skipped, over_length)
    if same_tokens:
        logger.warning("%s: skipped %d pairs whose chosen and rejected answers are the same tokens after "
                       "max_length=%s truncation (they differ only beyond it); raise data.max_length to keep "
                       "them", source, same_tokens, max_length)
    if not features:
        reason = (f"every pair is longer than max_length={max_length} and over_length=skip drops them all"
                  if skipped else f"after max_length={max_length} truncation every pair's answers are the same "
                                  f"tokens")
        raise DataFormatError(source, None, f"no usable pair: {reason}; raise data.max_length")
    return LoadedPairs(features, {"pairs": len(features), "truncated": truncated, "skipped_over_length": skipped,
                                  "skipped_identical": identical + same_tokens})
