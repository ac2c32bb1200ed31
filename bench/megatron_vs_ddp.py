"""(h) Megatron tensor parallelism (TP=2) vs Hugging Face DDP on 2 ranks: step time and where it goes.

Contenders, both on the same 2 CPU ranks, in the same ``torchrun`` job, over the same process group: gloo, with
all-reduces and all-gathers through shared memory (``twinkle_core.shm_collectives``, the default of a CPU job on one host;
``--shm-collectives off``: gloo's own all-reduce over loopback TCP for both):

* ``megatron`` - ``MegatronModel`` (megatron-core ``GPTModel``), strategy ``megatron``, mesh ``tp=2``: every
  rank holds half of every weight matrix and computes the whole global batch; activations are
  all-reduced inside every layer; the loss takes each rank's vocabulary slice of the logits
  (``--vocab-parallel-loss off``: the logits are gathered over the TP ranks first);
* ``ddp``      - ``TransformersModel``, strategy ``ddp`` (torch ``DistributedDataParallel``): every rank
  holds the whole model and computes half of the global batch's rows; gradients are all-reduced
  (bucketed, overlapping the backward pass).

Same model (the Qwen2 benchmark config of ``_common.BENCH_MODEL``, built from the same seed, so the
same initial weights in both), same global batch every step (``--batch-size`` rows x ``--seq-len``
tokens, a quarter of every row masked as prompt; DDP ranks take their half with ``local_rows``),
same number of steps, same step::

    forward_backward(cross entropy, mean over the global label tokens) -> clip_grad_and_step(1.0)
    (AdamW lr 1e-3, weight decay 0.01)

Timing: the contenders alternate step by step (A B, then B A, ...) so a change of machine load hits
both alike; every step starts after a barrier, and its time is the slower rank's. Reported: median
ms/step of each, the median of the per-pair ratios Megatron / DDP (target <= 1.15) with quartiles.

Where the time goes: after the timed steps each contender runs ``--profile-steps`` more steps under
``torch.profiler`` (CPU), and every rank splits its profiled step wall time into

* *comm*: the collectives - the union of the intervals of the gloo events (``gloo:all_reduce``,
  ``gloo:all_gather``, ``gloo:broadcast``), which run on gloo's worker thread, and of the shared-memory
  collectives (``twinkle_shm:all_reduce``, ``twinkle_shm:all_gather``), which run on the training thread; this includes the time
  a rank waits for its peer to reach the collective (load imbalance, the other rank being descheduled);
* *exposed comm*: the part of comm during which the training thread runs no ``aten::`` op, i.e. not
  hidden behind computation. Megatron's TP all-reduces are synchronous (the next layer needs their
  result), DDP's gradient all-reduces can overlap the rest of the backward pass;
* *compute*: the union of the ``aten::`` ops on the training thread, outside the shared-memory collectives;
* *other*: the rest (Python, framework bookkeeping, op dispatch).

Shares are of the profiled step (mean over the ranks); the profiler itself slows steps down.

Sanity: the per-step losses of both (``calculate_metric()['loss']``, the global mean) should agree;
the max |difference| is recorded (the tests check 1e-5 on a tinier model, fp32).

    python bench/megatron_vs_ddp.py            # default (~1-2 min on 2 cores)
    python bench/megatron_vs_ddp.py --quick    # smoke run (< 1 min)
    python bench/megatron_vs_ddp.py --vocab-parallel-loss off   # Megatron's loss on gathered logits
    python bench/megatron_vs_ddp.py --shm-collectives off       # both over gloo's loopback all-reduce

Run without ``torchrun``: the script starts its own 2-rank ``torchrun`` job (gloo, 127.0.0.1) and
records the machine's load around it. Each rank runs ``--threads`` torch threads (default 1: the 2
ranks then use the 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

LR, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-3, 0.01, 1.0
PROMPT_FRACTION = 0.25
TARGET_RATIO_MAX = 1.15
NPROC = 2

#: the prefix of the profiler events of the shared-memory collectives (twinkle_core.shm_collectives)
SHM_EVENT = "twinkle_shm:"
#: profiler event names counted as communication (gloo's collectives and the c10d ops launching/waiting on them)
COMM_PATTERN = re.compile(r"gloo:|c10d::|nccl:|all_reduce|allreduce|all_gather|allgather|reduce_scatter|"
                          r"broadcast|_reduce_scatter_base|_allgather_base|barrier", re.IGNORECASE)


# ====================================================================== worker (one per rank, under torchrun)
def make_batches(spec: dict[str, Any], batch_size: int, seq_len: int, count: int, seed: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(count):
        # token 0 is the config's pad_token_id: the HF embedding keeps its row's gradient at zero (padding_idx),
        # megatron-core's embedding does not, so the data leaves it out (otherwise the two runs differ by design)
        ids = torch.randint(1, spec["vocab_size"], (batch_size, seq_len), generator=g)
        labels = ids.clone()
        labels[:, : max(1, int(seq_len * PROMPT_FRACTION))] = -100
        batches.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)})
    return batches


class Contender:
    def __init__(self, name: str, model: Any) -> None:
        from twinkle_core.testing.conformance import local_rows

        self.name, self.model, self.local_rows = name, model, local_rows
        model.set_loss("cross_entropy")
        model.set_optimizer("AdamW", lr=LR, weight_decay=WEIGHT_DECAY)

    def step(self, batch: dict) -> None:
        self.model.forward_backward(inputs=self.local_rows(self.model, batch))
        self.model.clip_grad_and_step(max_grad_norm=MAX_GRAD_NORM)

    def loss(self) -> float:
        return float(self.model.calculate_metric()["loss"])


def build(name: str, seed: int, vocab_parallel_loss: bool = True) -> Contender:
    if name == "megatron":
        from twinkle_backend_megatron.model import MegatronModel

        model = MegatronModel(config=dict(C.BENCH_MODEL), seed=seed, strategy="megatron", mesh={"tp": NPROC},
                              strategy_options={"vocab_parallel_loss": vocab_parallel_loss})
    else:
        from twinkle_backend_hf.model import TransformersModel

        model = TransformersModel(config=dict(C.BENCH_MODEL), seed=seed, strategy="ddp")
    return Contender(name, model)


def timed_step(c: Contender, batch: dict) -> float:
    """One step after a barrier; the slower rank's wall time."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    c.step(batch)
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def profile(c: Contender, batches: list[dict], steps: int, offset: int) -> dict[str, Any]:
    """``steps`` steps under torch.profiler: per-step wall, communication and compute time on this rank (see the
    module doc)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    dist.barrier()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            c.step(batches[(offset + i) % len(batches)])
        wall = time.perf_counter() - t0
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    main_tid = _main_thread(events)
    comm_ops: dict[str, dict[str, Any]] = {}
    for e in events:
        if COMM_PATTERN.search(e.name):
            item = comm_ops.setdefault(e.name, {"count": 0, "us": 0.0,
                                                "thread": "main" if e.thread == main_tid else "gloo worker"})
            item["count"] += 1
            item["us"] += e.time_range.end - e.time_range.start
    # gloo runs its collectives on its worker thread; the shared-memory all-reduce runs on the training thread,
    # and the aten ops inside it (copies into the slots, the sums) are communication, not computation
    in_shm = _union([(e.time_range.start, e.time_range.end) for e in events
                     if e.thread == main_tid and e.name.startswith(SHM_EVENT)])
    comm = _union([(e.time_range.start, e.time_range.end) for e in events
                   if e.thread != main_tid and COMM_PATTERN.search(e.name)] + in_shm)
    compute = _subtract(_union([(e.time_range.start, e.time_range.end) for e in events
                                if e.thread == main_tid and e.name.startswith("aten::")]), in_shm)
    exposed = _length(comm) - _length(_intersect(comm, compute))
    per_step = lambda us: us / steps / 1e3  # noqa: E731
    top = sorted((a for a in prof.key_averages() if a.key.startswith("aten::")), key=lambda a: -a.self_cpu_time_total)
    return {"steps": steps, "step_ms": wall * 1e3 / steps,
            "comm_ms_per_step": per_step(_length(comm)),
            "exposed_comm_ms_per_step": per_step(exposed),
            "compute_ms_per_step": per_step(_length(compute)),
            "comm_ops": {k: {"count_per_step": v["count"] / steps, "ms_per_step": per_step(v["us"]),
                             "thread": v["thread"]}
                         for k, v in sorted(comm_ops.items(), key=lambda kv: -kv[1]["us"])},
            "top_aten_ops_self_ms_per_step": {a.key: per_step(a.self_cpu_time_total) for a in top[:10]}}


def _main_thread(events: list[Any]) -> int:
    """The thread that ran the most top-level CPU time (the training loop's)."""
    per: dict[int, float] = {}
    for e in events:
        per[e.thread] = per.get(e.thread, 0.0) + e.cpu_time_total
    return max(per, key=per.get)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge intervals (nested or overlapping events count once)."""
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two merged, sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the merged, sorted intervals ``a`` outside those of ``b``."""
    out = []
    for s, e in a:
        for bs, be in b:
            if be <= s or bs >= e:
                continue
            if bs > s:
                out.append((s, bs))
            s = max(s, be)
        if s < e:
            out.append((s, e))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in spans)


