"""Checks and conversions every loss needs, public so that plugin losses apply the same rules.

* :func:`check_reduction`: ``reduction`` is ``"sum"`` or ``"mean"`` (the two the model's normalisation knows);
* :func:`require`: a batch or output key the loss cannot run without, with an error naming the loss and key;
* :func:`align_to_shifted`: a per-sequence or per-token tensor brought to the shifted ``[B, T - 1]`` layout of
  :func:`twinkle_core.loss.logprobs.token_logprobs`;
* :func:`scalar`: a tensor as a plain float for ``LossOutput.metrics``.
"""

from __future__ import annotations

from typing import Any

import torch

REDUCTIONS = ("sum", "mean")


def check_reduction(reduction: str) -> str:
    """``reduction`` itself, or a :class:`ValueError` naming the accepted ones."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction


def require(mapping: dict[str, Any], key: str, where: str, what: str) -> Any:
    """``mapping[key]``; a :class:`KeyError` saying that ``where`` (the loss) needs ``what[key]`` when absent."""
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
    """``x`` as a detached Python float (for metrics: no graph is kept alive)."""
    return float(x.detach())


__all__ = ["REDUCTIONS", "align_to_shifted", "check_reduction", "require", "scalar"]
