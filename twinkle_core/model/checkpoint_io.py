"""A torch model's checkpoint, written and resumed: its weights in the backend's format, and the training
state beside them (optimizer, scheduler, precision, counters, per-rank RNG, ``trainer_state.pt``).

:meth:`TorchTwinkleModel.save` and ``resume_from_checkpoint`` call these with the adapter's
:class:`~twinkle_core.model.train_state.TrainState`; everything else they need is the model's public API
(``get_state_dict``, ``write_weights``, ``load``, ``strategy``, ``precision``, ``task``).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch

from twinkle_core import checkpoint, distributed
from twinkle_core.checkpoint_layout import CheckpointLayout
from twinkle_core.checkpoint_layout import TrainerStateKeys as Keys
from twinkle_core.model.train_state import TrainState
from twinkle_core.names import validate_name

if TYPE_CHECKING:
    from twinkle_core.model.torch_model import TorchTwinkleModel

def save(model: TorchTwinkleModel, state: TrainState, name: str, *, output_dir: str, save_optimizer: bool,
         extra_state: dict[str, Any] | None) -> str:
    """Write ``output_dir/name`` atomically: ``state``'s weights (and, with ``save_optimizer``, its training
    state); the task adds its files (``on_export``, ``save_training_state``). Returns the directory."""
    adapter_name = state.name or None
    final = os.path.join(output_dir, validate_name("checkpoint name", name, allow_dots=True))
    weights = model.get_state_dict(adapter_name=adapter_name)
    is_main = model.strategy.is_main_process
    with checkpoint.atomic_directory(final, is_main=is_main,
                                     metadata={"adapter_name": adapter_name, "step": state.step}) as tmp:
        if is_main:
            model.write_weights(tmp, weights, adapter_name)
            if model.task is not None:
                model.task.on_export(model, tmp, adapter_name)
        if save_optimizer and state.optimizer is not None:
            save_training_state(model, state, tmp, extra_state)
            if model.task is not None:
                model.task.save_training_state(model, tmp)
    return final


def save_training_state(model: TorchTwinkleModel, state: TrainState, directory: str,
                         extra_state: dict[str, Any] | None) -> None:
    strategy = model.strategy
    layout = CheckpointLayout(directory)
    if strategy.is_main_process:
        os.makedirs(layout.state_dir, exist_ok=True)
    strategy.barrier()
    strategy.save_optimizer_state(layout.state_dir, model.wrapped, state.handle)
    torch.save(checkpoint.capture_rng_state(), layout.rng_state(distributed.rank()))
    if strategy.is_main_process:
        torch.save({
            Keys.COUNTERS: state.counters(),
            Keys.SCHEDULER: state.scheduler.state_dict() if state.scheduler is not None else None,
            Keys.PRECISION: model.strategy.precision_state(),
            Keys.EXTRA_STATE: extra_state or {},
            # resume can tell a deleted RNG file from one never written
            Keys.RNG_RANKS: distributed.world_size(),
            # JSON-safe (an adapter config becomes its repr) so the file loads with weights_only=True
            Keys.CONFIGS: json.loads(json.dumps(model.get_train_configs(adapter_name=state.name or None),
                                                default=str)),
        }, layout.trainer_state)


def resume(model: TorchTwinkleModel, state: TrainState, path: str) -> dict[str, Any]:
    """Restore ``state``'s weights, optimizer, scheduler, precision, counters and RNG from the checkpoint at
    ``path`` (an optimizer must be set); return the ``extra_state`` it was saved with."""
    if not checkpoint.is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete Twinkle checkpoint (no {checkpoint.MARKER})")
    checkpoint.verify_on_main(path, model.strategy.is_main_process)
    handle = state.require_optimizer("resume_from_checkpoint")
    layout = CheckpointLayout(path)
    trainer = checkpoint.load_state_file(layout.trainer_state)
    rank = distributed.rank()
    rng_path = layout.rng_state(rank)
    # older checkpoints lack rng_ranks: then any other rank's RNG file shows this one was written too
    saved_rng = trainer.get(Keys.RNG_RANKS)
    written = rank < saved_rng if saved_rng is not None else layout.has_rng_files()
    if written and not os.path.isfile(rng_path):
        raise checkpoint.CheckpointError(f"checkpoint file {rng_path} is missing (it was written at save time)")
    model.load(path, adapter_name=state.name or None)
    model.strategy.load_optimizer_state(layout.state_dir, model.wrapped, handle)
    if trainer[Keys.SCHEDULER] is not None and state.scheduler is not None:
        state.scheduler.load_state_dict(trainer[Keys.SCHEDULER])
    model.strategy.load_precision_state(trainer[Keys.PRECISION])
    state.load_counters(trainer[Keys.COUNTERS])
    state.reset_accumulation()
    if model.task is not None:
        model.task.load_training_state(model, path)
    if written:  # last: loading the task's state must not move the RNG streams of the resumed run
        checkpoint.restore_rng_state(checkpoint.load_state_file(rng_path))
    return trainer[Keys.EXTRA_STATE]