def worker(args: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    C.set_threads(args.threads)
    import torch
    import torch.distributed as dist

    from twinkle_core import distributed

    batches = make_batches(C.BENCH_MODEL, args.batch_size, args.seq_len, 4, args.seed)
    t0 = time.perf_counter()
    contenders = [build("megatron", args.seed, args.vocab_parallel_loss == "on"), build("ddp", args.seed)]
    build_s = time.perf_counter() - t0
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    losses: dict[str, list[float]] = {c.name: [] for c in contenders}
    for i in range(args.warmup + args.pairs):
        order = contenders if i % 2 == 0 else contenders[::-1]
        batch = batches[i % len(batches)]
        for c in order:
            dt = timed_step(c, batch)
            losses[c.name].append(c.loss())
            if i >= args.warmup:
                times[c.name].append(dt)
    profiles = {}
    for c in contenders:
        per_rank = distributed.all_gather_object(profile(c, batches, args.profile_steps, args.warmup + args.pairs))
        profiles[c.name] = per_rank
    with torch.no_grad():  # both models must still hold the same weights
        a = contenders[0].model.get_state_dict()
        b = contenders[1].model.get_state_dict()
        param_diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in b if k in a)
        compared = sum(1 for k in b if k in a)
    if distributed.is_main_process():
        raw = {"times": times, "losses": losses, "profiles": profiles, "build_s": build_s,
               "final_weights_max_abs_diff": param_diff, "weights_compared": compared,
               "world_size": distributed.world_size(), "threads_per_rank": torch.get_num_threads(),
               "process_group_backend": dist.get_backend()}
        Path(args.raw_out).write_text(json.dumps(raw))


