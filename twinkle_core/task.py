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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from twinkle_core.model.base import TwinkleModel

#: the loss a model uses when neither the recipe nor the task names one
FALLBACK_LOSS = "cross_entropy"


class Task(ABC):
    """A training task. ``options`` come from the recipe's ``task_options`` mapping."""

    name: ClassVar[str] = ""
    default_loss: ClassVar[str] = ""
    #: what kind of network the backend should build: "causal_lm", "encoder" (hidden states), "token_value"
    #: (one scalar per token: a PPO critic's value head, ``outputs["logits"]`` of shape ``[B, T, 1]``) or
    #: "sequence_score" (one scalar per row at its last non-pad token: a reward model, ``logits`` ``[B, 1]``)
    model_kind: ClassVar[str] = "causal_lm"
    #: whether ``process_outputs`` reads ``outputs["logits"]`` in training; a task that does not (it passes them
    #: through) lets a loss that applies the LM head itself skip the logits (``Loss.fuses_lm_head``)
    reads_logits: ClassVar[bool] = True
    #: batch keys the network's forward takes besides the backend's text inputs (``input_ids``,
    #: ``attention_mask``, ``position_ids`` ...): a vision-language model's ``pixel_values``, ``image_grid_thw``
    model_inputs: ClassVar[tuple[str, ...]] = ()
    #: batch features this task's batches carry beyond tokens and labels (see ``Loss.requires``)
    provides: ClassVar[frozenset[str]] = frozenset()
    #: whether the trainer's evaluation computes the loss on ``data.eval`` batches; a task whose eval rows are
    #: not training batches (RL prompts) says False and reports what it measures from :meth:`evaluate`
    has_eval_loss: ClassVar[bool] = True
    #: logged values drawn in ``output_dir/curves.png`` besides the loss (with their ``eval_`` counterparts)
    curve_keys: ClassVar[tuple[str, ...]] = ()
    #: the task's headline metrics: keys of the ``train`` log line (from :meth:`step_metrics` or the loss's own
    #: metrics) that the console's step line and the progress bar show after the loss, in this order, when the line
    #: has them as numbers; every other value stays in ``logs.jsonl`` only. The core's
    #: :class:`~twinkle_core.train.step_log.StepReporter` applies it the same for every task. E.g. a DPO task::
    #:
    #:     console_keys = ("rewards/accuracies", "rewards/margins")
    #:
    #: gives ``step 10/120 loss 0.61 lr 0.0005 grad_norm 2.1 tokens/s 5120.4 rewards/accuracies 0.75 ...``
    console_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **options: Any) -> None:
        self.options = options

    @abstractmethod
    def load_dataset(self, path: str, tokenizer: Any, **data_options: Any) -> Any:
        """Read ``path`` into a sequence of features ready for ``collate``."""

    @abstractmethod
    def collate(self, features: list[Any]) -> dict[str, Any]:
        """Turn a list of features into one batch of tensors."""

    @classmethod
    def check_recipe(cls, recipe: Any) -> list[str]:
        """The problems of a training recipe (a :class:`twinkle_core.train.recipe.Recipe`) for this task that only the task knows (which ``data.mode`` values
        its ``load_dataset`` reads ...), each ``"key.path: message"``. Default: none.

        Who calls it and when: the recipe checker (:func:`twinkle_core.train.recipe.recipe_from_dict`, so also
        ``twinkle train`` and :func:`twinkle_core.train.loop.train`), once the recipe's types are right and before
        anything is built or launched; the problems are reported together with the recipe's own. A class method:
        no task exists yet, and nothing heavy (torch, a backend) may be imported here.
        """
        return []

    def check_data(self, path: Any, **data_options: Any) -> None:
        """Refuse the data ``path`` (``data.train`` / ``data.eval``: a file or a list of sources) where
        :meth:`load_dataset` would, raising the error it raises, for what can be told without a tokenizer or a
        model (files the rows name ...). ``data_options`` are those ``load_dataset`` gets. ``twinkle train``
        (``--dry-run`` too) calls it before launching. Default: nothing (``load_dataset`` reports)."""

    def evaluate(self, model: TwinkleModel, dataset: Any, tokenizer: Any, **options: Any) -> dict[str, float]:
        """Held-out metrics (default: none beyond the evaluation loss computed by the loop)."""
        return {}

    def prepare_model(self, model: TwinkleModel) -> None:
        """Adapt the model for the task once it is built (read its config, choose a head ...)."""

    def adapter_config(self, model: TwinkleModel, config: Any) -> Any:
        """The adapter config the model places, given the one it was asked to add (a recipe's ``model.adapter``
        as a dict, or a backend's config object): a task that trains only parts of the network narrows the
        targets here. The backend calls it inside ``add_adapter_to_model``, after ``prepare_model``."""
        return config

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

    def next_training_batch(self, model: TwinkleModel, draw: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The next micro-batch to train on; ``draw()`` returns the next collated batch of the data loader.

        Default: ``prepare_batch(model, draw())``. A task that makes several micro-batches from one data
        batch (online RL: a batch of prompts becomes rollouts, trained for several epochs of mini-batches)
        keeps them in a queue and calls ``draw`` only when it is empty, or several times when it needs more
        (dynamic sampling). Whatever it keeps between calls belongs in :meth:`state_dict`.
        """
        return self.prepare_batch(model, draw())

    def after_step(self, model: TwinkleModel, *, step: int) -> None:
        """Called on every rank after each optimizer step (``step`` is the new count), before logging or saving:
        where an RL task pushes the new weights to its sampler."""

    def step_metrics(self) -> dict[str, float]:
        """Metrics of the steps since the last call, added to the training log line (reward mean, ...).

        Called on every rank at each logging step; a task that reduces over ranks does it here, so the values
        it returns are global. Default: none."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What the task keeps between micro-batches (a rollout queue, sampler counters), saved in every
        checkpoint so that a resumed run continues exactly. Tensors, lists, dicts and scalars only. Return a
        snapshot (new lists and dicts): the trainer keeps the state of the last complete step for an interrupted
        checkpoint, and later micro-batches must not change it. Each rank's state is saved (a rank's share of a
        queue differs from another's) and given back to the same rank."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` when a checkpoint is resumed (after the model's own state)."""

    def save_training_state(self, model: TwinkleModel, directory: str) -> None:
        """Write what the task trains besides ``model`` (a PPO critic) into a training checkpoint being written.

        Called on every rank, inside the checkpoint's staging directory (so it is part of the checkpoint's
        integrity manifest), after the model's own state; only for checkpoints that hold optimizer state."""

    def load_training_state(self, model: TwinkleModel, directory: str) -> None:
        """Restore :meth:`save_training_state` from a checkpoint being resumed (every rank)."""

    def micro_batches_per_data_batch(self, batch_size: int, *, gradient_accumulation_steps: int = 1) -> int:
        """How many micro-batches :meth:`next_training_batch` makes of one data batch of ``batch_size`` rows
        (for the step count of a recipe without ``train.max_steps``), when an optimizer step takes
        ``gradient_accumulation_steps`` micro-batches. Default 1."""
        return 1

    def loss_options(self, loss_name: str) -> dict[str, Any]:
        """Defaults for the options of the loss ``loss_name`` that follow from the task's own options (an RL
        task's sampling temperature for its policy loss); the recipe's ``loss.options`` override them."""
        return {}

    def close(self) -> None:
        """Release what the task holds (sampler engines, threads) when training ends, also on an error."""

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
