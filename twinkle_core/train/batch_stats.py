"""What the loop counts in a batch and a forward pass: summed loss and tokens, input tokens, label tokens.

Shared by the training step and evaluation, which weigh every micro-batch's loss by its tokens.
"""

from __future__ import annotations

import math
from typing import Any

from twinkle_core.train.guards import IGNORE_INDEX


def loss_and_tokens(result: Any) -> tuple[float, float]:
    """``(summed loss, tokens)`` from a ``LossOutput``, an outputs mapping or a bare (mean) tensor."""
    if isinstance(result, dict):
        loss, tokens = result.get("loss"), result.get("num_tokens", 1)
        mean = True
    elif hasattr(result, "loss") and hasattr(result, "num_tokens"):
        loss, tokens = result.loss, result.num_tokens
        mean = False
    else:
        loss, tokens, mean = result, 1, True
    if loss is None:
        return 0.0, 0.0
    loss_f = float(loss.detach() if hasattr(loss, "detach") else loss)
    tokens_f = float(tokens)
    return (loss_f * tokens_f if mean else loss_f), tokens_f


def batch_tokens(batch: Any) -> float:
    """The input tokens of ``batch``: its attention mask's ones, else the size of ``input_ids`` (0 without either)."""
    if not isinstance(batch, dict):
        return 0.0
    mask = batch.get("attention_mask")
    if mask is not None and hasattr(mask, "sum"):
        return float(mask.sum())
    ids = batch.get("input_ids")
    if ids is not None and hasattr(ids, "numel"):
        return float(ids.numel())
    return 0.0


def label_tokens(batch: Any) -> float | None:
    """How many labels of ``batch`` are not ``IGNORE_INDEX``; None when it has no label tensor."""
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if labels is None or not hasattr(labels, "ne"):
        return None
    return float(labels.ne(IGNORE_INDEX).sum())


def is_finite(value: Any) -> bool:
    """None (a model that reports no gradient norm) counts as finite."""
    return value is None or math.isfinite(float(value))

