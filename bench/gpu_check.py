"""(6) One-GPU check: tokens/s, MFU and peak memory of Twinkle vs ``transformers.Trainer`` on a 0.5B model.

The model: a Qwen2 decoder with Qwen2.5-0.5B's shapes (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocab 151936, tied embeddings), built from the config with random weights (no
download). Precision bf16 (autocast, fp32 weights, in both), attention ``flash_attention_2`` when
``flash_attn`` imports, else ``sdpa``.

The data: synthetic samples of random tokens with random lengths (``--min-len``..``--max-len``, the
first quarter of each masked as prompt), packed padding-free by Twinkle
(``twinkle_core.data.packing.pack_features``: first-fit decreasing into rows of ``--row-len`` tokens,
``position_ids`` restarting at every sample, no attention mask) and collated by
``twinkle_core.data.collate.collate_causal_lm`` into batches of ``--rows`` rows. Both contenders train
on exactly these batches, in the same order:

* ``twinkle`` - ``TransformersModel(config=..., precision="bf16", attn_implementation=...)``,
  ``set_optimizer("AdamW")``, ``forward_backward`` + ``clip_grad_and_step(1.0)`` (Twinkle's default
  AdamW implementation: the fused kernel where torch has one);
* ``trainer`` - ``transformers.Trainer`` (``bf16=True``, its default optimizer, the same lr, weight
  decay 0, clipping 1.0, no logging / saving / evaluation), fed the same pre-collated batches
  (one batch per dataset item, an identity collator).

Measured per contender, after ``--warmup`` untimed steps: tokens/s over ``--steps`` timed steps
(real tokens only, no padding; CUDA synchronised at both ends of the timed window), MFU and
``torch.cuda.max_memory_allocated`` (peak, reset before each contender is built).

MFU = achieved model FLOP/s / the GPU's datasheet dense bf16 tensor peak (looked up by device name in
``PEAK_BF16_TFLOPS``; an unknown device gives ``mfu: null`` and a message; ``--peak-tflops`` overrides).
Model FLOPs of one step (forward + backward, the PaLM convention of ``bench/mfu.py``, no recomputation)::

    6 * N * tokens  +  12 * L * d_attn * sum_i(len_i ** 2)

``N`` = the parameters of every matmul (all Linear weights including the LM head - here tied to the
input embedding, which counts once as the LM head; the embedding lookup itself is not a matmul),
``L`` layers, ``d_attn`` = heads x head_dim, ``len_i`` the length of every packed sample (a packed
sample attends only to itself, over all its keys: no causal halving, as in ``bench/mfu.py``).

Before either contender is timed, one untimed Twinkle pass over every batch builds the process's kernel plans
(see ``main``): without it the first contender in the process is measured cold.

Targets (reported, not asserted): MFU >= 45%, tokens/s Twinkle / Trainer >= 1.05.

    python bench/gpu_check.py            # one GPU, < 5 min
    python bench/gpu_check.py --smoke    # tiny config on CPU, a few steps (CI: the script does not rot)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import os
import random
import re
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

LR, MAX_GRAD_NORM, PROMPT_FRACTION = 1e-4, 1.0, 0.25
TARGET_MFU, TARGET_RATIO = 0.45, 1.05

#: Qwen2.5-0.5B's shapes, random weights
QWEN25_05B = {
    "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151643, "pad_token_id": 151643,
}
#: the --smoke model (CPU, seconds)
SMOKE_MODEL = {**QWEN25_05B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}

#: Datasheet dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, by device-name pattern (first match wins;
#: torch.cuda.get_device_name() spells e.g. "NVIDIA H100 80GB HBM3" for the SXM part). GeForce / workstation
#: parts: bf16 with fp32 accumulation.
PEAK_BF16_TFLOPS: list[tuple[str, str, float]] = [
    (r"GH200", "GH200", 989.4),
    (r"H200.*NVL", "H200 NVL", 835.5),
    (r"H200", "H200 SXM", 989.4),
    (r"H100.*(PCIe|PCIE)", "H100 PCIe", 756.0),
    (r"H100.*NVL", "H100 NVL", 835.5),
    (r"H100", "H100 SXM", 989.4),
    (r"H800.*(PCIe|PCIE)", "H800 PCIe", 756.0),
    (r"H800", "H800 SXM", 989.4),
    (r"\bH20\b", "H20", 148.0),
    (r"B200", "B200", 2250.0),
    (r"A100", "A100 (40/80GB, SXM/PCIe)", 312.0),
    (r"A800", "A800", 312.0),
    (r"\bA30\b", "A30", 165.0),
    (r"L40S", "L40S", 362.05),
    (r"\bL40\b", "L40", 181.05),
    (r"\bL20\b", "L20", 119.5),
    (r"\bL4\b", "L4", 121.0),
    (r"\bA10\b", "A10", 125.0),
    (r"RTX 6000 Ada", "RTX 6000 Ada", 364.2),
    (r"RTX A6000", "RTX A6000", 154.8),
    (r"RTX 4090", "GeForce RTX 4090", 165.2),
    (r"RTX 3090", "GeForce RTX 3090", 71.0),
]


def peak_bf16_flops(device_name: str | None) -> tuple[float | None, str]:
    if not device_name:
        return None, "no CUDA device: MFU is not computed (null)"
    for pattern, label, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops * 1e12, f"{label}: {tflops} TFLOP/s dense bf16 (datasheet)"
    return None, (f"unknown device {device_name!r}: no datasheet bf16 peak in bench/gpu_check.py's table, MFU is "
                  "null (pass --peak-tflops)")


# ---------------------------------------------------------------------- data
def make_batches(spec: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Random samples packed by Twinkle into rows of ``row_len``; ``rows`` rows per batch."""
    from twinkle_core.data.collate import collate_causal_lm
    from twinkle_core.data.formats import InputFeature
    from twinkle_core.data.packing import pack_features

    rng = random.Random(args.seed)
    needed = args.rows * args.row_len * (args.warmup + args.steps)
    features, total = [], 0
    while total < needed * 1.02:
        n = rng.randint(args.min_len, args.max_len)
        ids = [rng.randrange(spec["vocab_size"]) for _ in range(n)]
        labels = list(ids)
        labels[: max(1, int(n * PROMPT_FRACTION))] = [-100] * max(1, int(n * PROMPT_FRACTION))
        features.append(InputFeature(input_ids=ids, labels=labels))
        total += n
    rows = pack_features(features, args.row_len)
    batches = []
    for k in range(0, len(rows) - args.rows + 1, args.rows):
        group = rows[k:k + args.rows]
        batch = collate_causal_lm(group, spec["pad_token_id"])
        lengths = [len(s) for s in _sample_lengths(group)]
        batches.append({"batch": batch, "tokens": sum(len(f.input_ids) for f in group),
                        "slots": int(batch["input_ids"].numel()), "sum_len_sq": sum(n * n for n in lengths)})
    if len(batches) < args.warmup + args.steps:
        raise RuntimeError(f"only {len(batches)} batches for {args.warmup + args.steps} steps")
    return batches[: args.warmup + args.steps]


