"""(m) GRPO under the Ray runtime vs in process: step time and where each rank's time goes.

The GRPO quickstart (examples/grpo: 16 prompts x 8 completions per step, exact-match reward) from the DPO
quickstart's SFT model (trained first, once), ``--steps`` steps, in four set-ups on the same machine:

* ``in_process``  - one process, the sampler (``hf_generate`` on the policy's own weights) and the reward inside it;
* ``torchrun``    - 2 DDP ranks (8 prompts each), sampler and reward inside each rank (``copy_weights: true``);
* ``ray``         - 2 DDP ranks as Ray actors, the ``ray`` sampler actor (weights pushed over the weight channel
  after every step) and a ``ray_pool`` of 2 reward actors, synchronous;
* ``ray_one_step_off`` - the same, the next rollout sampled while the current one trains.

Reported per set-up: the median step time after ``--skip`` steps (intervals of the step log), the wall time of the
command, and the seconds per rank spent in generation, reward, weight sync and (one step off) waiting for the
rollout, from the train log lines.

    python bench/ray_grpo.py --steps 20
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

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ROLES = ("generation_time_s", "reward_time_s", "weight_sync_time_s", "rollout_wait_s")
RAY_ROLES = ("task_options.sampler={name: ray, inner: {name: hf_generate, copy_weights: true}}",
             "task_options.rewards=[{name: ray_pool, options: {reward: exact_match, options: {field: answer, "
             "normalize: false}, workers: 2}}]", "--runtime", "ray", "--num-workers", "2")
SETUPS = {
    "in_process": ("data.batch_size=16",),
    "torchrun": ("data.batch_size=8", "strategy.name=ddp", "task_options.sampler={name: hf_generate, copy_weights: "
                 "true}", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"),
    "ray": ("data.batch_size=8", "strategy.name=ddp", *RAY_ROLES),
    "ray_one_step_off": ("data.batch_size=8", "strategy.name=ddp", "task_options.one_step_off=true", *RAY_ROLES),
}


def train(recipe: Path, *arguments: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "RAY_ADDRESS")}
    env.update({"HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1", "TOKENIZERS_PARALLELISM": "false",
                "TWINKLE_TENSORBOARD": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(recipe), *arguments], check=True,
                   capture_output=True, env=env)
    return time.perf_counter() - start


def measure(root: Path, name: str, sft: Path, steps: int, skip: int) -> dict:
    out = root / name
    wall = train(EXAMPLES / "grpo" / "recipe.yaml", f"train.output_dir={out}", f"model.model_id={sft}",
                 f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=null",
                 "train.eval_before_training=false", "train.evaluate_options.limit=8", *SETUPS[name])
    lines = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines() if line.strip()]
    train_lines = [line for line in lines if line.get("event") == "train"]
    elapsed = [line["elapsed_s"] for line in train_lines]
    intervals = [b - a for a, b in zip(elapsed, elapsed[1:])][skip:]
    return {"step_s": statistics.median(intervals), "wall_s": wall,
            "per_rank_s": {k: round(sum(line.get(k, 0.0) for line in train_lines[skip + 1:]) / len(intervals), 4)
                           for k in ROLES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=sorted(SETUPS), default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        train(EXAMPLES / "dpo" / "sft.yaml", f"train.output_dir={root / 'sft'}")
        results = {name: measure(root, name, root / "sft" / "final", args.steps, args.skip)
                   for name in (args.only or SETUPS)}
    base = results.get("in_process", {}).get("step_s")
    for result in results.values():
        if base:
            result["step_vs_in_process"] = round(result["step_s"] / base, 3)
    print(json.dumps({"steps": args.steps, "skip": args.skip, "results": results}, indent=2))


if __name__ == "__main__":
    main()
