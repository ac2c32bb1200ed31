"""Batch features into tensors for causal language modelling.

Two layouts, told apart by the keys of the batch (backends must follow this contract):

* **padded** (no feature has ``position_ids``): ``input_ids``, ``labels`` and ``attention_mask``
  (1 = real token, 0 = right padding), all ``[batch, seq]`` int64. The backend passes
  ``attention_mask`` to the model.
* **packed / padding-free** (features from :func:`~twinkle_core.data.packing.pack_features`):
  ``input_ids``, ``labels`` and ``position_ids``, and **no** ``attention_mask``. Each row is made
  of real sequences whose positions restart at 0; sequence boundaries are where ``position_ids``
  does not increase by one (``position_ids == 0`` marks each start). The right padding of a row
  continues the positions of its last sequence, so it is attached to that sequence (it comes last,
  so nothing real attends to it) and its labels are -100. The backend passes ``position_ids``
  without an attention mask (HF transformers then builds the block-diagonal causal mask itself;
  use ``use_cache=False``), or derives ``cu_seqlens`` for varlen flash attention from the resets.

``labels`` are aligned with ``input_ids`` (not shifted) and -100 wherever no loss is wanted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from twinkle_core.data.formats import IGNORE_INDEX, InputFeature


def _as_feature(feature: Any) -> InputFeature:
    if isinstance(feature, InputFeature):
        return feature
    if isinstance(feature, Mapping):
        return InputFeature.from_dict(dict(feature))
    raise TypeError(f"cannot collate a {type(feature).__name__}; expected InputFeature or dict")


def collate_causal_lm(features: Sequence[Any], pad_token_id: int,
                      pad_to_multiple_of: int | None = None) -> dict[str, Any]:
    """Right-pad ``features`` into a batch of int64 tensors (see the module doc for the layouts)."""
    if pad_token_id is None:
        raise ValueError("pad_token_id is None; set tokenizer.pad_token (e.g. to the eos token)")
    return collate_tokens([_as_feature(f) for f in features], pad_token_id, pad_to_multiple_of)


def collate_tokens(features: Sequence[Any], pad_token_id: int, pad_to_multiple_of: int | None = None) -> dict[str, Any]:
    """The text part of a batch in the module doc's layouts, for any features with ``input_ids``, ``labels`` and
    ``position_ids`` (``None`` unless packed) attributes: a task with more per-row inputs (a VLM's images) adds its
    own keys to what this returns."""
    import torch

    if not features:
        raise ValueError("cannot collate an empty list of features")
    packed = any(f.position_ids is not None for f in features)
    length = max(len(f.input_ids) for f in features)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    batch = len(features)
    input_ids = torch.full((batch, length), int(pad_token_id), dtype=torch.long)
    labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
    out: dict[str, Any] = {"input_ids": input_ids, "labels": labels}
    if packed:
        position_ids = torch.zeros((batch, length), dtype=torch.long)
        out["position_ids"] = position_ids
    else:
        attention_mask = torch.zeros((batch, length), dtype=torch.long)
        out["attention_mask"] = attention_mask
    for row, feature in enumerate(features):
        n = len(feature.input_ids)
        input_ids[row, :n] = torch.tensor(feature.input_ids, dtype=torch.long)
        labels[row, :n] = torch.tensor(feature.labels, dtype=torch.long)
        if packed:
            positions = feature.position_ids if feature.position_ids is not None else list(range(n))
            position_ids[row, :n] = torch.tensor(positions, dtype=torch.long)
            start = positions[-1] + 1 if n else 0  # the padding continues the row's last sequence
            position_ids[row, n:] = torch.arange(start, start + length - n, dtype=torch.long)
        else:
            attention_mask[row, :n] = 1
    return out


def is_packed_batch(batch: Mapping[str, Any]) -> bool:
    """True for the padding-free layout (``position_ids`` and no ``attention_mask``)."""
    return "position_ids" in batch and batch.get("attention_mask") is None


def sequence_lengths_from_position_ids(position_ids: Any) -> list[list[int]]:
    """Per row, the lengths of the sequences of a packed batch (starts are ``position_ids == 0``;
    the trailing padding counts towards the last sequence). Handy for varlen attention kernels."""
    rows = position_ids.tolist() if hasattr(position_ids, "tolist") else [list(r) for r in position_ids]
    result = []
    for row in rows:
        starts = [i for i, p in enumerate(row) if p == 0] or [0]
        if starts[0] != 0:
            starts.insert(0, 0)
        ends = starts[1:] + [len(row)]
        result.append([e - s for s, e in zip(starts, ends, strict=True)])
    return result


__all__ = ["collate_causal_lm", "is_packed_batch", "sequence_lengths_from_position_ids"]
