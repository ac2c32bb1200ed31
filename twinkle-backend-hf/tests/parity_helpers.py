"""Helpers shared by the strategies' parity tests: run a one-process reference and compare runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from twinkle_core.testing.tolerance import assert_within_spread, sum_tolerance
from twinkle_core.testing.torchrun import thread_env


def run_python(args: list[str], timeout: float) -> Any:
    """Run a Python script as a single process (no torchrun variables), keeping output and wall time."""
    env = {**os.environ, **thread_env(), "WORLD_SIZE": "1"}
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


PARITY = Path(__file__).resolve().parent / "scripts" / "parity.py"


class ParityRuns:
    """Runs ``scripts/parity.py`` once per configuration (cached for the module) and keeps the JSON results."""

    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.env = env
        self.results: dict[str, dict[str, Any]] = {}
        self.logs: dict[str, str] = {}

    def get(self, key: str, *args: str, nproc: int = 2) -> dict[str, Any]:
        if key not in self.results:
            from distributed import run_torchrun

            out = self.root / f"{key}.json"
            if nproc == 1:
                result = run_python([str(PARITY), str(out), *args], timeout=300)
            else:
                result = run_torchrun([str(PARITY), str(out), *args], nproc=nproc, timeout=300, env=self.env)
            assert result.returncode == 0, result.output
            self.results[key] = json.loads(out.read_text())
            self.results[key]["seconds"] = result.seconds
            self.logs[key] = result.stdout + result.stderr
        return self.results[key]

    def single(self) -> dict[str, Any]:
        return self.get("single", nproc=1)

    def reordered(self) -> dict[str, Any]:
        """The single-process reference with every batch's rows reversed: its own float spread."""
        return self.get("single-reversed", "--reverse-rows", nproc=1)

    def assert_matches_single(self, run: dict[str, Any], what: str) -> float:
        return assert_same_run(self.single(), run, what, self.reordered())


def assert_same_run(reference: dict[str, Any], other: dict[str, Any], what: str,
                    reordered: dict[str, Any]) -> float:
    """Both runs have 10 steps whose losses and grad norms agree within the reference's own spread.

    ``reordered`` is the reference run again with its rows reversed (``parity.py --reverse-rows``):
    see ``twinkle_core.testing.tolerance``. The floors are the rounding bounds of the step's loss
    (a mean over its tokens) and of the squared gradient norm (a sum over every parameter)."""
    assert len(other["losses"]) == len(reference["losses"]) == len(reordered["losses"]) == 10
    loss_floor = sum_tolerance(reference["tokens_per_step"], max(map(abs, reference["losses"])))
    norm_floor = sum_tolerance(reference["global_numel"], max(reference["grad_norms"]))
    delta = assert_within_spread(f"{what}: losses", other["losses"], reference["losses"], reordered["losses"],
                                 floor=loss_floor)
    assert_within_spread(f"{what}: pre-clip grad norms", other["grad_norms"], reference["grad_norms"],
                         reordered["grad_norms"], floor=norm_floor)
    return delta
