"""FSDP2 drift: the same recipe in one process and under ``native_fsdp`` (or ``ddp``) on 2 processes, step by step.

The question (issue "FSDP2 drifts"): do the two runs differ because the distributed run adds its sums in another
order (rounding noise that training amplifies: chaos), or because something computes a different update (a defect:
optimizer state, clipping, weight decay on shards, the fused kernel on DTensor)? Rounding noise shrinks with the
unit roundoff, a defect does not: so the same pair of runs is made in float32 and in float64, and the per-step
relative differences of the loss and of the pre-clip gradient norm are printed side by side.

    python bench/fsdp2_drift.py                   # float32 and float64, single vs native_fsdp(2): the table
    python bench/fsdp2_drift.py --steps 60 --strategies native_fsdp ddp --dtypes float64
    python bench/fsdp2_drift.py --compare DIR_A DIR_B   # the table of two runs' logs.jsonl

Each run is ``twinkle train`` of the recipe (``examples/fsdp2_full/recipe.yaml``; the single-process run sets
``strategy.name=single`` and ``data.batch_size=32``, the same 32 chats per step) with two changes made by this
script in the training processes only: float64 weights when asked (``build_network`` returns ``module.double()``;
the cross-entropy keeps float64 logits), and unrounded ``loss`` / ``grad_norm`` in ``logs.jsonl`` (the step log
rounds to 6 digits, which would hide the first differences).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "fsdp2_full" / "recipe.yaml"
#: the training loop's settings for a comparison: every step logged, no evaluation, no checkpoint
RUN_OVERRIDES = ("train.log_every=1", "train.save_every=100000", "train.eval_before_training=false",
                 "train.evaluate_options=null")


# ---------------------------------------------------------------------- inside a training process
def worker(args: argparse.Namespace) -> None:
    """One rank of one run: ``twinkle_core.train.train`` with float64 weights (optional) and unrounded logs."""
    import torch
    from twinkle_backend_hf.model import TransformersModel

    from twinkle_core.train import step_log
    from twinkle_core.train.loop import train

    step_log.rounded = lambda value, digits=6: value  # full precision: the first differences are ~1e-7 relative
    if args.dtype == "float64":
        build = TransformersModel.build_network

        def build_double(self: Any) -> torch.nn.Module:
            return build(self).to(torch.float64)

        TransformersModel.build_network = build_double
    torch.set_num_threads(1)
    train(str(args.recipe), overrides=list(args.overrides), overwrite=True)


# ---------------------------------------------------------------------- orchestration
def launch(recipe: Path, out: Path, strategy: str, dtype: str, steps: int, nproc: int,
           extra: list[str], timeout: float) -> Path:
    """Run one configuration; return its ``logs.jsonl``."""
    overrides = [*RUN_OVERRIDES, f"train.max_steps={steps}", f"train.output_dir={out}", f"strategy.name={strategy}",
                 *extra]
    if strategy == "single":
        overrides += ["data.batch_size=32", "strategy.options={}"]
    elif strategy != "native_fsdp":
        overrides += ["strategy.options={}"]
    script = [str(Path(__file__).resolve()), "--worker", "--recipe", str(recipe), "--dtype", dtype, "--", *overrides]
    if nproc == 1:
        command = [sys.executable, *script]
    else:
        from twinkle_core.testing.torchrun import free_port

        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TWINKLE_NO_PROGRESS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=True,
                       cwd=str(ROOT))
    return out / "logs.jsonl"


def read_steps(path: Path) -> dict[int, dict[str, Any]]:
    with open(path) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return {row["step"]: row for row in rows if row.get("event") == "train"}


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-300)


def table(reference: dict[int, dict[str, Any]], other: dict[int, dict[str, Any]]) -> list[dict[str, float]]:
    return [{"step": step, "loss_ref": reference[step]["loss"], "loss": other[step]["loss"],
             "loss_rel": relative(reference[step]["loss"], other[step]["loss"]),
             "norm_ref": reference[step]["grad_norm"], "norm": other[step]["grad_norm"],
             "norm_rel": relative(reference[step]["grad_norm"], other[step]["grad_norm"])}
            for step in sorted(set(reference) & set(other))]


def print_table(title: str, rows: list[dict[str, float]]) -> None:
    print(f"\n{title}")
    print(f"{'step':>5} {'loss (single)':>15} {'loss (other)':>15} {'rel diff':>9}   "
          f"{'norm (single)':>13} {'norm (other)':>13} {'rel diff':>9}")
    for r in rows:
        print(f"{r['step']:5d} {r['loss_ref']:15.10f} {r['loss']:15.10f} {r['loss_rel']:9.2e}   "
              f"{r['norm_ref']:13.8f} {r['norm']:13.8f} {r['norm_rel']:9.2e}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"], choices=["float32", "float64"])
    parser.add_argument("--strategies", nargs="*", default=["native_fsdp"],
                        help="the 2-process strategies compared with the single process (native_fsdp, ddp; none: only the "
                             "single-process run)")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("RUN_A", "RUN_B"),
                        help="only print the table of two existing runs (directories holding logs.jsonl)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="recipe overrides (KEY=VALUE) for every run")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.compare:
        a, b = (read_steps(path / "logs.jsonl") for path in args.compare)
        print_table(f"{args.compare[0]} vs {args.compare[1]}", table(a, b))
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="fsdp2-drift-"))
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    for dtype in args.dtypes:
        single = read_steps(launch(args.recipe, out / f"single-{dtype}", "single", dtype, args.steps, 1,
                                   args.overrides, args.timeout))
        for strategy in args.strategies:
            other = read_steps(launch(args.recipe, out / f"{strategy}-{dtype}", strategy, dtype, args.steps, 2,
                                      args.overrides, args.timeout))
            rows = table(single, other)
            print_table(f"{dtype}: single vs {strategy} on 2 processes", rows)
            summary[f"{strategy}-{dtype}"] = rows
    (out / "drift.json").write_text(json.dumps(summary, indent=1))
    print(f"\nruns and drift.json in {out}")


if __name__ == "__main__":
    main()
