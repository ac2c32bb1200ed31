"""The task contract: how dataset rows become model inputs, what the network's outputs become, which
loss applies, what a saved model directory holds besides the weights, how to evaluate.

A task reaches the model only through the seams declared here; the model calls them, so a task
never patches a backend's methods. A minimal task that adds a head and a file::

    class ScoreTask(Task):
        name = "score"
        default_loss = "mse"

        def load_dataset(self, path, tokenizer, **data_options): ...
        def collate(self, features): ...

        def process_outputs(self, outputs, inputs):
            # every forward of the model (training and evaluation) goes through here
            return {**outputs, "scores": outputs["logits"][:, -1, 0]}

        def on_export(self, model, directory, adapter_name):
            # called on the main process inside the checkpoint being written
            with open(os.path.join(directory, "score_task.json"), "w") as f:
                f.write('{"head": "last_token"}')
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from twinkle_core.model.base import TwinkleModel

#: the loss a model uses when neither the recipe nor the task names one
FALLBACK_LOSS = "cross_entropy"


class Task(ABC):
    """A training task. ``options`` come from the recipe's ``task_options`` mapping."""

    name: ClassVar[str] = ""
    default_loss: ClassVar[str] = ""
    #: what kind of network the backend should build: "causal_lm" or "encoder"
    model_kind: ClassVar[str] = "causal_lm"
    #: batch features this task's batches carry beyond tokens and labels (see ``Loss.requires``)
    provides: ClassVar[frozenset[str]] = frozenset()

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
        """Adapt the model for the task once it is built (read its config, choose a head ...)."""

    def prepare_dataset(self, model: TwinkleModel, dataset: Any, *, split: str, output_dir: str) -> Any:
        """Annotate a loaded data set with what the model computes once before training (precomputed
        reference log-probs), caching it under ``output_dir`` so a resumed run reuses it.

        The trainer calls it on every rank for ``split`` "train" and "eval", once the model is built and
        before a checkpoint is resumed (so the model holds its initial weights), and trains on what it returns.
        """
        return dataset

    def prepare_batch(self, model: TwinkleModel, batch: dict[str, Any]) -> dict[str, Any]:
        """Complete a collated batch with what only the model can compute (reference log-probs, ...).

        The trainer calls it on every rank before each training and evaluation forward of a batch; a
        script driving the model itself calls it the same way. It may run ``model.forward_only``.
        """
        return batch

    def process_outputs(self, outputs: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
        """Turn the network's outputs into what the task's loss and evaluation read (pooling, heads).

        Called by the model on every forward, inside its precision context, before the loss.
        """
        return outputs

    def on_export(self, model: TwinkleModel, directory: str, adapter_name: str | None) -> None:
        """Add the task's files to a model directory the model has just written (main process only)."""


def default_loss_name(task: Task | None) -> str:
    """The loss a model applies when none was set: the task's ``default_loss``, else cross entropy."""
    return getattr(task, "default_loss", "") or FALLBACK_LOSS
