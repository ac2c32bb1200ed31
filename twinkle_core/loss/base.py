"""The loss contract."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


@dataclass
class LossOutput:
    """A loss summed over ``num_tokens`` units (tokens, sequences or pairs).

    The model divides accumulated gradients by the *global* ``num_tokens`` before the optimizer
    step, which is what makes gradient accumulation and data parallelism exact. A loss that is
    already a mean reports ``num_tokens=1``.
    """

    loss: torch.Tensor
    num_tokens: torch.Tensor | int
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def mean(self) -> torch.Tensor:
        return self.loss / max(float(self.num_tokens), 1.0)


class Loss(ABC):
    """A loss: ``loss(outputs, inputs) -> LossOutput``.

    ``outputs`` is the model's output mapping (``logits`` at least); ``inputs`` is the batch
    (``labels`` and whatever the loss needs, e.g. ``ref_logps`` for DPO, ``advantages`` for GRPO).
    Subclasses take their hyper-parameters as keyword arguments of ``__init__``.
    """

    name: ClassVar[str] = ""

    @abstractmethod
    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any]) -> LossOutput: ...


class CallableLoss(Loss):
    """Adapts a plain function ``fn(outputs, inputs) -> LossOutput | Tensor`` to :class:`Loss`.

    A bare tensor is taken as an already-averaged loss (``num_tokens=1``).
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.name = getattr(fn, "__name__", "callable")

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any]) -> LossOutput:
        result = self.fn(outputs, inputs)
        if isinstance(result, LossOutput):
            return result
        return LossOutput(loss=result, num_tokens=1)
