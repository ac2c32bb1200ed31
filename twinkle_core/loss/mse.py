"""Mean squared error between a model output and a target (value heads, reward regression)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from twinkle_core.loss.base import Loss, LossContext, LossOutput
from twinkle_core.loss.helpers import check_reduction, require
from twinkle_core.loss.logprobs import acc_dtype


class MSELoss(Loss):
    """Squared error between ``outputs[key]`` and ``inputs[target_key]``, in (at least) float32.

    ``reduction="sum"`` (default) returns the sum with ``num_tokens`` = number of elements;
    ``"mean"`` returns the mean with ``num_tokens=1``. A prediction with a trailing singleton
    dimension (``[B, T, 1]`` from a value head) is matched to a ``[B, T]`` target. With
    ``mask_key`` set, only elements where ``inputs[mask_key]`` is true count (the mask broadcasts to
    the prediction).
    """

    name: ClassVar[str] = "mse"

    def __init__(
        self, reduction: str = "sum", key: str = "logits", target_key: str = "targets", mask_key: str | None = None
    ) -> None:
        self.reduction = check_reduction(reduction)
        self.key = key
        self.target_key = target_key
        self.mask_key = mask_key

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        pred = require(outputs, self.key, "MSELoss", "outputs")
        target = torch.as_tensor(require(inputs, self.target_key, "MSELoss", "inputs")).to(pred.device)
        if pred.shape != target.shape and pred.shape[-1] == 1 and pred.shape[:-1] == target.shape:
            pred = pred.squeeze(-1)
        if pred.shape != target.shape:
            raise ValueError(f"MSELoss: outputs[{self.key!r}] {tuple(pred.shape)} vs target {tuple(target.shape)}")
        acc = acc_dtype(pred.dtype)
        sq = (pred.to(acc) - target.to(acc)) ** 2
        if self.mask_key is not None:
            mask = require(inputs, self.mask_key, "MSELoss", "inputs").to(pred.device).bool()
            mask = torch.broadcast_to(mask, sq.shape)
            sq = torch.where(mask, sq, torch.zeros_like(sq))
            count: Any = mask.sum()
        else:
            count = sq.numel()
        if self.reduction == "mean":
            denom = count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)
            return LossOutput(loss=sq.sum() / denom, num_tokens=1)
        return LossOutput(loss=sq.sum(), num_tokens=count)
