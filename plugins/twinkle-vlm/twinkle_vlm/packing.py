"""Padding-free packing of VLM samples, and Qwen's 3-D multimodal RoPE positions for a batch.

Packing concatenates samples into rows of at most ``max_length`` tokens (first fit, longest first, as the core's
:func:`~twinkle_core.data.packing.pack_features`), with text positions restarting at 0 per sample and the first
label of each sample ignored; the images of a row are stacked in the order of its samples. Attention stays inside
each sample the way the core's packed text batches do it: the HF backend passes ``position_ids`` without an
attention mask and transformers builds the block-diagonal causal mask from the position resets.

Qwen-VL models place image tokens on a (temporal, height, width) grid: their RoPE positions are 3-D and only
the model's own ``get_rope_index`` computes them. :func:`multimodal_position_ids` calls it once per sample of a
packed row (so every sample starts at position 0, as it would alone) and stacks the text positions on top, the
``[4, batch, seq]`` layout Qwen-VL models read as "packed: build the mask from row 0, rotate with rows 1-3".
For a padded batch it calls it once on the whole batch with the attention mask (``[3, batch, seq]``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from twinkle_core.data.formats import IGNORE_INDEX
from twinkle_vlm.collate import VLMFeature, concat_vision

logger = logging.getLogger(__name__)

#: the per-token value that marks image tokens (``mm_token_type_ids``: text 0, image 1, video 2)
TOKEN_TYPES_KEY = "mm_token_type_ids"


def _pack_group(group: Sequence[VLMFeature]) -> VLMFeature:
    input_ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    keys = sorted({k for f in group for k in f.token_values})
    token_values: dict[str, list[int]] = {k: [] for k in keys}
    for feature in group:
        n = len(feature.input_ids)
        input_ids += feature.input_ids
        labels += [IGNORE_INDEX, *feature.labels[1:]]  # nothing predicts a sample's first token from the previous
        positions += range(n)
        for key in keys:
            token_values[key] += feature.token_values.get(key, [0] * n)
    return VLMFeature(input_ids=input_ids, labels=labels, token_values=token_values, vision=concat_vision(group),
                      num_images=sum(f.num_images for f in group), position_ids=positions,
                      parts=tuple(group))


def pack_vlm_features(features: Sequence[VLMFeature], max_length: int) -> list[VLMFeature]:
    """Pack ``features`` into rows of at most ``max_length`` tokens (deterministic first fit decreasing)."""
    order = sorted(range(len(features)), key=lambda i: (-len(features[i].input_ids), i))
    bins: list[list[VLMFeature]] = []
    room: list[int] = []
    for index in order:
        feature = features[index]
        n = len(feature.input_ids)
        if feature.position_ids is not None:
            raise ValueError(f"feature {index} is already packed")
        if n > max_length:
            raise ValueError(f"feature {index} has {n} tokens, more than the packing max_length={max_length}")
        target = next((b for b, free in enumerate(room) if free >= n), None)
        if target is None:
            bins.append([])
            room.append(max_length)
            target = len(bins) - 1
        bins[target].append(feature)
        room[target] -= n
    return [_pack_group(group) for group in bins]


def _image_runs(token_types: Any, kind: int | None = None) -> int:
    """How many images a stretch of ``mm_token_type_ids`` holds (each image is one run of non-zero types);
    ``kind``: count only the runs of that type (1: images, 2: videos)."""
    import torch

    marked = (token_types != 0).long() if kind is None else (token_types == kind).long()
    starts = marked[1:] > marked[:-1]
    return int(marked[:1].sum()) + int(torch.count_nonzero(starts))


def _video_token_counts(grids: Any, token_types: Any) -> list[int]:
    """How many tokens each video of a batch has: ``t * h * w / merge_size**2``, the merge read off the batch (all its
    video tokens over all its grid cells; truncation never cuts a video). A video is one run of tokens (Qwen2-VL) or
    one run per temporal patch (Qwen3-VL), so its tokens, not its runs, say where it ends."""
    cells = [int(grid.prod()) for grid in grids]
    merge = sum(cells) // max(1, int((token_types == 2).sum()))
    return [c // max(1, merge) for c in cells]


def _videos_in(tokens: int, counts: Sequence[int]) -> int:
    """How many of the next videos (of ``counts`` tokens each) make up ``tokens`` video tokens."""
    taken = 0
    while tokens > 0 and taken < len(counts):
        tokens -= counts[taken]
        taken += 1
    return taken


def _segments(text_positions: Any) -> list[tuple[int, int]]:
    starts = [int(i) for i in (text_positions == 0).nonzero().flatten()] or [0]
    if starts[0] != 0:
        starts.insert(0, 0)
    return list(zip(starts, [*starts[1:], len(text_positions)], strict=True))


def multimodal_position_ids(rope_index: Callable[..., Any], batch: dict[str, Any]) -> Any:
    """The 3-D RoPE positions of ``batch`` from the model's ``get_rope_index`` (see the module doc)."""
    import torch

    input_ids = batch["input_ids"]
    token_types = batch.get(TOKEN_TYPES_KEY)
    if token_types is None:
        token_types = torch.zeros_like(input_ids)
    grids = batch.get("image_grid_thw")
    video_grids, seconds = batch.get("video_grid_thw"), batch.get("second_per_grid_ts")
    # videos (twinkle_vlm.videos) only where the batch has them: Qwen2.5-VL alone takes second_per_grid_ts
    video = {"video_grid_thw": video_grids} if video_grids is not None else {}
    if seconds is not None:
        video["second_per_grid_ts"] = seconds
    if batch.get("attention_mask") is not None:  # padded: one call, padding skipped through the mask
        positions, _ = rope_index(input_ids=input_ids, mm_token_type_ids=token_types, image_grid_thw=grids,
                                  attention_mask=batch["attention_mask"], **video)
        return positions
    text = batch["position_ids"]
    video_tokens = _video_token_counts(video_grids, token_types) if video else []
    rows = []
    used = used_videos = 0  # images (videos) are stacked in row-major sample order, the order of the placeholders
    for row in range(input_ids.shape[0]):
        parts = []
        for start, end in _segments(text[row]):
            count = _image_runs(token_types[row, start:end], 1 if video else None)
            own = grids[used:used + count] if count else None
            used += count
            own_video = {}
            if video:
                videos = _videos_in(int((token_types[row, start:end] == 2).sum()), video_tokens[used_videos:])
                own_video = {k: v[used_videos:used_videos + videos] for k, v in video.items()} if videos else {}
                used_videos += videos
            positions, _ = rope_index(input_ids=input_ids[row:row + 1, start:end],
                                      mm_token_type_ids=token_types[row:row + 1, start:end], image_grid_thw=own,
                                      **own_video)
            parts.append(positions[:, 0])
        rows.append(torch.cat(parts, dim=1))
    spatial = torch.stack(rows, dim=1)
    return torch.cat([text[None].to(spatial.dtype), spatial], dim=0)


def find_rope_index(network: Any) -> Callable[..., Any] | None:
    """The ``get_rope_index`` of a transformers VLM (on the model or its inner ``model``), or None for models
    with 1-D positions (InternVL, Gemma 3)."""
    for candidate in (network, getattr(network, "model", None)):
        method = getattr(candidate, "get_rope_index", None)
        if callable(method):
            return method
    return None


__all__ = ["TOKEN_TYPES_KEY", "find_rope_index", "multimodal_position_ids", "pack_vlm_features"]
