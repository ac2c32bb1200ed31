"""Where everything in a Twinkle checkpoint directory lives: one object owns the file names and the keys of the
training-state file, so the writer (the model), the readers (resume, the trainer's layout check, the commands)
and tests agree by construction::

    checkpoint-12/
        twinkle_checkpoint.json      MARKER: written last; lists every file with its size and hash
        model.safetensors ...        the backend's weights (TorchTwinkleModel.write_weights), the task's files
        twinkle_state/               STATE_DIR: only in checkpoints that hold optimizer state
            trainer_state.pt         TRAINER_STATE: the main process's dict of TrainerStateKeys
            rng-rank{R}.pt           every rank's RNG streams
            optimizer.pt             the default strategy's optimizer state (a strategy may write its own
                                     folder or per-rank files here instead: DCP, DeepSpeed, Megatron shards)

    layout = CheckpointLayout("outputs/run/checkpoint-12")
    torch.load(layout.trainer_state)["extra_state"]["step"]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar


class TrainerStateKeys:
    """The keys of ``trainer_state.pt`` (one dict, written by the main process)."""

    COUNTERS = "counters"  # the adapter's step and token counters (TrainState.counters())
    SCHEDULER = "scheduler"  # the learning-rate scheduler's state dict, or None
    PRECISION = "precision"  # the strategy's precision state (fp16: the loss scaler)
    EXTRA_STATE = "extra_state"  # what the caller of save() added: the trainer's step, epoch, loader, layout ...
    RNG_RANKS = "rng_ranks"  # ranks 0 .. rng_ranks-1 wrote rng-rank{R}.pt
    CONFIGS = "configs"  # get_train_configs() of the saved adapter, JSON-safe


@dataclass(frozen=True)
class CheckpointLayout:
    """The paths of one checkpoint directory ``root``."""

    root: str

    MARKER: ClassVar[str] = "twinkle_checkpoint.json"
    STATE_DIR: ClassVar[str] = "twinkle_state"
    TRAINER_STATE: ClassVar[str] = "trainer_state.pt"
    RNG_PREFIX: ClassVar[str] = "rng-rank"
    OPTIMIZER: ClassVar[str] = "optimizer.pt"

    @property
    def marker(self) -> str:
        return os.path.join(self.root, self.MARKER)

    @property
    def state_dir(self) -> str:
        return os.path.join(self.root, self.STATE_DIR)

    @property
    def trainer_state(self) -> str:
        return os.path.join(self.state_dir, self.TRAINER_STATE)

    def rng_state(self, rank: int) -> str:
        return os.path.join(self.state_dir, f"{self.RNG_PREFIX}{rank}.pt")

    def has_rng_files(self) -> bool:
        """Whether any rank's RNG file is present (older checkpoints did not record how many were written)."""
        return any(name.startswith(self.RNG_PREFIX) for name in os.listdir(self.state_dir))

    @classmethod
    def optimizer_file(cls, state_dir: str) -> str:
        """The default strategy's optimizer-state file inside the ``state_dir`` a strategy is handed."""
        return os.path.join(state_dir, cls.OPTIMIZER)


__all__ = ["CheckpointLayout", "TrainerStateKeys"]
