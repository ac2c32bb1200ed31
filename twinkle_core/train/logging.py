"""Training logs: one JSON object per line in ``output_dir/logs.jsonl``, and TensorBoard when installed.

Each line carries ``event`` (``train`` or ``eval``), ``step`` and the values, e.g.::

    {"event": "train", "step": 10, "epoch": 0, "loss": 2.31, "lr": 9.8e-05, "grad_norm": 1.7,
     "tokens_per_s": 5120.4, "batch_time_s": 0.4, "train_tokens_per_s": 5290.1, "elapsed_s": 12.9,
     "time": 1718000000.1}

``tokens_per_s`` counts the input tokens over the whole interval; ``train_tokens_per_s`` over the interval less
``batch_time_s``, the time spent making batches (for an RL task: sampling, rewards and reference passes).

Only the main process writes. The file is appended to, so a resumed run continues the same log.

Besides the JSONL file, every numeric value of a line goes to the run's experiment trackers
(:mod:`twinkle_core.trackers`, ``train.report_to`` in a recipe) as ``<event>/<key>`` at ``step``. Without
``report_to``, TensorBoard (``output_dir/tensorboard``) is used when ``tensorboard`` is importable, unless
``TWINKLE_TENSORBOARD=0``.

Start-up timing: :class:`StartupTimer` measures where the time before the first optimizer step goes
(Python start-up, plugin discovery, recipe validation, tokenizer, data, model, the first step ...).
The loop puts it in the run's summary (``summary["startup"]``, also in ``summary.json``) and logs it
at debug level (``TWINKLE_LOG_LEVEL=DEBUG twinkle train ...``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from twinkle_core.trackers import TrackerSet, open_trackers

logger = logging.getLogger("twinkle.train")

LOG_FILE = "logs.jsonl"


def json_safe(value: Any) -> Any:
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
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)


class TrainLogger:
    """Writes JSONL (always) and sends the numeric values to the experiment trackers, on the main process.

    ``report_to`` / ``tracker_options``: as ``train.report_to`` / ``train.tracker_options`` in a recipe
    (``None``: TensorBoard when installed); ``tensorboard=False`` (or ``True``) is the older switch for that default.
    ``run_config`` is logged by each tracker as the run's params (the recipe as a dict). A tracker that cannot start
    raises here (:class:`twinkle_core.trackers.TrackerError`), before any step.
    """

    def __init__(self, output_dir: str | os.PathLike[str], *, enabled: bool = True,
                 tensorboard: bool | None = None, report_to: Any = None,
                 tracker_options: dict[str, Any] | None = None, run_config: dict[str, Any] | None = None,
                 run_name: str | None = None) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / LOG_FILE
        self._file = None
        self.trackers = TrackerSet()
        self.status = "success"
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if report_to is None and tensorboard is not None:
            report_to = ["tensorboard"] if tensorboard and self._tensorboard_installed() else []
        self.trackers = open_trackers(report_to, tracker_options, run_config=json_safe(run_config or {}),
                                      output_dir=output_dir, run_name=run_name)
        self._file = open(self.path, "a", encoding="utf-8")

    @classmethod
    def for_recipe(cls, recipe: Any, *, enabled: bool = True) -> TrainLogger:
        """The logger of a run of ``recipe``: its ``train.report_to`` trackers, with the recipe as the run config."""
        import dataclasses

        t = recipe.train
        return cls(t.output_dir, enabled=enabled, report_to=getattr(t, "report_to", None),
                   tracker_options=getattr(t, "tracker_options", None), run_config=dataclasses.asdict(recipe))

    @staticmethod
    def _tensorboard_installed() -> bool:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            logger.debug("tensorboard is not installed (pip install tensorboard); logging to JSONL only")
            return False
        return True

    def log(self, event: str, step: int, values: dict[str, Any]) -> dict[str, Any]:
        record = {"event": event, "step": int(step), **{k: json_safe(v) for k, v in values.items()},
                  "time": round(time.time(), 3)}
        if not self.enabled or self._file is None:
            return record
        self._file.write(json.dumps(record, sort_keys=False) + "\n")
        self._file.flush()
        if self.trackers:
            self.trackers.log(_scalars(event, record), int(step))
        return record

    def failed(self, exc: BaseException | None = None) -> None:
        """Mark the run as ended by ``exc``: the trackers finish it as ``interrupted`` or ``failed``."""
        self.status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"

    def close(self, status: str | None = None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.trackers.finish(status or self.status)

    def __enter__(self) -> TrainLogger:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None:
            self.failed(exc)
        self.close()


def _scalars(event: str, record: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a log line, keyed ``<event>/<key>`` (nested mappings: ``<event>/<key>/<sub>``)."""
    out: dict[str, float] = {}

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                add(f"{prefix}/{key}", item)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[prefix] = value

    for key, value in record.items():
        if key not in ("event", "step", "time"):
            add(f"{event}/{key}", value)
    return out


def read_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``logs.jsonl`` file (or of ``output_dir/logs.jsonl``)."""
    file = Path(path)
    if file.is_dir():
        file = file / LOG_FILE
    with open(file, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


# ---------------------------------------------------------------------- start-up timing
def process_age() -> float | None:
    """Seconds since this process started (from ``/proc``; None where there is none)."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/uptime", "rb") as fh:
            uptime = float(fh.read().split()[0])
        return max(uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"), 0.0)  # field 22: start time in ticks
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartupTimer:
    """Wall-clock seconds of the phases before the first optimizer step.

    ``since_process_start=True`` (what ``twinkle train`` uses) counts from the start of the process and
    records the time before the timer existed as the phase ``python_startup`` (the interpreter and the
    command's own imports); otherwise the clock starts when the timer is made. A phase entered twice adds up.
    Besides wall-clock seconds it keeps the CPU seconds of this process in each phase (``cpu``), which a
    busy machine changes much less.
    """

    def __init__(self, *, since_process_start: bool = False) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        self.phases: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        age = process_age() if since_process_start else None
        self.origin = now - age if age is not None else now
        self.cpu_origin = 0.0 if age is not None else cpu
        if age is not None:
            self.phases["python_startup"] = age
            self.cpu["python_startup"] = cpu

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start, time.process_time() - cpu)

    def add(self, name: str, seconds: float, cpu_seconds: float = 0.0) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu_seconds

    def report(self) -> dict[str, Any]:
        """``{"phases": {name: s}, "total_s": s, "cpu": {name: CPU s}, "cpu_total_s": CPU s}``, counted from the
        origin; the phases sum to at most the totals (the rest went between phases)."""
        total, cpu_total = time.perf_counter() - self.origin, time.process_time() - self.cpu_origin
        return {"phases": {name: round(seconds, 4) for name, seconds in self.phases.items()},
                "total_s": round(total, 4),
                "cpu": {name: round(seconds, 4) for name, seconds in self.cpu.items()},
                "cpu_total_s": round(cpu_total, 4)}

    @staticmethod
    def format(report: dict[str, Any]) -> str:
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in report["phases"].items())
        return f"{parts}; total {report['total_s']:.2f} s"


_pending_timer: StartupTimer | None = None


def start_startup_timer(*, since_process_start: bool = True) -> StartupTimer:
    """Start timing a run's start-up now (the ``twinkle train`` command does); the next trainer takes it over."""
    global _pending_timer
    _pending_timer = StartupTimer(since_process_start=since_process_start)
    return _pending_timer


def take_startup_timer() -> StartupTimer:
    """The timer :func:`start_startup_timer` started (once), or a new one starting now."""
    global _pending_timer
    timer, _pending_timer = _pending_timer, None
    return timer if timer is not None else StartupTimer()
