"""Launch torchrun jobs from tests: a free loopback port, a hard timeout, output kept for assertion messages.

Shared by every distribution's multi-process tests (and usable by third-party backends)::

    from twinkle_core.testing.torchrun import run_torchrun
    result = run_torchrun(["-m", "pytest", ...], nproc=2, timeout=300)
    assert result.returncode == 0, result.output

``args`` is what follows torchrun's own options (a script path, or ``-m module ...``). With
``per_rank_output=True`` each rank's stdout is captured on its own (torchrun ``--redirects``) into
``result.rank_stdout``, so assertions never have to untangle the ranks' interleaved lines. Each job
gets its own ``TWINKLE_SHARED_TMP`` directory, so concurrent jobs never share checkpoint folders,
and one thread per rank unless ``TWINKLE_TEST_THREADS`` says otherwise (:func:`thread_env`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

#: what torchrun prints when the chosen port was taken between picking and binding it
_PORT_TAKEN = ("EADDRINUSE", "Address already in use", "address already in use")


def thread_env() -> dict[str, str]:
    """``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` for a test's subprocesses: ``TWINKLE_TEST_THREADS`` (default 1).

    CI runs the parity tests once with 1 thread and once with 2, so no tolerance depends on the
    reduction order one thread count happens to give."""
    threads = os.environ.get("TWINKLE_TEST_THREADS", "1")
    if not threads.isdigit() or int(threads) < 1:
        raise ValueError(f"TWINKLE_TEST_THREADS must be a positive integer, got {threads!r}")
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    if int(threads) > 1:
        # several ranks with several threads each oversubscribe a small machine; spinning OpenMP workers
        # would then steal the cores the other rank needs to make progress
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def offline_env() -> dict[str, str]:
    """The environment of a test's example command: this one, less a launcher's rank variables, offline (nothing
    downloads), without progress bars or TensorBoard, with :func:`thread_env`'s threads."""
    variables = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    variables.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1",
                      "TOKENIZERS_PARALLELISM": "false", "TWINKLE_TENSORBOARD": "0", **thread_env()})
    return variables


def run_python(*args: str, timeout: float, cwd: str | os.PathLike[str]) -> subprocess.CompletedProcess:
    """``python *args`` in ``cwd`` with :func:`offline_env`; fails the test with the output's tail unless it
    exits 0 (an example script, or ``-m twinkle_core.cli train ...``)."""
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                            env=offline_env(), cwd=cwd)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return result


def exit_job(code: int = 0) -> None:
    """End a torchrun test script: wait for every rank, flush, and leave without tearing gloo down.

    Once every rank has passed the final barrier nothing is left to do, but the teardown itself can
    still fail: ``destroy_process_group`` on one rank may close gloo's connections while the other rank
    is still finishing that barrier, and at interpreter exit gloo's worker threads may outlive the
    objects they use. Either ends a finished job with SIGABRT ("terminate called without an active
    exception", seen once in CI, not reproduced in 60 runs). ``os._exit`` skips the teardown, after the
    ``atexit`` handlers have run: multiprocessing's among them stops the worker processes a job started
    (Megatron's checkpoint writer), which would otherwise outlive it holding the job's output pipes."""
    import atexit

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TorchrunResult(subprocess.CompletedProcess):
    """A ``CompletedProcess`` with ``output`` (stdout then stderr) and the wall time ``seconds``."""

    seconds: float = 0.0
    #: each local rank's own stdout, in rank order (only with ``per_rank_output=True``)
    rank_stdout: list[str] = []

    @property
    def output(self) -> str:
        ranks = "".join(f"\n--- stdout of rank {r} ---\n{text}" for r, text in enumerate(self.rank_stdout))
        return (f"$ {' '.join(map(str, self.args))}\n--- stdout ---\n{self.stdout}{ranks}\n"
                f"--- stderr ---\n{self.stderr}")


def _read_rank_stdout(log_dir: str, nproc: int) -> list[str]:
    """The ``stdout.log`` torchrun wrote for each local rank under ``log_dir/<run>/attempt_*/<rank>/``."""
    outputs = []
    for rank in range(nproc):
        paths = sorted(glob.glob(os.path.join(log_dir, "*", "attempt_*", str(rank), "stdout.log")))
        outputs.append("".join(Path(path).read_text(encoding="utf-8", errors="replace") for path in paths))
    return outputs


#: a pytest summary line in which every collected test passed (deselected and warnings allowed; no failed / error / skipped)
PASSED_ONLY = re.compile(r"\d+ passed(, \d+ deselected)?(, \d+ warnings?)? in [\d.]+s( \(\S+\))?")


def pytest_summaries(result: TorchrunResult) -> list[str]:
    """The final pytest summary line (``19 passed in 3.2s``) of every rank of a ``per_rank_output`` job.

    A rank that printed none (it crashed or hung) gives ``""``, so ``len()`` is always the rank count.
    """
    summaries = []
    for text in result.rank_stdout:
        lines = re.findall(r"^=*\s*(\d+ (?:passed|failed|error|skipped).*?)\s*=*$", text, flags=re.MULTILINE)
        summaries.append(lines[-1] if lines else "")
    return summaries


def _run_once(command: list[str], env: dict[str, str], cwd: str | None, timeout: float) -> TorchrunResult:
    start = time.monotonic()
    # own session: on timeout the whole job (torchrun and its ranks) is killed, nothing is left behind
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        returncode = -signal.SIGKILL
        stderr = f"{stderr}\n[run_torchrun] killed after the {timeout:.0f} s timeout"
    result = TorchrunResult(command, returncode, stdout, stderr)
    result.seconds = time.monotonic() - start
    return result


def run_torchrun(args: Sequence[str], nproc: int = 2, timeout: float = 300.0, *, env: dict[str, str] | None = None,
                 cwd: str | None = None, retries: int = 2, per_rank_output: bool = False) -> TorchrunResult:
    """Run ``torchrun --nproc-per-node nproc ... args`` on 127.0.0.1 and return its result (never raises on failure).

    A job that runs past ``timeout`` seconds is killed (``returncode`` < 0). When the picked port
    turns out to be taken, the job is retried on another one up to ``retries`` times.
    """
    full_env = {**os.environ, **thread_env(), "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    cleanup: list[str] = []
    if "TWINKLE_SHARED_TMP" not in full_env:
        full_env["TWINKLE_SHARED_TMP"] = tempfile.mkdtemp(prefix="twinkle-torchrun-")
        cleanup.append(full_env["TWINKLE_SHARED_TMP"])
    try:
        for attempt in range(retries + 1):
            logging_args: list[str] = []
            if per_rank_output:
                log_dir = tempfile.mkdtemp(prefix="twinkle-rank-logs-")
                cleanup.append(log_dir)
                logging_args = ["--log-dir", log_dir, "--redirects", "1"]
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                       "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                       *logging_args, *map(str, args)]
            result = _run_once(command, full_env, cwd, timeout)
            if per_rank_output:
                result.rank_stdout = _read_rank_stdout(log_dir, nproc)
            taken = result.returncode != 0 and any(s in result.stderr + result.stdout for s in _PORT_TAKEN)
            if not taken or attempt == retries:
                return result
        return result
    finally:
        import shutil

        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)
