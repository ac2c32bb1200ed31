"""Image preference rows -> encoded answer pairs -> batches in the preference layout (``vlm_preference`` task).

A row is a text preference row (:mod:`twinkle_rl.rows`: ``messages`` / ``prompt``, ``system``, ``chosen``,
``rejected``, ``margin``) whose prompt messages may show images the way the ``vlm`` task's rows do
(:mod:`twinkle_vlm.data`: typed ``{"type": "image", "image": path}`` parts, or ``<image>`` placeholders with an
``images`` list; videos likewise, ``{"type": "video", "video": path}`` parts or ``<video>`` with a ``videos`` list, on
the families that take video: :mod:`twinkle_vlm.videos`)::

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                               {"type": "text", "text": "What colour is the shape?"}]}],
     "chosen": "red", "rejected": "blue"}

Each row becomes two ``vlm`` chats, the prompt followed by either answer, checked and encoded exactly as the ``vlm``
task checks and encodes a chat (:func:`twinkle_vlm.data.parse_row`, :class:`~twinkle_vlm.task.VLMEncoder`): same
labels (answer tokens only), same per-token values, same vision tensors.

Images in a batch are **duplicated**: each of the ``2P`` sequences carries its own copy of its prompt's image
tensors, concatenated in sequence order (:func:`~twinkle_vlm.collate.collate_vlm`), so every row of the batch is an
ordinary VLM sample and a data-parallel split at an even row keeps each pair with its pictures.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from twinkle_rl.pairs import pair_values
from twinkle_rl.rows import ROWS_SOURCE

from twinkle_core.data.formats import RowError
from twinkle_core.data.loading import load_records
from twinkle_core.errors import DataFormatError
from twinkle_vlm.collate import VLMFeature, collate_vlm
from twinkle_vlm.data import VLMDataError, VLMSample, parse_row
from twinkle_vlm.images import DEFAULT_MAX_IMAGE_PIXELS, image_problem
from twinkle_vlm.task import VLMEncoder
from twinkle_vlm.videos import video_problem

logger = logging.getLogger(__name__)

#: the keys of a preference row that are not part of the prompt chat
PAIR_KEYS = ("chosen", "rejected", "margin")


@dataclass(frozen=True)
class VLMPairFeature:
    """One encoded pair: the chosen and the rejected chat (prompt + answer), each a complete VLM sample with its own
    copy of the prompt's image tensors. ``ref_logps`` and ``margin`` as in :class:`twinkle_rl.pairs.PreferenceFeature`
    (what :func:`twinkle_rl.pairs.pair_values` and the precomputed reference read)."""

    chosen: VLMFeature
    rejected: VLMFeature
    line: int = 0
    ref_logps: tuple[float, float] | None = None
    margin: float | None = None

    # the token views the precomputed reference's cache fingerprint reads (twinkle_rl.precompute): the whole
    # sequences stand for the answers, there is no separate prompt
    @property
    def prompt_ids(self) -> list[int]:
        return []

    @property
    def chosen_ids(self) -> list[int]:
        return self.chosen.input_ids

    @property
    def chosen_labels(self) -> list[int]:
        return self.chosen.labels

    @property
    def rejected_ids(self) -> list[int]:
        return self.rejected.input_ids

    @property
    def rejected_labels(self) -> list[int]:
        return self.rejected.labels

    @property
    def longest(self) -> int:
        return max(len(self.chosen.input_ids), len(self.rejected.input_ids))


@dataclass(frozen=True)
class PairSamples:
    """A validated row: the two chats as ``vlm`` samples."""

    chosen: VLMSample
    rejected: VLMSample
    line: int
    margin: float | None = None


def _answer(row: dict[str, Any], key: str) -> list[dict[str, Any]]:
    value = row.get(key)
    if value is None:
        raise RowError(f"row has no {key!r}: a preference row gives the prompt and a 'chosen' and a 'rejected' answer")
    if isinstance(value, str):
        if not value.strip():
            raise RowError(f"{key!r} is empty")
        return [{"role": "assistant", "content": value}]
    if not isinstance(value, list) or not value:
        raise RowError(f"{key!r} must be a string or a non-empty list of messages, got {value!r}")
    first = value[0]
    if not isinstance(first, dict) or first.get("role") != "assistant":
        raise RowError(f"{key!r} must start with an assistant turn (it answers the prompt)")
    return list(value)


def prompt_chat(row: dict[str, Any], answer_keys: tuple[str, ...] = PAIR_KEYS) -> dict[str, Any]:
    """The row less its ``answer_keys``, with a ``prompt`` string turned into one user turn: a ``vlm`` row without
    its final assistant turn (the ``vlm_grpo`` task's prompts are such rows too)."""
    chat = {k: v for k, v in row.items() if k not in answer_keys}
    if chat.get("prompt") is not None:
        if chat.get("messages") is not None or chat.get("conversations") is not None:
            raise RowError("row has both 'prompt' and 'messages': give the prompt one way only")
        prompt = chat.pop("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise RowError(f"'prompt' must be a non-empty string (one user turn), got {prompt!r}")
        chat["messages"] = [{"role": "user", "content": prompt}]
    key = "messages" if chat.get("messages") is not None else "conversations"
    messages = chat.get(key)
    if not isinstance(messages, list) or not messages:
        raise RowError("row has neither 'messages' nor 'prompt' (the prompt chat the answers continue)")
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role", last.get("from")) not in ("user", "human", "tool"):
        raise RowError("the prompt chat must end with a user turn (the answers continue it)")
    return chat


def parse_pair(row: Any, base_dir: str, line: int) -> PairSamples | None:
    """A row -> its two chats (image paths made absolute); None when both answers are the same (a pair that
    teaches nothing). Raises :class:`RowError` naming the reason."""
    if not isinstance(row, dict):
        raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
    prompt = prompt_chat(row)
    chosen, rejected = _answer(row, "chosen"), _answer(row, "rejected")
    margin = row.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not math.isfinite(margin)):
        raise RowError(f"'margin' must be a finite number, got {margin!r}")
    if chosen == rejected:
        return None
    key = "messages" if prompt.get("messages") is not None else "conversations"
    samples = [parse_row({**prompt, key: [*prompt[key], *answer]}, base_dir) for answer in (chosen, rejected)]
    return PairSamples(samples[0], samples[1], line, None if margin is None else float(margin))


def read_pairs(path: str | os.PathLike[str] | Iterable[Any], *, image_root: Any = None,
               max_image_pixels: int | None = None, size_refusal: Any = None) -> tuple[list[PairSamples], int]:
    """``(pairs, number of rows skipped because both answers are the same)`` of a file (.jsonl / .json / .parquet
    / .csv; image paths relative to it) or a list of rows (paths relative to the working directory). Every row and
    image is checked first; all problems are raised together as one :class:`~twinkle_vlm.data.VLMDataError`."""
    if isinstance(path, (str, os.PathLike)):
        source = os.fspath(path)
        records = load_records(source, validate=None)
        base_dir = os.path.dirname(os.path.abspath(source))
    else:
        source, base_dir = ROWS_SOURCE, os.getcwd()
        records = [(i + 1, row) for i, row in enumerate(path)]
    if not records:
        raise DataFormatError(source, None, "no rows were given")
    problems: list[tuple[str, int | None, str]] = []
    pairs: list[PairSamples] = []
    checked: dict[str, str | None] = {}
    identical = 0
    for line, row in records:
        try:
            pair = parse_pair(row, base_dir, line)
        except RowError as exc:
            problems.append((source, line, str(exc)))
            continue
        if pair is None:
            identical += 1
            continue
        for image in dict.fromkeys(pair.chosen.images + pair.rejected.images):
            if image not in checked:
                checked[image] = image_problem(image, root=image_root, max_image_pixels=max_image_pixels,
                                               size_refusal=size_refusal)
            if checked[image] is not None:
                problems.append((source, line, str(checked[image])))
        for clip in pair.chosen.videos:  # the prompt's videos: both chats share them
            key = "\n".join(clip) if isinstance(clip, list) else clip  # a frame list: all its paths
            if key not in checked:
                checked[key] = video_problem(clip, root=image_root, max_image_pixels=max_image_pixels
                                             or DEFAULT_MAX_IMAGE_PIXELS)
            if checked[key] is not None:
                problems.append((source, line, str(checked[key])))
        for sample in (pair.chosen, pair.rejected):
            sample.source, sample.line = source, line
        pairs.append(pair)
    if problems:
        raise VLMDataError(problems)
    if identical:
        logger.warning("%s: skipped %d of %d pairs whose chosen and rejected answers are identical", source, identical,
                       len(records))
    if not pairs:
        raise DataFormatError(source, None, "no usable pair: every row has identical chosen and rejected answers")
    return pairs, identical


@dataclass
class PairEncoder:
    """Encodes pairs with a ``vlm`` encoder; ``cutter`` (the same processor with ``max_length``) re-encodes a pair
    longer than ``max_length`` cut on the right (``over_length: truncate``), which the ``vlm`` encoder refuses
    (``None``) where the cut would go through an image."""

    encoder: VLMEncoder
    cutter: VLMEncoder | None
    over_length: str = "truncate"

    def encode(self, pair: PairSamples) -> tuple[VLMPairFeature | None, str]:
        """The pair's feature and what happened: ``kept``, ``truncated``, ``skipped_over_length`` (too long and
        ``skip``, or the cut would go through an image) or ``skipped_identical`` (the same tokens after the cut)."""
        chosen, rejected = self.encoder.encode(pair.chosen), self.encoder.encode(pair.rejected)
        outcome = "kept"
        limit = None if self.cutter is None else self.cutter.max_length
        if limit is not None and max(len(chosen.input_ids), len(rejected.input_ids)) > limit:
            if self.over_length == "skip":
                return None, "skipped_over_length"
            chosen, rejected = self.cutter.encode(pair.chosen), self.cutter.encode(pair.rejected)
            if chosen is None or rejected is None:
                return None, "skipped_over_length"
            outcome = "truncated"
        if chosen.input_ids == rejected.input_ids and chosen.labels == rejected.labels:
            return None, "skipped_identical"
        return VLMPairFeature(chosen, rejected, line=pair.line or 0, margin=pair.margin), outcome


def collate_vlm_pairs(features: list[VLMPairFeature], pad_token_id: int,
                      pad_to_multiple_of: int | None = None) -> dict[str, Any]:
    """``2P`` padded rows, pair by pair (chosen, then rejected), each with its own copy of its images' tensors
    (concatenated in row order), plus the preference layout (:mod:`twinkle_rl.layout`)."""
    import torch

    if not features:
        raise ValueError("cannot collate an empty list of pairs")
    for feature in features:
        if not isinstance(feature, VLMPairFeature):
            raise TypeError(f"the vlm_preference task collates VLMPairFeature, got {type(feature).__name__}")
    sequences = [s for f in features for s in (f.chosen, f.rejected)]
    batch = collate_vlm(sequences, pad_token_id, pad_to_multiple_of=pad_to_multiple_of)
    batch["pair_index"] = torch.arange(len(features), dtype=torch.long).repeat_interleave(2)
    batch["is_chosen"] = torch.tensor([True, False] * len(features), dtype=torch.bool)
    batch.update(pair_values(features))  # type: ignore[arg-type]  # reads line / ref_logps / margin only
    return batch


__all__ = ["prompt_chat", "PAIR_KEYS", "PairEncoder", "PairSamples", "VLMPairFeature", "collate_vlm_pairs", "parse_pair",
           "read_pairs"]
