"""Helpers shared by the strategies' parity tests: run a one-process reference and compare runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

#: fp32 losses and grad norms of a strategy must match the one-process run within this
PARITY_ATOL = 1e-5


def run_python(args: list[str], timeout: float) -> Any:
    """Run a Python script as a single process (no torchrun variables), keeping output and wall time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1"}
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    start = time.monotonic()
    try:
        result = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        result = subprocess.CompletedProcess(exc.cmd, -9, exc.stdout or "", f"{exc.stderr or ''}\ntimed out")
    result.output = f"$ {' '.join(args)}\n{result.stdout}\n{result.stderr}"
    result.seconds = time.monotonic() - start
    return result


def assert_same_run(reference: dict[str, Any], other: dict[str, Any], what: str) -> float:
    """Both runs have 10 steps whose losses and grad norms agree within PARITY_ATOL; returns the max loss delta."""
    assert len(other["losses"]) == len(reference["losses"]) == 10
    deltas = [abs(a - b) for a, b in zip(reference["losses"], other["losses"], strict=True)]
    norm_deltas = [abs(a - b) for a, b in zip(reference["grad_norms"], other["grad_norms"], strict=True)]
    detail = f"{what}\nreference {reference['losses']}\n{what:>9} {other['losses']}"
    assert max(deltas) <= PARITY_ATOL, f"losses differ by up to {max(deltas):.3g}\n{detail}"
    assert max(norm_deltas) <= PARITY_ATOL, (f"grad norms differ by up to {max(norm_deltas):.3g}\n"
                                             f"{reference['grad_norms']}\n{other['grad_norms']}")
    return max(deltas)