# ====================================================================== driver (no torchrun)
def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    mt, dd = raw["times"]["megatron"], raw["times"]["ddp"]
    ratios = [a / b for a, b in zip(mt, dd)]
    loss_diff = max(abs(a - b) for a, b in zip(raw["losses"]["megatron"], raw["losses"]["ddp"]))
    where: dict[str, Any] = {}
    for name, per_rank in raw["profiles"].items():
        step, comm, exposed, compute = (C.stats([p[key] for p in per_rank])["mean"]  # mean over the ranks
                                        for key in ("step_ms", "comm_ms_per_step", "exposed_comm_ms_per_step",
                                                    "compute_ms_per_step"))
        where[name] = {"profiled_step_ms": step, "comm_ms_per_step": comm, "comm_share": comm / step,
                       "exposed_comm_ms_per_step": exposed, "exposed_comm_share": exposed / step,
                       "compute_ms_per_step": compute, "compute_share": compute / step,
                       "other_ms_per_step": step - compute - exposed,
                       "other_share": (step - compute - exposed) / step,
                       "per_rank": [{k: v for k, v in p.items() if k not in ("comm_ops", "top_aten_ops_self_ms_per_step")}
                                    for p in per_rank],
                       "comm_ops_rank0": dict(list(per_rank[0]["comm_ops"].items())[:8]),
                       "top_aten_ops_rank0": per_rank[0]["top_aten_ops_self_ms_per_step"]}
    return {
        "megatron_ms": C.stats([t * 1e3 for t in mt]),
        "ddp_ms": C.stats([t * 1e3 for t in dd]),
        "paired_ratio": C.stats(ratios),
        "ratio_of_medians": C.stats(mt)["median"] / C.stats(dd)["median"],
        "where_time_goes": where,
        "max_abs_loss_diff": loss_diff,
        "losses": raw["losses"],
        "abs_loss_diff_per_step": [abs(a - b) for a, b in zip(raw["losses"]["megatron"], raw["losses"]["ddp"])],
        "final_weights_max_abs_diff": raw["final_weights_max_abs_diff"],
        "weights_compared": raw["weights_compared"],
        "model_build_s": raw["build_s"],
    }


