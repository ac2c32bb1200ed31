"""Checkpoint directories that are complete or absent, and RNG state capture.

A checkpoint is written into ``.NAME.incomplete`` beside its final place and renamed once every
rank has finished, so a crash mid-save never leaves a directory that looks complete. The marker
file ``twinkle_checkpoint.json`` is written last.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from twinkle_core import distributed

MARKER = "twinkle_checkpoint.json"
STATE_DIR = "twinkle_state"


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