def _sample_lengths(rows: list[Any]) -> list[range]:
    out = []
    for f in rows:
        starts = [i for i, p in enumerate(f.position_ids) if p == 0] + [len(f.input_ids)]
        out += [range(s, e) for s, e in zip(starts, starts[1:])]
    return out


# ---------------------------------------------------------------------- contenders
def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _reset_memory(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_memory(device: str) -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else None


def _allocated(device: str) -> int | None:
    """Memory still allocated before a contender starts (left over by the previous one, if anything)."""
    import torch

    return int(torch.cuda.memory_allocated()) if device == "cuda" else None


def run_twinkle(spec: dict[str, Any], batches: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    from twinkle_backend_hf.model import TransformersModel

    from twinkle_core.tasks.causal_lm import CausalLMTask

    _reset_memory(args.device)
    baseline = _allocated(args.device)
    model = TransformersModel(config=dict(spec), seed=args.seed, task=CausalLMTask(), precision=args.precision,
                              attn_implementation=args.attn)
    model.set_loss("cross_entropy", lm_head=args.lm_head)
    model.set_optimizer("AdamW", lr=LR, weight_decay=0.0)
    optimizer = model.train_state().handle  # only to record which AdamW kernel ran
    opt = getattr(optimizer, "optimizer", optimizer)
    losses: list[float] = []
    t0 = None
    for i, b in enumerate(batches):
        if i == args.warmup:
            _sync(args.device)
            t0 = time.perf_counter()
        out = model.forward_backward(inputs=b["batch"])
        model.clip_grad_and_step(max_grad_norm=MAX_GRAD_NORM)
        if i in (0, len(batches) - 1):
            losses.append(float(out["loss"]))
    _sync(args.device)
    wall = time.perf_counter() - t0
    result = {"wall_s": wall, "peak_memory_bytes": _peak_memory(args.device), "memory_before_bytes": baseline,
              "losses_first_last": losses,
              "attn_implementation": getattr(model.module.config, "_attn_implementation", None),
              "optimizer": _describe_optimizer(opt)}
    del model, optimizer, opt
    return result


def _describe_optimizer(opt: Any) -> dict[str, Any]:
    inner = getattr(opt, "optimizer", opt)
    defaults = dict(getattr(inner, "defaults", {}) or {})
    return {"class": type(inner).__name__, "fused": defaults.get("fused"), "foreach": defaults.get("foreach")}


def run_trainer(spec: dict[str, Any], batches: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    _reset_memory(args.device)
    baseline = _allocated(args.device)
    torch.manual_seed(args.seed)
    kwargs = {"attn_implementation": args.attn} if args.attn else {}
    model = transformers.AutoModelForCausalLM.from_config(C.hf_config(spec), dtype=torch.float32, **kwargs)
    model.config.use_cache = False

    class Batches(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(batches)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return batches[i]["batch"]

    warmup, device = args.warmup, args.device

    class Timer(TrainerCallback):
        t0: float | None = None
        wall: float | None = None

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == warmup:
                _sync(device)
                self.t0 = time.perf_counter()
            elif state.global_step == len(batches):
                _sync(device)
                self.wall = time.perf_counter() - self.t0

    timer = Timer()
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, use_cpu=device != "cuda", bf16=args.precision == "bf16", report_to="none",
            per_device_train_batch_size=1, num_train_epochs=1, max_steps=len(batches), learning_rate=LR,
            weight_decay=0.0, max_grad_norm=MAX_GRAD_NORM, seed=args.seed, data_seed=args.seed,
            train_sampling_strategy="sequential", eval_strategy="no", save_strategy="no", logging_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0, gradient_accumulation_steps=1)
        transformers.logging.set_verbosity_error()
        trainer = Trainer(model=model, args=targs, train_dataset=Batches(), data_collator=lambda items: items[0],
                          callbacks=[timer])
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        output = trainer.train()
        optimizer = _describe_optimizer(trainer.optimizer)
    result = {"wall_s": timer.wall, "peak_memory_bytes": _peak_memory(args.device), "memory_before_bytes": baseline,
              "train_loss_mean": float(output.training_loss),
              "attn_implementation": getattr(model.config, "_attn_implementation", None), "optimizer": optimizer}
    del trainer, model
    return result


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny config on CPU (fp32, sdpa), a few steps")
    parser.add_argument("--rows", type=int, default=None, help="packed rows per batch (default 4)")
    parser.add_argument("--row-len", type=int, default=None, help="tokens per packed row (default 4096)")
    parser.add_argument("--min-len", type=int, default=None, help="shortest sample (default 256)")
    parser.add_argument("--max-len", type=int, default=None, help="longest sample (default 4096)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per contender (default 30)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the datasheet bf16 peak")
    parser.add_argument("--attn", default=None, help="attention implementation (default: flash_attention_2 if "
                                                     "flash_attn imports, else sdpa)")
    parser.add_argument("--only", choices=("twinkle", "trainer"), default=None)
    parser.add_argument("--lm-head", choices=("auto", "fused", "logits"), default="auto",
                        help="Twinkle's cross_entropy lm_head option (default auto: fused at this vocabulary)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's, 1 with --smoke)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None, help="where the JSON goes (default bench/results)")
    args = parser.parse_args(argv)
    s = args.smoke
    if s:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # both contenders on the CPU, even on a GPU machine
    if s or args.threads:
        C.set_threads(args.threads or 1)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    args.device = "cuda" if torch.cuda.is_available() and not s else "cpu"
    if not s and args.device != "cuda":
        sys.exit("bench/gpu_check.py needs a CUDA GPU (use --smoke for the tiny CPU run)")
    spec = SMOKE_MODEL if s else QWEN25_05B
    args.rows = args.rows or (2 if s else 4)
    args.row_len = args.row_len or (128 if s else 4096)
    args.min_len = args.min_len or (16 if s else 256)
    args.max_len = min(args.max_len or args.row_len, args.row_len)
    args.steps = args.steps or (3 if s else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if s else 5)
    args.precision = "no" if s else "bf16"
    flash = importlib.util.find_spec("flash_attn") is not None
    if flash:
        try:
            import flash_attn  # noqa: F401
        except Exception:  # noqa: BLE001 - a broken install counts as absent
            flash = False
    args.attn = args.attn or ("flash_attention_2" if flash and args.device == "cuda" else "sdpa")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else None
    if args.peak_tflops:
        peak, peak_note = args.peak_tflops * 1e12, f"--peak-tflops {args.peak_tflops}"
    else:
        peak, peak_note = peak_bf16_flops(device_name)

    import mfu

    with C.LoadMonitor() as mon:
        batches = make_batches(spec, args)
        timed = batches[args.warmup:]
        tokens = sum(b["tokens"] for b in timed)
        flops = mfu.model_flops(spec, args.row_len)
        n_matmul, layers, d_attn = flops["N_matmul_params"], flops["L"], flops["d_attn"]
        step_flops_total = sum(6 * n_matmul * b["tokens"] + 12 * layers * d_attn * b["sum_len_sq"] for b in timed)
        runs: dict[str, Any] = {}
        # On an H200 the first contender in a fresh process ran cold all along: 541 ms/step against 311 for the
        # same Twinkle run repeated in the same process, while Trainer, running second, ran warm. Most likely the
        # kernel plans (cuDNN attention, cuBLAS) built the first time each batch shape appears: a batch is as
        # long as its longest packed row. An untimed pass over every batch first leaves neither contender cold.
        print(f"warming the process up: one untimed pass over the {len(batches)} batches ...", flush=True)
        run_twinkle(spec, batches, argparse.Namespace(**{**vars(args), "warmup": 0}))
        for name, fn in (("twinkle", run_twinkle), ("trainer", run_trainer)):
            if args.only and name != args.only:
                continue
            print(f"running {name} ({args.warmup} + {args.steps} steps) ...", flush=True)
            try:
                r = fn(spec, batches, args)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory: keep the other contender's numbers
                if s:
                    raise
                runs[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                print(f"{name} failed: {runs[name]['error']}", flush=True)
                continue
            r["tokens_per_s"] = tokens / r["wall_s"]
            r["ms_per_step"] = r["wall_s"] / len(timed) * 1e3
            r["achieved_tflops"] = step_flops_total / r["wall_s"] / 1e12
            r["mfu"] = step_flops_total / r["wall_s"] / peak if peak else None
            runs[name] = r
    ok = {name: r for name, r in runs.items() if "error" not in r}
    ratio = ok["twinkle"]["tokens_per_s"] / ok["trainer"]["tokens_per_s"] if {"twinkle", "trainer"} <= set(ok) else None
    tw = ok.get("twinkle", {})
    payload = {
        "question": "one GPU, 0.5B Qwen2 (random weights), bf16, packed: Twinkle tokens/s, MFU and peak memory, "
                    f"and vs transformers.Trainer (targets: MFU >= {TARGET_MFU:.0%}, ratio >= {TARGET_RATIO})",
        "settings": {"smoke": s, "device": args.device, "device_name": device_name, "precision": args.precision,
                     "lm_head": args.lm_head, "attn_implementation": args.attn, "flash_attn_importable": flash, "rows": args.rows,
                     "row_len": args.row_len, "sample_len": [args.min_len, args.max_len], "steps": args.steps,
                     "warmup": args.warmup, "lr": LR, "weight_decay": 0.0, "max_grad_norm": MAX_GRAD_NORM,
                     "seed": args.seed, "cuda": getattr(torch.version, "cuda", None),
                     "gpu_count": torch.cuda.device_count() if args.device == "cuda" else 0},
        "model": {"config": spec, "parameters": flops["total_params"]},
        "data": {"timed_real_tokens": tokens, "timed_token_slots": sum(b["slots"] for b in timed),
                 "packing_efficiency": tokens / sum(b["slots"] for b in timed),
                 "tokens_per_step_mean": tokens / len(timed)},
        "flops": {"formula": "6*N*tokens + 12*L*d_attn*sum(len_i^2) per step (N = Linear weights incl. the (tied) "
                             "LM head, excl. the embedding lookup; len_i = packed sample lengths; no causal halving)",
                  "N_matmul_params": n_matmul, "L": layers, "d_attn": d_attn,
                  "timed_flops_total": step_flops_total,
                  "attention_share": 1 - 6 * n_matmul * tokens / step_flops_total},
        "peak": {"bf16_flops": peak, "source": peak_note},
        "runs": runs,
        "ratio_tokens_per_s_twinkle_over_trainer": ratio,
        "targets": {"mfu_min": TARGET_MFU, "ratio_min": TARGET_RATIO},
        "meets_targets": {"mfu": (tw.get("mfu") >= TARGET_MFU) if tw.get("mfu") is not None else None,
                          "ratio": (ratio >= TARGET_RATIO) if ratio is not None else None},
        "messages": ([] if peak else [peak_note]) + [f"{n}: {r['error']}" for n, r in runs.items() if "error" in r],
    }
    path = C.write_result("gpu_check", payload, mon, out_dir=args.out_dir)
    rows = []
    for name, r in ok.items():
        mem = r["peak_memory_bytes"]
        rows.append([name, f"{r['tokens_per_s']:,.0f}", f"{r['ms_per_step']:.1f}", f"{r['achieved_tflops']:.1f}",
                     f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "null",
                     f"{mem / 2**30:.2f} GiB" if mem is not None else "-", r["attn_implementation"],
                     f"{r['optimizer']['class']} fused={r['optimizer']['fused']}"])
    print(C.markdown_table(["contender", "tokens/s", "ms/step", "TFLOP/s", "MFU", "peak memory", "attention",
                            "optimizer"], rows))
    if ratio is not None:
        print(f"tokens/s Twinkle / Trainer: {ratio:.3f} (target >= {TARGET_RATIO})")
    print(f"peak: {peak_note}")
    print(mon.short())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
