"""(c) Model FLOPs utilisation (MFU) of Twinkle's training step on this machine's CPU.

Peak: the machine's own dense fp32 matmul rate, ``torch.matmul`` of two ``--matmul-size`` square
fp32 matrices (2·n³ FLOPs), best of 2 back-to-back products per sample, with the same torch threads
as training.

Model FLOPs per token (the PaLM / Chinchilla convention, not counting recomputation):

    6·N + 12·L·d_attn·T

* ``N``: parameters that take part in matmuls - every Linear weight (q/k/v/o and the gated MLP of
  every layer, and the LM head); the input embedding is a lookup and is not counted, norms and
  biases are negligible and not counted. 6·N = 2 (forward) + 4 (backward) FLOPs per weight per token.
* ``12·L·d_attn·T``: attention scores QKᵀ and the weighted sum AV (2·T·d_attn FLOPs each per token
  forward, x3 for training), ``L`` layers, ``d_attn`` = heads x head_dim, ``T`` the sequence length,
  counted for all T keys (no causal halving - the CPU sdpa kernel computes the masked half anyway).

Every position of (a)'s batches is computed (full-length rows, no padding), so tokens/step = batch x
seq_len. Achieved FLOP/s = FLOPs/token x tokens/step / step time.

Measurement: matmul samples and Twinkle training steps alternate (matmul, step, matmul, step ...), so
each step has a peak measured next to it under the same load; reported are the median of the paired
per-step MFU and the best-case MFU (fastest step / fastest matmul). When ``results/step_time.json``
exists, the MFU of (a)'s Twinkle and hand-loop medians against this peak is added for reference.

    python bench/mfu.py           # default (~1 min)
    python bench/mfu.py --quick   # smoke run (< 20 s)
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import _common as C


def model_flops(spec: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """FLOPs per token of one training step (forward + backward) and the terms that make it up."""
    import torch

    with torch.device("meta"):
        module = C.build_hf_model(spec, 0)
    embedding = module.get_input_embeddings().weight
    linear = sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))
    total = sum(p.numel() for p in module.parameters())
    layers = spec["num_hidden_layers"]
    head_dim = spec.get("head_dim") or spec["hidden_size"] // spec["num_attention_heads"]
    d_attn = spec["num_attention_heads"] * head_dim
    dense = 6 * linear
    attention = 12 * layers * d_attn * seq_len
    return {"formula": "6*N + 12*L*d_attn*T (N = Linear weights incl. LM head, excl. input embedding)",
            "N_matmul_params": linear, "total_params": total, "embedding_params": embedding.numel(),
            "L": layers, "d_attn": d_attn, "T": seq_len, "dense_flops_per_token": dense,
            "attention_flops_per_token": attention, "flops_per_token": dense + attention,
            "flops_per_token_6N_total_params": 6 * total}


def matmul_rate(a: Any, b: Any, inner: int = 2) -> float:
    """FLOP/s of the fastest of ``inner`` back-to-back products."""
    import torch

    n = a.shape[0]
    best = float("inf")
    for _ in range(inner):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(parser, repeats=10)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--matmul-size", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    args = parser.parse_args()
    threads = C.set_threads(args.threads)
    import step_time as S
    import torch

    q = args.quick
    batch_size = args.batch_size or (2 if q else 8)
    seq_len = args.seq_len or (64 if q else 128)
    n = args.matmul_size or (1024 if q else 2048)
    repeats = args.repeats or (4 if q else 10)
    warmup = args.warmup if args.warmup is not None else (1 if q else 3)

    with C.LoadMonitor() as mon:
        flops = model_flops(C.BENCH_MODEL, seq_len)
        tokens = batch_size * seq_len
        step_flops = flops["flops_per_token"] * tokens
        g = torch.Generator().manual_seed(args.seed)
        a = torch.randn(n, n, generator=g)
        b = torch.randn(n, n, generator=g)
        matmul_rate(a, b, 1)
        batches = S.make_batches(C.BENCH_MODEL, batch_size, seq_len, 4, args.seed)
        twinkle = S.TwinkleStep(C.BENCH_MODEL, args.seed)
        for i in range(warmup):
            twinkle(batches[i % len(batches)])
        peaks, steps = [], []
        for i in range(repeats):
            peaks.append(matmul_rate(a, b))
            t0 = time.perf_counter()
            twinkle(batches[i % len(batches)])
            steps.append(time.perf_counter() - t0)
        peaks.append(matmul_rate(a, b))

    # pair each step with the better of the two matmul samples around it
    paired = [step_flops / t / max(peaks[i], peaks[i + 1]) for i, t in enumerate(steps)]
    peak = max(peaks)
    achieved = [step_flops / t for t in steps]
    result = {
        "peak_matmul_flops": {"best": peak, **{f"{k}": v for k, v in C.stats(peaks).items() if k != "n"},
                              "samples": len(peaks), "matmul_size": n, "dtype": "float32"},
        "twinkle_step_ms": C.stats([t * 1e3 for t in steps]),
        "achieved_flops": {"median": C.stats(achieved)["median"], "best": max(achieved)},
        "mfu_paired": C.stats(paired),
        "mfu_best_case": max(achieved) / peak,
        "mfu_median_step_vs_best_peak": C.stats(achieved)["median"] / peak,
    }
    reference = None
    step_json = C.RESULTS / "step_time.json"
    if step_json.exists():
        prior = json.loads(step_json.read_text())
        s = prior.get("settings", {})
        if s.get("batch_size") == batch_size and s.get("seq_len") == seq_len and s.get("threads") == threads:
            r = prior["result"]
            reference = {"source": str(step_json), "timestamp": prior.get("timestamp"),
                         "twinkle_mfu": step_flops / (r["twinkle_ms"]["median"] / 1e3) / peak,
                         "hand_mfu": step_flops / (r["hand_ms"]["median"] / 1e3) / peak}
    payload = {
        "question": "model FLOPs utilisation of Twinkle's training step against this machine's fp32 matmul peak",
        "settings": {"quick": q, "threads": threads, "batch_size": batch_size, "seq_len": seq_len,
                     "tokens_per_step": tokens, "repeats": repeats, "warmup": warmup, "seed": args.seed},
        "model": {"config": C.BENCH_MODEL},
        "flops": {**flops, "tokens_per_step": tokens, "flops_per_step": step_flops},
        "result": result,
        "step_time_reference": reference,
    }
    path = C.write_result("mfu", payload, mon)

    rows = [["peak fp32 matmul (best)", f"{peak / 1e9:.1f} GFLOP/s", f"n={n}, {len(peaks)} samples, median "
             f"{C.stats(peaks)['median'] / 1e9:.1f}"],
            ["model FLOPs / token", f"{flops['flops_per_token'] / 1e6:.2f} MFLOP",
             f"6N={flops['dense_flops_per_token'] / 1e6:.2f}M (N={flops['N_matmul_params']:,}) + attention "
             f"{flops['attention_flops_per_token'] / 1e6:.2f}M"],
            ["Twinkle step", f"{result['twinkle_step_ms']['median']:.1f} ms",
             f"{tokens} tokens, {step_flops / 1e9:.2f} GFLOP/step"],
            ["achieved (median step)", f"{result['achieved_flops']['median'] / 1e9:.1f} GFLOP/s", ""],
            ["MFU (paired, median)", f"{100 * result['mfu_paired']['median']:.1f}%",
             f"p25-p75 {100 * result['mfu_paired']['p25']:.1f}-{100 * result['mfu_paired']['p75']:.1f}%"],
            ["MFU (best step / best peak)", f"{100 * result['mfu_best_case']:.1f}%", ""]]
    if reference:
        rows.append(["MFU of (a)'s medians", f"Twinkle {100 * reference['twinkle_mfu']:.1f}%",
                     f"hand loop {100 * reference['hand_mfu']:.1f}%"])
    print(C.markdown_table(["quantity", "value", "notes"], rows))
    print(mon.short())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
