"""(l) The Ray runtime's overhead on an SFT step: ``twinkle train --runtime ray --num-workers 2`` against
``--nproc-per-node 2`` (torchrun), the same recipe, the same 2 CPU ranks (gloo, DDP).

The quickstart recipe, ``--steps`` optimizer steps of ``data.batch_size`` rows, run as users run it (a subprocess
of the ``twinkle`` command each). The runs alternate (torchrun, ray, torchrun, ray ...) so a change of machine load
hits both alike. Per run: the step time is the median interval between consecutive step log lines after the
first ``--skip`` steps (the time of a step as the trainer sees it: data, forward, backward, optimizer, logging),
and the wall time of the whole command (start-up of the cluster or of torchrun included). Reported: the medians
of each runtime, the Ray / torchrun ratio of step time (target <= 1.10) and the start-up difference.

    python bench/ray_runtime.py --steps 40 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "quickstart" / "recipe.yaml"


def run(runtime: str, out: Path, steps: int, batch_size: int) -> tuple[list[float], float]:
    launch = (["--runtime", "ray", "--num-workers", "2"] if runtime == "ray" else
              ["--nproc-per-node", "2", "--master-addr", "127.0.0.1"])
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "RAY_ADDRESS")}
    env.update({"HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1", "TOKENIZERS_PARALLELISM": "false",
                "TWINKLE_TENSORBOARD": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(RECIPE), f"train.output_dir={out}",
                    f"train.max_steps={steps}", "train.log_every=1", "train.save_every=null",
                    "train.eval_before_training=false", "train.eval_every=null", "train.evaluate_options.limit=2",
                    "strategy.name=ddp", f"data.batch_size={batch_size}", *launch],
                   check=True, capture_output=True, env=env)
    wall = time.perf_counter() - start
    lines = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines() if line.strip()]
    times = [line["elapsed_s"] for line in lines if line.get("event") == "train"]
    return [b - a for a, b in zip(times, times[1:])], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="steps left out of the step time (warm-up)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per rank per step")
    args = parser.parse_args()
    steps: dict[str, list[float]] = {"torchrun": [], "ray": []}
    walls: dict[str, list[float]] = {"torchrun": [], "ray": []}
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            for runtime in ("torchrun", "ray"):
                intervals, wall = run(runtime, Path(root) / f"{runtime}-{repeat}", args.steps, args.batch_size)
                steps[runtime] += intervals[args.skip:]
                walls[runtime].append(wall)
    step_ms = {k: 1000 * statistics.median(v) for k, v in steps.items()}
    wall_s = {k: statistics.median(v) for k, v in walls.items()}
    result = {"steps": args.steps, "repeats": args.repeats, "batch_size_per_rank": args.batch_size,
              "step_ms": step_ms, "ratio_ray_over_torchrun": step_ms["ray"] / step_ms["torchrun"],
              "wall_s": wall_s, "startup_difference_s": wall_s["ray"] - wall_s["torchrun"]}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
