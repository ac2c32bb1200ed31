"""Small helpers shared by the built-in losses (not part of the public API)."""

from __future__ import annotations

from typing import Any

import torch

REDUCTIONS = ("sum", "mean")


def check_reduction(reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction


def require(mapping: dict[str, Any], key: str, where: str, what: str) -> Any:
    value = mapping.get(key)
    if value is None:
        raise KeyError(f"{where} needs {what}[{key!r}]")
    return value


def align_to_shifted(x: torch.Tensor, batch: int, steps: int, name: str) -> torch.Tensor:
    """Bring a per-token tensor to the shifted ``[B, T - 1]`` layout.

    Accepts ``[B]`` (per sequence, broadcast over tokens), ``[B, T - 1]`` (already aligned with the
    shifted labels) or ``[B, T]`` (aligned with ``labels`` / ``input_ids``: the first column, which no
    logit predicts, is dropped).
    """
    if x.dim() == 1 and x.shape[0] == batch:
        return x.unsqueeze(1).expand(batch, steps)
    if x.dim() == 2 and x.shape[0] == batch:
        if x.shape[1] == steps:
            return x
        if x.shape[1] == steps + 1:
            return x[:, 1:]
    raise ValueError(f"{name} has shape {tuple(x.shape)}; expected [{batch}], [{batch}, {steps}] or [{batch}, {steps + 1}]")


def scalar(x: torch.Tensor) -> float:
    return float(x.detach())
