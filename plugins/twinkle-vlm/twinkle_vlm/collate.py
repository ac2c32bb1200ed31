"""VLM features and their batches.

A :class:`VLMFeature` is one encoded sample (or one packed row of samples): token ids and labels as in the core,
plus what the processor returned besides ``input_ids`` / ``attention_mask``, in two kinds:

* ``token_values``: one value per token (``mm_token_type_ids`` of Qwen, ``token_type_ids`` of Gemma 3), kept as
  lists aligned with ``input_ids``;
* ``vision``: per-image tensors (``pixel_values``, ``image_grid_thw``, ...), the images of the sample stacked on
  dim 0 in order of appearance, exactly as the processor returns them for several images.

:func:`collate_vlm` follows the core's two batch layouts (:mod:`twinkle_core.data.collate`): padded
(``attention_mask``) or packed (``position_ids`` restarting at 0 per sample, no ``attention_mask``). Token values
are padded with 0 (text); vision tensors of all rows are concatenated on dim 0 in row order, which is the order the
model meets the image placeholders in the flattened batch. A batch of text-only rows has no vision keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.data.collate import collate_tokens

#: what a video adds to a feature's ``vision`` (:mod:`twinkle_vlm.videos`); the other keys belong to images
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@dataclass
class VLMFeature:
    input_ids: list[int]
    labels: list[int]
    token_values: dict[str, list[int]] = field(default_factory=dict)
    vision: dict[str, Any] = field(default_factory=dict)
    num_images: int = 0
    #: packed rows only: positions restarting at 0 at every sample
    position_ids: list[int] | None = None
    #: packed rows only: the samples packed into this row, in order (evaluation generates from each alone;
    #: their vision tensors are shared objects, the row holds one concatenated copy)
    parts: tuple[VLMFeature, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.labels) != n or any(len(v) != n for v in self.token_values.values()):
            raise ValueError("labels and per-token values must have one entry per token")

    @property
    def num_trained_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


def concat_vision(features: Sequence[VLMFeature]) -> dict[str, Any]:
    """The vision tensors of ``features`` concatenated on dim 0 (features without images contribute nothing).
    Image and video tensors are separate keys (``pixel_values`` / ``pixel_values_videos``): each is concatenated
    over the features that have it, in order, the order the model meets that modality's placeholders."""
    import torch

    with_images = [f for f in features if f.num_images]
    if with_images:
        keys = set(with_images[0].vision) - set(VIDEO_KEYS)
        for feature in with_images[1:]:
            if set(feature.vision) - set(VIDEO_KEYS) != keys:
                raise ValueError(f"samples disagree on the processor's vision outputs: {sorted(keys)} vs "
                                 f"{sorted(feature.vision)}; were they encoded by different processors?")
    keys = {k for f in features for k in f.vision}
    return {key: torch.cat([f.vision[key] for f in features if key in f.vision], dim=0) for key in sorted(keys)}


def collate_vlm(features: Sequence[VLMFeature], pad_token_id: int, pad_to_multiple_of: int | None = None) -> dict[str, Any]:
    """Right-pad ``features`` into one batch (see the module doc)."""
    import torch

    out = collate_tokens(features, pad_token_id, pad_to_multiple_of)  # the core's text layouts
    shape = out["input_ids"].shape
    for key in sorted({k for f in features for k in f.token_values}):
        values = out[key] = torch.zeros(shape, dtype=torch.long)
        for row, feature in enumerate(features):
            # a text-only row has no per-token values: all text (0)
            if key in feature.token_values:
                values[row, : len(feature.input_ids)] = torch.tensor(feature.token_values[key], dtype=torch.long)
    out.update(concat_vision(features))
    return out


__all__ = ["VIDEO_KEYS", "VLMFeature", "collate_vlm", "concat_vision"]
