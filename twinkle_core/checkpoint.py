"""Checkpoint directories that are complete or absent, the run's checkpoint policy, and RNG state capture.

A checkpoint is written into ``.NAME.incomplete`` beside its final place and renamed once every
rank has finished, so a crash mid-save never leaves a directory that looks complete. The marker
file ``twinkle_checkpoint.json`` is written last.

A training run keeps its checkpoints in its output directory as ``checkpoint-N`` (after optimizer
step N) and ``checkpoint-N-interrupted`` (saved when training stopped early); see
:func:`checkpoint_name`, :func:`list_checkpoints`, :func:`latest_checkpoint` and :func:`prune_checkpoints`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from twinkle_core import distributed

MARKER = "twinkle_checkpoint.json"
STATE_DIR = "twinkle_state"
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)(-interrupted)?$")


@contextmanager
def atomic_directory(final_path: str, *, is_main: bool, metadata: dict[str, Any] | None = None) -> Iterator[str]:
    """Yield a temporary directory that becomes ``final_path`` when the block succeeds (on all ranks)."""
    parent, name = os.path.split(os.path.abspath(final_path))
    staging = os.path.join(parent, f".{name}.incomplete")
    if is_main:
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    distributed.barrier()
    yield staging
    distributed.barrier()
    if is_main:
        with open(os.path.join(staging, MARKER), "w") as fh:
            json.dump({"format": 1, **(metadata or {})}, fh, indent=2, default=str)
        if os.path.exists(final_path):
            retired = os.path.join(parent, f".{name}.replaced")
            shutil.rmtree(retired, ignore_errors=True)
            os.replace(final_path, retired)
            os.replace(staging, final_path)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, final_path)
    distributed.barrier()


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def checkpoint_name(step: int, *, interrupted: bool = False) -> str:
    """The directory name of the checkpoint after optimizer step ``step``."""
    return f"checkpoint-{step}-interrupted" if interrupted else f"checkpoint-{step}"


def list_checkpoints(output_dir: str | os.PathLike[str]) -> list[tuple[int, bool, Path]]:
    """``(step, interrupted, path)`` of every checkpoint under ``output_dir``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _CHECKPOINT_NAME.match(child.name)
        if match:
            found.append((int(match.group(1)), bool(match.group(2)), child))
    # at equal steps the regular checkpoint counts as newer than an interrupted one
    return sorted(found, key=lambda item: (item[0], not item[1]))


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1][2] if checkpoints else None


def prune_checkpoints(output_dir: str | os.PathLike[str], limit: int | None) -> list[Path]:
    """Keep the newest ``limit`` ``checkpoint-N`` directories; interrupted ones older than the
    newest kept checkpoint are superseded and go too. Returns what was removed."""
    if not limit:
        return []
    checkpoints = list_checkpoints(output_dir)
    regular = [c for c in checkpoints if not c[1]]
    doomed = regular[:-limit] if len(regular) > limit else []
    if regular:
        newest = regular[-1][0]
        doomed += [c for c in checkpoints if c[1] and c[0] <= newest]
    removed = []
    for _, _, path in doomed:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def capture_rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
