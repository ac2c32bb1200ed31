"""Running a test script of ``scripts/`` as one plain process, and reading its constants, for the tests that
compare a single-process reference with the same script under torchrun (``test_backends``,
``test_online_distributed``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from twinkle_core.testing.torchrun import thread_env


def script_module(script: Path, name: str) -> Any:
    """The script as a module (for its constants; the scripts import nothing heavy at module level)."""
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_env() -> dict[str, str]:
    return {"TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1"}


def run_single_process(script: Path, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """The script as one plain process (no torchrun variables); ``.seconds`` is its wall time."""
    env = {**os.environ, **thread_env(), **script_env(), "WORLD_SIZE": "1"}
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    start = time.monotonic()
    try:
        result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                                timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        result = subprocess.CompletedProcess(exc.cmd, -9, exc.stdout or "", f"{exc.stderr or ''}\ntimed out")
    result.seconds = time.monotonic() - start
    return result


def job_output(result: Any) -> str:
    return getattr(result, "output", None) or f"{result.args}\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
