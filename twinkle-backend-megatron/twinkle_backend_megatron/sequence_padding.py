"""Batches padded to a multiple of the tensor-parallel size, as sequence parallelism (TP-SP) needs.

Under TP-SP megatron-core splits every sequence over the TP ranks (the embedding's output is scattered along the
sequence), so the sequence length must divide by ``tp``. :func:`pad_sequences` right-pads a batch: the new
positions are padding (``attention_mask`` 0, no label), so no loss, metric or attention result of a real token
changes. Per-token tensors aligned with the shifted labels (``[B, T - 1]``: old log-probs, advantages) are padded
with them. :func:`trim_sequences` cuts the outputs of an evaluation forward back to the caller's length.
"""

from __future__ import annotations

from typing import Any

import torch

from twinkle_core.constants import IGNORE_INDEX

__all__ = ["padded_length", "pad_sequences", "trim_sequences"]


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def _fill(key: str, value: torch.Tensor, extra: int) -> torch.Tensor:
    """``extra`` positions to append to ``value`` along dim 1."""
    shape = (value.shape[0], extra, *value.shape[2:])
    if key == "position_ids":  # continue each row, so no new packed segment starts at the padding
        steps = torch.arange(1, extra + 1, dtype=value.dtype, device=value.device).view(1, extra)
        return value[:, -1:] + steps
    fill = IGNORE_INDEX if key == "labels" else 0  # attention_mask 0: padding; 0 for ids and per-token values
    return torch.full(shape, fill, dtype=value.dtype, device=value.device)


def pad_sequences(inputs: dict[str, Any], multiple: int) -> tuple[dict[str, Any], int]:
    """``inputs`` with every ``[B, T, ...]`` and ``[B, T - 1, ...]`` tensor right-padded so that ``T`` divides by
    ``multiple``, and the original ``T``."""
    input_ids = inputs["input_ids"]
    rows, length = input_ids.shape[:2]
    extra = padded_length(length, multiple) - length
    if extra == 0:
        return inputs, length
    out = dict(inputs)
    if "attention_mask" not in out:
        out["attention_mask"] = torch.ones_like(input_ids)
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == rows \
                and value.shape[1] in (length, length - 1):
            out[key] = torch.cat([value, _fill(key, value, extra)], dim=1)
    return out, length


def trim_sequences(outputs: dict[str, Any], padded: int, length: int) -> dict[str, Any]:
    """``outputs`` with every tensor of ``padded`` positions along dim 1 cut back to ``length``."""
    if padded == length:
        return outputs
    return {key: value[:, :length] if isinstance(value, torch.Tensor) and value.dim() >= 2
            and value.shape[1] == padded else value for key, value in outputs.items()}
