"""The task contract: how dataset rows become model inputs, which loss applies, how to evaluate."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from twinkle_core.model.base import TwinkleModel


class Task(ABC):
    """A training task. ``options`` come from the recipe's ``task_options`` mapping."""

    name: ClassVar[str] = ""
    default_loss: ClassVar[str] = ""
    #: what kind of network the backend should build: "causal_lm" or "encoder"
    model_kind: ClassVar[str] = "causal_lm"

    def __init__(self, **options: Any) -> None:
        self.options = options

    @abstractmethod
    def load_dataset(self, path: str, tokenizer: Any, **data_options: Any) -> Any:
        """Read ``path`` into a sequence of features ready for ``collate``."""

    @abstractmethod
    def collate(self, features: list[Any]) -> dict[str, Any]:
        """Turn a list of features into one batch of tensors."""

    def evaluate(self, model: TwinkleModel, dataset: Any, tokenizer: Any, **options: Any) -> dict[str, float]:
        """Held-out metrics (default: none beyond the evaluation loss computed by the loop)."""
        return {}

    def prepare_model(self, model: TwinkleModel) -> None:
        """Hook to adapt the backend's model for the task (pooling heads ...)."""
