"""Shared helpers of the benchmark scripts: thread pinning, the benchmark model, statistics,
load monitoring and result files.

Every script records the machine's load (``os.getloadavg()`` at start and end, plus samples taken
while it runs) and the share of the wall time the process actually got on its CPUs, so that a noisy
run is visible in its JSON file.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
QUICKSTART = ROOT / "examples" / "quickstart"

# The benchmark model: a Qwen2-architecture decoder built from a config (random init, no download).
# Big enough that a training step is dominated by matmuls, small enough to train on 1-2 CPU cores.
BENCH_MODEL = {
    "model_type": "qwen2",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}

# A much smaller model of the same architecture: per-step compute is tiny, so the fixed per-step cost
# of the framework (Python bookkeeping, extra passes over the gradients) stands out.
OVERHEAD_MODEL = {**BENCH_MODEL, "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def set_threads(n: int) -> int:
    """Pin torch (and the BLAS/OpenMP pools) to ``n`` threads; call before any torch work.

    On a shared machine more OpenMP threads than free cores is disastrous (spinning threads wait on
    each other: 2 threads on 2 busy cores measured 5-15x slower than 1 thread), so the default of the
    scripts is 1 thread; pass ``--threads 2`` on an idle 2-core machine.
    """
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (or parallel work already started)
        pass
    return torch.get_num_threads()


def hf_config(spec: dict[str, Any]) -> Any:
    import transformers

    spec = dict(spec)
    return transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)


def build_hf_model(spec: dict[str, Any], seed: int) -> Any:
    """The plain Transformers model exactly as ``TransformersModel`` builds it (same seed, same init)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    module = transformers.AutoModelForCausalLM.from_config(hf_config(spec), dtype=torch.float32)
    module.config.use_cache = False
    return module


def count_parameters(spec: dict[str, Any]) -> int:
    import torch

    with torch.device("meta"):
        module = build_hf_model(spec, 0)
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------------- statistics
def stats(values: list[float]) -> dict[str, float]:
    """Median and spread of ``values``: min/max, quartiles and the relative IQR (IQR / median)."""
    v = sorted(float(x) for x in values)
    if not v:
        return {"n": 0}
    n = len(v)
    med = statistics.median(v)
    if n >= 4:
        q = statistics.quantiles(v, n=4, method="inclusive")
        p25, p75 = q[0], q[2]
    else:
        p25, p75 = v[0], v[-1]
    return {"n": n, "median": med, "mean": statistics.fmean(v), "min": v[0], "max": v[-1],
            "p25": p25, "p75": p75, "rel_iqr": (p75 - p25) / med if med else float("nan")}


def fmt(x: float, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}" if abs(x) < 1 else f"{x:.{max(digits - len(str(int(abs(x)))), 0) + 1}f}"


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda items: "| " + " | ".join(s.ljust(w) for s, w in zip(items, widths)) + " |"  # noqa: E731
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


# ---------------------------------------------------------------------- load monitoring
class LoadMonitor:
    """Samples the 1-minute load average every ``interval`` seconds and measures how much CPU time
    this process got per second of wall time (``cpu_share``: 1.0 = one core fully ours)."""

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LoadMonitor:
        self.start_load = os.getloadavg()
        self.samples.append(self.start_load[0])
        self.wall0, self.cpu0 = time.perf_counter(), self._cpu()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _cpu() -> float:
        """CPU seconds of this process and of its finished child processes."""
        import resource

        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + kids.ru_utime + kids.ru_stime

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(os.getloadavg()[0])

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.end_load = os.getloadavg()
        self.samples.append(self.end_load[0])
        self.wall = time.perf_counter() - self.wall0
        self.cpu = self._cpu() - self.cpu0

    def summary(self) -> dict[str, Any]:
        return {
            "loadavg_start": [round(x, 2) for x in self.start_load],
            "loadavg_end": [round(x, 2) for x in self.end_load],
            "loadavg_1min_samples": {"min": round(min(self.samples), 2), "max": round(max(self.samples), 2),
                                     "mean": round(statistics.fmean(self.samples), 2), "n": len(self.samples)},
            "cpu_count": os.cpu_count(),
            "wall_s": round(self.wall, 2),
            "process_cpu_s": round(self.cpu, 2),
            "cpu_share": round(self.cpu / self.wall, 3) if self.wall else None,
        }

    def short(self) -> str:
        s = self.summary()
        return (f"load avg (1/5/15 min) start {s['loadavg_start']} end {s['loadavg_end']}, "
                f"1-min range {s['loadavg_1min_samples']['min']}-{s['loadavg_1min_samples']['max']} on "
                f"{s['cpu_count']} cores; this process (and its children) got {s['cpu_share']} CPU-s per wall-s")


def environment() -> dict[str, Any]:
    import torch
    import transformers

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu": cpu, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}
    try:
        import peft

        info["peft"] = peft.__version__
    except ImportError:
        pass
    return info


def write_result(name: str, payload: dict[str, Any], monitor: LoadMonitor | None = None,
                 out_dir: str | os.PathLike[str] | None = None) -> Path:
    directory = Path(out_dir) if out_dir else RESULTS
    directory.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "timestamp": _dt.datetime.now().isoformat(timespec="seconds"), "environment": environment(),
              **({"load": monitor.summary()} if monitor is not None else {}), **payload}
    path = directory / f"{name}.json"
    path.write_text(json.dumps(record, indent=2, default=float) + "\n")
    return path


def add_common_args(parser: Any, *, repeats: int) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (< 20 s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads, the same for every contender (default 1: robust on a shared machine)")
    parser.add_argument("--repeats", type=int, default=None, help=f"measurement repeats (default {repeats})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None, help="where the JSON goes (default bench/results)")
