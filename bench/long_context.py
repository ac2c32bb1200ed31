"""Long context: tokens/s and peak memory per rank vs sequence length for Ulysses (sp=2), ring (cp=2) and the
hybrid (sp=2 x cp=2, 4 processes), on this CPU (gloo) with a small Qwen2 (the benchmark model, fp32, sdpa).

Each layout is one ``torchrun`` job (``--worker``): one ``TransformersModel`` with the ``ulysses`` strategy, then
for every sequence length (ascending) one warm-up step and ``steps`` timed steps (``forward_backward`` +
``clip_grad_and_step``, AdamW) on one row of that length. Measured per length: the median step time, tokens/s
(the row's tokens per step / median step time: the whole group works on one row) and the peak RSS per rank above
the rank's RSS after the model was built (``ru_maxrss`` is a high-water mark, so with ascending lengths it is the
peak of that length or an earlier one: the largest rank is reported), beside what :mod:`twinkle_core.memory_model`
estimates for that rank without the weights (gradients, AdamW states, activations, logits, the ring's block
scores; fp32), which the measured peak also holds on top of the baseline.

    python bench/long_context.py            # lengths 1024, 2048, 4096; a few minutes on 2 cores
    python bench/long_context.py --quick    # lengths 256, 512
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import _common as C

LAYOUTS = {"sp2": {"sp": 2}, "cp2": {"cp": 2}, "sp2xcp2": {"cp": 2, "sp": 2}}


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(job: dict[str, Any]) -> None:
    """One rank of a layout's torchrun job; rank 0 writes the results to ``job["out"]``."""
    import torch
    import torch.distributed as dist
    from twinkle_backend_hf.model import TransformersModel
    from twinkle_backend_hf.sequence_parallel.strategy import SequenceParallelStrategy

    from twinkle_core.memory_model import ModelShape, estimate_memory
    from twinkle_core.mesh import DeviceMesh

    C.set_threads(job["threads"])
    mesh = DeviceMesh(**job["mesh"])
    model = TransformersModel(config=job["model"], seed=job["seed"], attn_implementation="sdpa",
                              strategy=SequenceParallelStrategy(mesh=mesh))
    model.set_optimizer("AdamW", lr=1e-4)
    baseline = rss_bytes()
    rows = []
    for length in job["lengths"]:
        g = torch.Generator().manual_seed(job["seed"] + length)
        ids = torch.randint(1, job["model"]["vocab_size"], (1, length), generator=g)
        times = []
        for step in range(job["steps"] + 1):
            t0 = time.perf_counter()
            model.forward_backward(inputs={"input_ids": ids, "labels": ids.clone()})
            model.clip_grad_and_step(max_grad_norm=1.0)
            if step:  # the first step of a length is a warm-up
                times.append(time.perf_counter() - t0)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
        estimate = estimate_memory(ModelShape.from_config(job["model"]), rows=1, seq_len=length, mesh=mesh,
                                   precision="no")  # unfused ring blocks counted: it is Twinkle's ring
        step_s = statistics.median(times)
        rows.append({"seq_len": length, "step_s": step_s, "tokens_per_s": length / step_s,
                     "peak_rss_above_baseline_mib_max_rank": max(peaks) / 2 ** 20,
                     "memory_model_mib": (estimate.total - estimate.parameters) / 2 ** 20,
                     "tokens_per_rank": estimate.tokens_per_rank})
    if dist.get_rank() == 0:
        with open(job["out"], "w") as fh:
            json.dump(rows, fh)


def run_layout(name: str, job: dict[str, Any]) -> list[dict[str, Any]]:
    world = 1
    for size in job["mesh"].values():
        world *= size
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"]), "TWINKLE_NO_PROGRESS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr",
               "127.0.0.1", "--master-port", str(29600 + world + len(name)), __file__, "--worker", json.dumps(job)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=job["timeout"], check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    with open(job["out"]) as fh:
        return json.load(fh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(parser, repeats=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return

    lengths = [256, 512] if args.quick else [1024, 2048, 4096]
    settings = {"quick": args.quick, "threads": args.threads, "seed": args.seed, "rows": 1, "lengths": lengths,
                "steps": args.repeats or 2, "model": C.BENCH_MODEL, "precision": "fp32", "attention": "sdpa"}
    results: dict[str, Any] = {}
    with C.LoadMonitor() as monitor, tempfile.TemporaryDirectory() as scratch:
        for name, mesh in LAYOUTS.items():
            job = {**settings, "mesh": mesh, "out": os.path.join(scratch, f"{name}.json"), "timeout": 900}
            results[name] = {"mesh": mesh, "rows": run_layout(name, job)}
            for row in results[name]["rows"]:
                print(f"{name:8s} seq {row['seq_len']:6d}  {row['tokens_per_s']:8.1f} tokens/s  peak/rank "
                      f"{row['peak_rss_above_baseline_mib_max_rank']:7.1f} MiB  (memory model without the weights: "
                      f"{row['memory_model_mib']:6.1f} MiB)", flush=True)
    payload = {
        "question": "tokens/s and peak memory per rank vs sequence length for Ulysses sp=2, ring cp=2 and the hybrid "
                    "sp=2 x cp=2 (CPU, gloo, fp32, one row per step)",
        "settings": settings, "layouts": results,
        "note": "CPU processes share the machine's cores: with 4 ranks on 2 cores the hybrid's tokens/s measures "
                "contention, not the layout; the memory columns are the point on CPU",
    }
    path = C.write_result("long_context", payload, monitor, args.out_dir)
    print(f"{monitor.summary()}\n-> {path}")


if __name__ == "__main__":
    main()
