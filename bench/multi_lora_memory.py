"""(d) Memory of ``MultiLoraTransformersModel`` with 8 tenants vs the base model alone vs 8 full copies.

Scenarios, each in its own fresh Python process (so ``ru_maxrss`` is that scenario's own peak; they
run ``--jobs`` at a time, which changes how long the run takes, not what is measured):

* ``baseline``   - imports (torch, transformers, peft, Twinkle) and nothing else: the interpreter's share.
* ``base``       - the base model alone (``TransformersModel``), one forward under ``no_grad``.
* ``multi_lora`` - ``MultiLoraTransformersModel`` on the same base with ``--tenants`` tenants, each its own
  LoRA adapter (r=8, alpha 16, all attention and MLP projections) and its own AdamW; every tenant is
  trained one step (``forward_backward`` + ``clip_grad_and_step``).
* ``full_1``     - one full fine-tune of the model (``TransformersModel``, AdamW, one step).
* ``full_n``     - ``--tenants`` separate full copies in one process, each with its own AdamW, one step each
  (what serving the tenants without multi-LoRA costs).

Two measures per scenario:

* tracked tensor memory (no tracemalloc): bytes of the distinct storages of all parameters, of the
  optimizer state tensors, and the largest gradient footprint seen (after each ``forward_backward``,
  before the step; Twinkle frees gradients in ``zero_grad``); their sum is the persistent training
  state at its peak. Activations are not in it (they are transient; the batch is small on purpose).
* process memory: peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) and the RSS at the end, also
  minus the ``baseline`` process' RSS ("above baseline").

``--scenario NAME`` runs one scenario and prints its JSON (the parent runs every scenario that way).

    python bench/multi_lora_memory.py          # default (~1-2 min on 2 idle cores)
    python bench/multi_lora_memory.py --quick  # smoke run: (a)'s model, 2 tenants (~20 s; the 5
                                               # processes' imports alone take ~6 s CPU each)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import _common as C

# A larger model than (a)'s, so that the model's memory is not lost next to the interpreter's.
MEMORY_MODEL = {**C.BENCH_MODEL, "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536,
                "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4}
LORA = {"type": "lora", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
SCENARIOS = ("baseline", "base", "multi_lora", "full_1", "full_n")
LR = 1e-3


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def storage_bytes(tensors: Any) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def optimizer_tensors(optimizer: Any) -> list:
    import torch

    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def make_batch(spec: dict[str, Any], batch_size: int, seq_len: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, spec["vocab_size"], (batch_size, seq_len), generator=g)
    labels = ids.clone()
    labels[:, 0] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def best_ms(fn: Any, inner: int = 5, repeats: int = 5) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t0) / inner * 1e3)
    return min(out)


# ---------------------------------------------------------------------- scenarios (child process)
def run_scenario(name: str, spec: dict[str, Any], tenants: int, batch_size: int, seq_len: int,
                 seed: int) -> dict[str, Any]:
    import peft  # noqa: F401  (imported in every scenario, so the baseline includes it)
    import torch
    from twinkle_backend_hf.model import TransformersModel
    from twinkle_backend_hf.multi_lora import MultiLoraTransformersModel

    from twinkle_core.tasks.causal_lm import CausalLMTask

    batch = make_batch(spec, batch_size, seq_len, seed)
    out: dict[str, Any] = {"scenario": name}
    models, optimizers, grad_peak, rss_trace = [], [], 0, []
    t0 = time.perf_counter()
    if name == "baseline":
        pass
    elif name == "base":
        model = TransformersModel(config=dict(spec), seed=seed, task=CausalLMTask())
        for p in model.module.parameters():
            p.requires_grad_(False)
        model.forward_only(inputs=batch)
        models.append(model)
    elif name == "multi_lora":
        model = MultiLoraTransformersModel(config=dict(spec), seed=seed, task=CausalLMTask(),
                                           max_lora_rank=64)
        names = [f"tenant{i}" for i in range(tenants)]
        for tenant in names:
            model.add_adapter_to_model(tenant, dict(LORA))
        for tenant in names:
            model.set_optimizer("AdamW", adapter_name=tenant, lr=LR)
        for tenant in names:
            model.forward_backward(inputs=batch, adapter_name=tenant)
            grad_peak = max(grad_peak, storage_bytes(p.grad for p in model.module.parameters()))
            model.clip_grad_and_step(max_grad_norm=1.0, adapter_name=tenant)
            rss_trace.append(rss_bytes())
        models.append(model)
        optimizers = [model.adapter_states.states[t].optimizer for t in names]
        per_tenant = [sum(p.numel() for p in model.trainable_parameters(adapter_name=t)) for t in names]
        out["adapter_params_per_tenant"] = per_tenant[0]
        out["adapter_bytes_per_tenant"] = 4 * per_tenant[0]
        out["trainable_requires_grad_after"] = sum(p.numel() for p in model.module.parameters() if p.requires_grad)
    elif name in ("full_1", "full_n"):
        for _ in range(1 if name == "full_1" else tenants):
            model = TransformersModel(config=dict(spec), seed=seed, task=CausalLMTask())
            model.set_optimizer("AdamW", lr=LR)
            model.forward_backward(inputs=batch)
            grad_peak = max(grad_peak, storage_bytes(p.grad for p in model.module.parameters()))
            model.clip_grad_and_step(max_grad_norm=1.0)
            models.append(model)
            optimizers.append(model.adapter_states.states[""].optimizer)
            rss_trace.append(rss_bytes())
    else:
        raise SystemExit(f"unknown scenario {name!r}")
    params = storage_bytes(p for m in models for p in m.module.parameters())
    opt_state = storage_bytes(t for o in optimizers for t in optimizer_tensors(o))
    live_grads = storage_bytes(p.grad for m in models for p in m.module.parameters())
    out.update({
        "seconds": time.perf_counter() - t0,
        "parameter_bytes": params,
        "optimizer_state_bytes": opt_state,
        "grad_bytes_peak": grad_peak,
        "grad_bytes_live_at_end": live_grads,
        "tracked_bytes": params + opt_state + grad_peak,
        "parameters": sum(p.numel() for m in models for p in m.module.parameters()),
        "max_rss_bytes": max_rss_bytes(),
        "rss_end_bytes": rss_bytes(),
        "rss_after_each_step": rss_trace,
        "torch_threads": torch.get_num_threads(),
    })
    return out


# ---------------------------------------------------------------------- parent
def child_command(name: str, args: argparse.Namespace, spec_name: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--scenario", name, "--model", spec_name,
           "--tenants", str(args.tenants), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--threads", str(args.threads), "--seed", str(args.seed)]


def run_children(names: tuple[str, ...], args: argparse.Namespace, spec_name: str, jobs: int) -> dict[str, Any]:
    """Run the scenarios as separate processes, ``jobs`` at a time (peak RSS is per process, so running
    them side by side does not change what is measured, only how long it takes)."""
    pending, running, results = list(names), {}, {}
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            running[name] = subprocess.Popen(child_command(name, args, spec_name), stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True)
        for name, proc in list(running.items()):
            if proc.poll() is None:
                continue
            out, err = proc.communicate()
            del running[name]
            if proc.returncode != 0:
                for other in running.values():
                    other.kill()
                raise RuntimeError(f"scenario {name} failed:\n{err[-4000:]}")
            results[name] = json.loads(out.strip().splitlines()[-1])
        time.sleep(0.05)
    return {name: results[name] for name in names}


def mib(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(parser, repeats=1)
    parser.add_argument("--tenants", type=int, default=None, help="default 8 (2 with --quick)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--model", choices=("memory", "bench"), default=None,
                        help="memory: hidden 512 x 8 layers (default); bench: (a)'s model (--quick)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="scenario processes at a time (default: the CPU count)")
    parser.add_argument("--scenario", choices=SCENARIOS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    C.set_threads(args.threads)
    spec_name = args.model or ("bench" if args.quick else "memory")
    spec = MEMORY_MODEL if spec_name == "memory" else C.BENCH_MODEL
    if args.tenants is None:
        args.tenants = 2 if args.quick else 8
    if args.seq_len is None:
        args.seq_len = 32 if args.quick else 64
    if args.scenario:
        import warnings

        warnings.filterwarnings("ignore")
        print(json.dumps(run_scenario(args.scenario, spec, args.tenants, args.batch_size, args.seq_len, args.seed)))
        return

    with C.LoadMonitor() as mon:
        jobs = args.jobs or max(1, os.cpu_count() or 1)
        results = run_children(SCENARIOS, args, spec_name, jobs)
    base, ml, f1, fn, bl = (results[k] for k in ("base", "multi_lora", "full_1", "full_n", "baseline"))
    above = {k: v["max_rss_bytes"] - bl["max_rss_bytes"] for k, v in results.items()}
    n = args.tenants
    ratios = {
        "multi_lora_over_base_tracked": ml["tracked_bytes"] / base["tracked_bytes"],
        "multi_lora_over_base_max_rss": ml["max_rss_bytes"] / base["max_rss_bytes"],
        "multi_lora_over_base_max_rss_above_baseline": above["multi_lora"] / above["base"],
        "full_n_over_base_tracked": fn["tracked_bytes"] / base["tracked_bytes"],
        "full_n_over_multi_lora_tracked": fn["tracked_bytes"] / ml["tracked_bytes"],
        "full_n_over_multi_lora_max_rss": fn["max_rss_bytes"] / ml["max_rss_bytes"],
        "full_n_over_multi_lora_max_rss_above_baseline": above["full_n"] / above["multi_lora"],
        "n_processes_full_1_over_multi_lora_max_rss": n * f1["max_rss_bytes"] / ml["max_rss_bytes"],
    }
    extra_per_tenant_tracked = (ml["tracked_bytes"] - base["tracked_bytes"]) / n
    payload = {
        "question": f"memory of MultiLoraTransformersModel with {n} LoRA tenants (r=8, AdamW, one step each) vs "
                    f"the base model alone, and vs {n} separate full copies",
        "settings": {"quick": args.quick, "threads": args.threads, "jobs": jobs, "tenants": n, "batch_size": args.batch_size,
                     "seq_len": args.seq_len, "lora": LORA, "seed": args.seed, "model_name": spec_name},
        "model": {"config": spec, "parameters": C.count_parameters(spec)},
        "scenarios": results,
        "max_rss_above_baseline_bytes": above,
        "ratios": ratios,
        "extra_tracked_bytes_per_tenant": extra_per_tenant_tracked,
        "n_processes_full_1_max_rss_bytes": n * f1["max_rss_bytes"],
    }
    path = C.write_result("multi_lora_memory", payload, mon)

    rows = []
    for name in SCENARIOS:
        r = results[name]
        rows.append([name, mib(r["parameter_bytes"]), mib(r["optimizer_state_bytes"]), mib(r["grad_bytes_peak"]),
                     mib(r["tracked_bytes"]), mib(r["max_rss_bytes"]), mib(above[name])])
    rows.append([f"{n} x full_1 processes", "", "", "", mib(n * f1["tracked_bytes"]), mib(n * f1["max_rss_bytes"]),
                 mib(n * above["full_1"])])
    print(f"model: {spec_name} ({payload['model']['parameters']:,} parameters), {n} tenants, LoRA r={LORA['r']} "
          f"on {len(LORA['target_modules'])} projections ({ml.get('adapter_params_per_tenant', 0):,} parameters "
          f"per tenant)")
    print(C.markdown_table(["scenario", "params MiB", "optimizer MiB", "grads peak MiB", "tracked MiB",
                            "peak RSS MiB", "peak RSS above baseline MiB"], rows))
    print(C.markdown_table(["ratio", "value"], [[k, f"{v:.3f}"] for k, v in ratios.items()]))
    print(f"extra tracked memory per tenant: {mib(extra_per_tenant_tracked)} MiB")
    print("per-tenant-step bookkeeping (switching, mode, parameter lists): bench/multi_tenant_switch.py (f)")
    print(mon.short())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
