"""Implementations behind the fake plugin's records (imported only when used)."""

from __future__ import annotations

from typing import Any

from twinkle_core.loss.base import Loss, LossOutput
from twinkle_core.task import Task


class FakeLoss(Loss):
    name = "fake_loss"

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any]) -> LossOutput:
        diff = (outputs["prediction"] - inputs["target"]).abs()
        return LossOutput(loss=diff.sum(), num_tokens=diff.numel())


class FakeTask(Task):
    name = "fake_task"
    default_loss = "fake_loss"

    def load_dataset(self, path: str, tokenizer: Any, **data_options: Any) -> list[list[float]]:
        with open(path, encoding="utf-8") as fh:
            return [[float(x) for x in line.split()] for line in fh if line.strip()]

    def collate(self, features: list[Any]) -> dict[str, Any]:
        import torch

        return {"target": torch.tensor(features, dtype=torch.float32)}