def drive(args: argparse.Namespace, argv: list[str]) -> None:
    from twinkle_core.testing.torchrun import free_port, thread_env

    with tempfile.TemporaryDirectory(prefix="twinkle-bench-") as tmp:
        raw_out = os.path.join(tmp, "raw.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC), "--nnodes", "1",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), os.path.abspath(__file__),
               "--worker", "--raw-out", raw_out, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
               "--pairs", str(args.pairs), "--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps),
               "--threads", str(args.threads), "--seed", str(args.seed),
               "--vocab-parallel-loss", args.vocab_parallel_loss]
        env = {**os.environ, **thread_env(), "OMP_NUM_THREADS": str(args.threads),
               "MKL_NUM_THREADS": str(args.threads), "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false",
               "TWINKLE_SHARED_TMP": tmp, "TWINKLE_NO_PROGRESS": "1",
               "TWINKLE_SHM_COLLECTIVES": "1" if args.shm_collectives == "on" else "0"}
        with C.LoadMonitor() as mon:
            done = subprocess.run(cmd, env=env, cwd=C.ROOT, timeout=args.timeout, check=False)
        if done.returncode != 0 or not os.path.exists(raw_out):
            sys.exit(f"the torchrun job failed (exit {done.returncode})")
        raw = json.loads(Path(raw_out).read_text())
    result = summarise(raw)
    meets = result["paired_ratio"]["median"] <= TARGET_RATIO_MAX
    payload = {
        "question": "step time of Megatron TP=2 vs Hugging Face DDP on 2 ranks, same model, batch and steps "
                    f"(target Megatron / DDP <= {TARGET_RATIO_MAX}); communication vs compute of each",
        "settings": {"quick": args.quick, "ranks": NPROC, "threads_per_rank": raw["threads_per_rank"],
                     "backend": raw["process_group_backend"], "shm_collectives": args.shm_collectives, "batch_size": args.batch_size, "seq_len": args.seq_len,
                     "tokens_per_step": args.batch_size * args.seq_len, "pairs": args.pairs, "warmup": args.warmup,
                     "profile_steps": args.profile_steps, "lr": LR, "weight_decay": WEIGHT_DECAY,
                     "max_grad_norm": MAX_GRAD_NORM, "seed": args.seed,
                     "megatron": "MegatronModel, strategy megatron, mesh {tp: 2}",
                     "vocab_parallel_loss": args.vocab_parallel_loss,
                     "ddp": "TransformersModel, strategy ddp (2 data-parallel ranks)"},
        "model": {"config": C.BENCH_MODEL, "parameters": C.count_parameters(C.BENCH_MODEL)},
        "result": result,
        "time_split_definition": {
            "comm": "per step, the union of the intervals of the collective events torch.profiler records off "
                    "the training thread (gloo's worker: gloo:all_reduce, gloo:all_gather, gloo:broadcast ...) "
                    f"and of the shared-memory collectives on the training thread ({SHM_EVENT}*); includes the time "
                    "a rank waits for its peer to reach the collective",
            "exposed_comm": "the part of comm during which the training thread runs no aten:: op (not hidden "
                            "behind computation)",
            "compute": "per step, the union of the aten:: ops on the training thread outside the shared-memory "
                       "collectives",
            "other": "step wall - compute - exposed comm: Python, framework bookkeeping, dispatch",
            "shares": "of the profiled step wall time; mean over the ranks"},
        "target_ratio_max": TARGET_RATIO_MAX,
        "meets_target": meets,
    }
    path = C.write_result("megatron_vs_ddp", payload, mon, out_dir=args.out_dir)
    r = result
    rows = [[name, C.fmt(r[f"{name}_ms"]["median"]), f"{C.fmt(r[f'{name}_ms']['p25'])}-{C.fmt(r[f'{name}_ms']['p75'])}",
             C.fmt(w["profiled_step_ms"]), f"{C.fmt(w['comm_ms_per_step'])} ({100 * w['comm_share']:.0f}%)",
             f"{C.fmt(w['exposed_comm_ms_per_step'])} ({100 * w['exposed_comm_share']:.0f}%)",
             f"{C.fmt(w['compute_ms_per_step'])} ({100 * w['compute_share']:.0f}%)",
             f"{C.fmt(w['other_ms_per_step'])} ({100 * w['other_share']:.0f}%)"]
            for name, w in r["where_time_goes"].items()]
    print(C.markdown_table(["contender", "ms/step (median)", "p25-p75", "profiled ms/step", "comm", "exposed comm",
                            "compute (aten)", "other"], rows))
    pr = r["paired_ratio"]
    print(f"Megatron / DDP per-step ratio: median {pr['median']:.3f} [{pr['p25']:.3f}, {pr['p75']:.3f}] "
          f"(target <= {TARGET_RATIO_MAX}: {'met' if meets else 'NOT met'}); ratio of medians "
          f"{r['ratio_of_medians']:.3f}")
    print(f"max |loss diff| over {len(raw['losses']['ddp'])} steps {r['max_abs_loss_diff']:.1e}; final weights "
          f"max |diff| {r['final_weights_max_abs_diff']:.1e} ({r['weights_compared']} tensors)")
    print(mon.short())
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(parser, repeats=30)
    parser.add_argument("--batch-size", type=int, default=None, help="global rows per step (default 8)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 128)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--profile-steps", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the torchrun job is killed")
    parser.add_argument("--vocab-parallel-loss", choices=("on", "off"), default="on",
                        help="Megatron's strategy option vocab_parallel_loss: the loss on each rank's vocabulary "
                             "slice (on, the default) or on the gathered logits (off, as before it existed)")
    parser.add_argument("--shm-collectives", choices=("on", "off"), default="on",
                        help="TWINKLE_SHM_COLLECTIVES for both contenders: all-reduces and all-gathers through shared memory (on, "
                             "the default of a gloo job on one host) or over gloo's loopback TCP (off)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--raw-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    q = args.quick
    args.batch_size = args.batch_size or (4 if q else 8)
    args.seq_len = args.seq_len or (64 if q else 128)
    args.pairs = args.pairs or args.repeats or (3 if q else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if q else 3)
    args.profile_steps = args.profile_steps or (2 if q else 5)
    if args.batch_size % NPROC:
        parser.error(f"--batch-size must be a multiple of {NPROC} (DDP splits the rows)")
    if args.worker:
        worker(args)
        from twinkle_core.testing.torchrun import exit_job

        exit_job()
    else:
        drive(args, sys.argv)


if __name__ == "__main__":
    main()
