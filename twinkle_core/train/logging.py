"""Training logs: one JSON object per line in ``output_dir/logs.jsonl``, and TensorBoard when installed.

Each line carries ``event`` (``train`` or ``eval``), ``step`` and the values, e.g.::

    {"event": "train", "step": 10, "epoch": 0, "loss": 2.31, "lr": 9.8e-05, "grad_norm": 1.7,
     "tokens_per_s": 5120.4, "batch_time_s": 0.4, "train_tokens_per_s": 5290.1, "elapsed_s": 12.9,
     "time": 1718000000.1}

``tokens_per_s`` counts the input tokens over the whole interval; ``train_tokens_per_s`` over the interval less
``batch_time_s``, the time spent making batches (for an RL task: sampling, rewards and reference passes).

Only the main process writes. The file is appended to, so a resumed run continues the same log.
TensorBoard (``output_dir/tensorboard``) is used when ``tensorboard`` is importable, unless
``TWINKLE_TENSORBOARD=0``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from twinkle_core.envflags import env_flag

logger = logging.getLogger("twinkle.train")

LOG_FILE = "logs.jsonl"


def _plain(value: Any) -> Any:
    """A JSON-safe scalar (tensors and numpy numbers become floats; NaN/inf become null)."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):
            return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


class TrainLogger:
    """Writes JSONL (always) and TensorBoard scalars (when available) on the main process."""

    def __init__(self, output_dir: str | os.PathLike[str], *, enabled: bool = True,
                 tensorboard: bool | None = None) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / LOG_FILE
        self._file = None
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard is None:
            tensorboard = env_flag("TWINKLE_TENSORBOARD", True)
        if tensorboard:
            self._tb = self._open_tensorboard(Path(output_dir) / "tensorboard")

    @staticmethod
    def _open_tensorboard(log_dir: Path) -> Any:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            logger.debug("tensorboard is not installed (pip install tensorboard); logging to JSONL only")
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter(log_dir=str(log_dir))
        except Exception as exc:  # a broken tensorboard install must not stop training
            logger.warning("TensorBoard logging disabled: %s", exc)
            return None

    def log(self, event: str, step: int, values: dict[str, Any]) -> dict[str, Any]:
        record = {"event": event, "step": int(step), **{k: _plain(v) for k, v in values.items()},
                  "time": round(time.time(), 3)}
        if not self.enabled or self._file is None:
            return record
        self._file.write(json.dumps(record, sort_keys=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key in ("event", "step", "time") or isinstance(value, bool):
                    continue
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{event}/{key}", value, global_step=int(step))
            self._tb.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> TrainLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``logs.jsonl`` file (or of ``output_dir/logs.jsonl``)."""
    file = Path(path)
    if file.is_dir():
        file = file / LOG_FILE
    with open(file, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
