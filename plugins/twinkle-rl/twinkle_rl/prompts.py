"""Prompt rows for online RL: what the sampler answers and what the rewards compare against.

A row (JSONL line, or a dict in a list handed to the Python API)::

    {"prompt": "What is 2 + 3?", "answer": "5"}
    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}], "answer": "5"}

* the prompt is ``prompt`` (one user turn) or ``messages`` / ShareGPT ``conversations`` ending with a user
  turn, with an optional ``system`` string, exactly as in preference rows (:mod:`twinkle_rl.rows`);
* it is rendered with the tokenizer's chat template and its generation prompt; a tokenizer without a chat
  template takes ``prompt`` as raw text (``messages`` then need a template);
* every other column (``answer``, ``tests`` ...) is kept and reaches the reward functions as a keyword
  argument, one value per completion.

A prompt longer than ``max_prompt_length`` is skipped or cut from the left (``over_length``), and counted;
every malformed row fails with the file, line and reason before anything is sampled.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from twinkle_core.data.formats import RowError
from twinkle_core.data.loading import load_records
from twinkle_core.data.template import Template
from twinkle_core.errors import ConfigError, DataFormatError
from twinkle_core.prompt_inputs import PromptInputs
from twinkle_rl.rows import ROWS_SOURCE, prompt_messages

logger = logging.getLogger("twinkle.rl")

#: row keys that make the prompt; every other key is a field for the rewards
PROMPT_KEYS = frozenset({"prompt", "messages", "conversations", "system", "tools"})
PROMPT_OVER_LENGTH = ("skip", "truncate_left")


@dataclass(frozen=True)
class PromptFeature:
    """One prompt: its index in the data set (seeds its completions), token ids, text and reward fields; ``inputs``:
    what it hands the model besides its ids (a vision-language prompt's pictures), or None."""

    index: int
    prompt_ids: list[int]
    text: str
    fields: dict[str, Any] = field(default_factory=dict)
    line: int = 0
    inputs: PromptInputs | None = None


def _records(path: Any) -> tuple[str, list[tuple[int, Any]]]:
    if isinstance(path, (str, os.PathLike)):
        source = os.fspath(path)
        return source, load_records(source, validate=None)
    records = [(i + 1, row) for i, row in enumerate(path if isinstance(path, Iterable) else [])]
    if not records:
        raise DataFormatError(ROWS_SOURCE, None, "no rows were given")
    return ROWS_SOURCE, records


def _encode(template: Template | None, tokenizer: Any, row: dict[str, Any]) -> tuple[list[int], str]:
    if template is not None:
        messages = prompt_messages(row)
        text = template.render(messages, add_generation_prompt=True, tools=row.get("tools"))
        return template.encode_prompt(messages, tools=row.get("tools")), text
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RowError("without a chat template a row needs a non-empty 'prompt' string (raw text); 'messages' "
                       "need a tokenizer with a chat template")
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"]), prompt


def read_prompts(path: Any, tokenizer: Any, *, max_prompt_length: int | None = None,
                 over_length: str = "skip", use_chat_template: bool | None = None) -> tuple[list[PromptFeature],
                                                                                            dict[str, int]]:
    """``(features, counts)`` of a prompt file (.jsonl/.json/.parquet/.csv) or a list of rows."""
    if over_length not in PROMPT_OVER_LENGTH:
        raise ConfigError(f"task_options.prompt_over_length must be one of {', '.join(PROMPT_OVER_LENGTH)}, "
                          f"got {over_length!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template and not has_template:
        raise ConfigError("task_options.chat_template: true, but the tokenizer has no chat template; set "
                          "model.tokenizer to one that has, or chat_template: false for raw-text prompts")
    template = Template(tokenizer, mode="chat") if (has_template if use_chat_template is None
                                                    else use_chat_template) else None
    source, records = _records(path)
    features: list[PromptFeature] = []
    skipped = truncated = 0
    for line, row in records:
        try:
            if not isinstance(row, dict):
                raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
            ids, text = _encode(template, tokenizer, row)
        except RowError as exc:
            raise DataFormatError(source, line, str(exc)) from None
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            if over_length == "skip":
                skipped += 1
                continue
            ids, truncated = ids[-max_prompt_length:], truncated + 1
        fields = {k: v for k, v in row.items() if k not in PROMPT_KEYS}
        features.append(PromptFeature(index=len(features), prompt_ids=ids, text=text, fields=fields, line=line))
    if skipped or truncated:
        logger.warning("%s: %d of %d prompts are longer than max_prompt_length=%s: %d skipped, %d cut from the "
                       "left (prompt_over_length=%s)", source, skipped + truncated, len(records), max_prompt_length,
                       skipped, truncated, over_length)
    if not features:
        raise DataFormatError(source, None, f"every prompt is longer than max_prompt_length={max_prompt_length}; "
                                            f"raise it or set prompt_over_length: truncate_left")
    return features, {"prompts": len(features), "skipped_over_length": skipped, "truncated": truncated}


def collate_prompts(features: list[PromptFeature]) -> dict[str, Any]:
    """A batch of prompts: nothing is padded here, the sampler pads for decoding."""
    import torch

    return {"prompt_index": torch.tensor([f.index for f in features], dtype=torch.long),
            "prompts": list(features)}


__all__ = ["PROMPT_OVER_LENGTH", "PromptFeature", "collate_prompts", "read_prompts"]
