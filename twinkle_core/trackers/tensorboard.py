"""The ``tensorboard`` tracker: scalars under ``output_dir/tensorboard`` (``torch.utils.tensorboard``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from twinkle_core.trackers import Tracker


class TensorBoardTracker(Tracker):
    """``log_dir``: where the event files go (default ``output_dir/tensorboard``)."""

    requires = {"tensorboard": "pip install tensorboard"}

    def __init__(self, log_dir: str | None = None) -> None:
        super().__init__(log_dir=log_dir)
        self.log_dir = log_dir
        self._writer: Any = None

    def start(self, run_config: dict[str, Any], output_dir: str | os.PathLike[str], run_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(self.log_dir or Path(output_dir) / "tensorboard"))
        self._writer.add_text("config", "```\n" + json.dumps(run_config, indent=2, default=str) + "\n```")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def finish(self, status: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
