"""Run a torchrun job from a test: free loopback port, hard timeout, whole process group killed on timeout.

    from torchrun_job import torchrun
    result = torchrun(["-m", "pytest", ...], nproc=2, timeout=240)
    assert result.returncode == 0, result.output
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

_PORT_TAKEN = ("EADDRINUSE", "ddress already in use")


@dataclass
class Job:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return f"$ {' '.join(self.args)}\n--- stdout ---\n{self.stdout[-20000:]}\n--- stderr ---\n{self.stderr[-20000:]}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(args: Sequence[str], nproc: int = 2, timeout: float = 240.0, env: dict[str, str] | None = None,
             retries: int = 2) -> Job:
    """``torchrun --nproc-per-node nproc args`` on 127.0.0.1; never raises on failure (check ``returncode``)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONWARNINGS": "ignore", **(env or {})}
    shared = tempfile.mkdtemp(prefix="twinkle-megatron-")
    full_env.setdefault("TWINKLE_SHARED_TMP", shared)
    try:
        for attempt in range(retries + 1):
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
                       "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *map(str, args)]
            start = time.monotonic()
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                                    start_new_session=True)
            try:
                stdout, stderr = proc.communicate(timeout=timeout)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
                code, stderr = -signal.SIGKILL, f"{stderr}\n[torchrun] killed after {timeout:.0f} s"
            job = Job(command, code, stdout, stderr, time.monotonic() - start)
            if code == 0 or attempt == retries or not any(s in stdout + stderr for s in _PORT_TAKEN):
                return job
        return job
    finally:
        import shutil

        shutil.rmtree(shared, ignore_errors=True)
