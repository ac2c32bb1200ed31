"""(e) Peak memory of a training step with a large vocabulary: Twinkle vs ``transformers.Trainer`` vs a hand loop.

A Qwen2 config with Qwen's vocabulary (151,936 entries), a small hidden size, sequences of 1,024 tokens, batch 2,
float32: the ``[2, 1024, 151936]`` float32 logits alone are 1.24 GB, far more than the model. Contenders, each in
its own fresh Python process (so ``ru_maxrss`` is that contender's own high-water mark), all from the same saved
initial weights and the same batch:

* ``twinkle``         - ``TransformersModel`` with its default loss (``cross_entropy``, ``lm_head="auto"``: at this
  vocabulary the loss applies the LM head itself, chunk by chunk, and the logits never exist);
* ``twinkle_chunked`` - ``chunked_cross_entropy`` over materialised logits (``lm_head="logits"``): the chunked
  log-softmax alone;
* ``twinkle_logits``  - ``cross_entropy`` over materialised logits (``lm_head="logits"``): Twinkle before the fused
  head;
* ``trainer``         - ``transformers.Trainer`` (its default optimizer, fused AdamW), the model's own loss;
* ``hand``            - a hand-written loop: ``model(input_ids).logits`` + ``F.cross_entropy`` + fused AdamW.

Measured: the peak RSS above the process's idle baseline (its RSS after imports, before the model is built, so the
number is everything training costs: weights, gradients, optimizer state, activations and logits), the loss of the
first step (all must agree within 1e-5) and the median time of the steps after the first.

    python bench/large_vocab_memory.py            # ~3-4 min on 1 thread
    python bench/large_vocab_memory.py --quick    # smoke run: vocab 32,768, 256 tokens
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

MODEL = {**C.BENCH_MODEL, "vocab_size": 151_936, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}
QUICK_MODEL = {**MODEL, "vocab_size": 32_768, "max_position_embeddings": 256}
CONTENDERS = ("twinkle", "twinkle_chunked", "twinkle_logits", "trainer", "hand")
LR = 1e-3


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def make_batch(vocab: int, batch: int, seq: int, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


# ---------------------------------------------------------------------- one contender per process
def run_twinkle(job: dict[str, Any], batch: dict[str, Any], loss: dict[str, Any] | None) -> list[tuple[float, float]]:
    from twinkle_backend_hf.model import TransformersModel

    model = TransformersModel(model_id=job["weights"], seed=job["seed"])
    if loss:
        model.set_loss(loss["name"], **loss["options"])
    model.set_optimizer("AdamW", lr=LR, weight_decay=0.0)
    steps = []
    for _ in range(job["steps"]):
        t0 = time.perf_counter()
        out = model.forward_backward(inputs=batch)
        model.clip_grad_and_step(max_grad_norm=None)
        steps.append((time.perf_counter() - t0, float(out["loss"])))
    return steps


def run_hand(job: dict[str, Any], batch: dict[str, Any]) -> list[tuple[float, float]]:
    import torch
    import torch.nn.functional as F
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(job["weights"], dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    steps = []
    for _ in range(job["steps"]):
        t0 = time.perf_counter()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append((time.perf_counter() - t0, float(loss)))
        del logits, loss
    return steps


def run_trainer(job: dict[str, Any], batch: dict[str, Any]) -> list[tuple[float, float]]:
    import torch
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = transformers.AutoModelForCausalLM.from_pretrained(job["weights"], dtype=torch.float32)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(batch["input_ids"].shape[0])]
    dataset = rows * job["steps"]
    steps: list[tuple[float, float]] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            steps.append((time.perf_counter() - self.t0, float("nan")))

    losses: list[float] = []

    class Recorder(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            result = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
            losses.append(float((result[0] if return_outputs else result).detach()))
            return result

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to="none",
                                 per_device_train_batch_size=batch["input_ids"].shape[0], max_steps=job["steps"],
                                 learning_rate=LR, weight_decay=0.0, lr_scheduler_type="constant", max_grad_norm=0.0,
                                 train_sampling_strategy="sequential", save_strategy="no", logging_strategy="no",
                                 disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=False)
        transformers.logging.set_verbosity_error()
        trainer = Recorder(model=model, args=args, train_dataset=dataset, callbacks=[Timer()],
                           data_collator=lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]})
        trainer.train()
    return [(t, loss) for (t, _), loss in zip(steps, losses, strict=False)]


LOSSES = {"twinkle": None,
          "twinkle_chunked": {"name": "chunked_cross_entropy", "options": {"lm_head": "logits"}},
          "twinkle_logits": {"name": "cross_entropy", "options": {"lm_head": "logits"}}}


def contender(name: str, job: dict[str, Any]) -> dict[str, Any]:
    threads = C.set_threads(job["threads"])
    import torch  # noqa: F401  (imports first: the baseline is the idle interpreter with its libraries)
    import transformers  # noqa: F401
    import twinkle_backend_hf.model  # noqa: F401

    batch = make_batch(job["vocab_size"], job["batch_size"], job["seq_len"], job["seed"])
    baseline = rss_bytes()
    if name.startswith("twinkle"):
        steps = run_twinkle(job, batch, LOSSES[name])
    elif name == "hand":
        steps = run_hand(job, batch)
    else:
        steps = run_trainer(job, batch)
    peak = peak_rss_bytes()
    times = [t for t, _ in steps[1:]] or [steps[0][0]]
    return {"contender": name, "threads": threads, "baseline_rss_mib": baseline / 2**20,
            "peak_rss_mib": peak / 2**20, "peak_above_baseline_mib": (peak - baseline) / 2**20,
            "first_loss": steps[0][1], "losses": [loss for _, loss in steps],
            "step_s": statistics.median(times), "step_times_s": [t for t, _ in steps]}


# ---------------------------------------------------------------------- parent
def save_weights(spec: dict[str, Any], seed: int, directory: str) -> None:
    model = C.build_hf_model(spec, seed)
    model.save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(parser, repeats=1)
    parser.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.contender:
        print(json.dumps(contender(args.contender, json.loads(args.job))))
        return

    spec = QUICK_MODEL if args.quick else MODEL
    settings = {"quick": args.quick, "threads": args.threads, "seed": args.seed, "batch_size": 2,
                "seq_len": 256 if args.quick else 1024, "steps": 2 if args.quick else 4,
                "vocab_size": spec["vocab_size"], "model": spec}
    results: dict[str, Any] = {}
    with C.LoadMonitor() as monitor, tempfile.TemporaryDirectory() as weights:
        C.set_threads(args.threads)
        save_weights(spec, args.seed, weights)
        job = {**settings, "weights": weights}
        for name in CONTENDERS:
            out = subprocess.run([sys.executable, __file__, "--contender", name, "--job", json.dumps(job)],
                                 capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{name} failed:\n{out.stderr[-4000:]}")
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])
            r = results[name]
            print(f"{name:16s} peak above baseline {r['peak_above_baseline_mib']:8.1f} MiB  "
                  f"loss {r['first_loss']:.6f}  step {r['step_s']:.2f} s", flush=True)
    trainer, hand = results["trainer"], results["hand"]
    ratios = {name: r["peak_above_baseline_mib"] / trainer["peak_above_baseline_mib"] for name, r in results.items()}
    loss_gap = max(abs(r["first_loss"] - hand["first_loss"]) for r in results.values())
    step_ratio = results["twinkle"]["step_s"] / hand["step_s"]
    payload = {
        "question": "peak memory of one training step at vocabulary 151,936 (fp32, 2 x 1,024 tokens): Twinkle's "
                    "default vs chunked cross entropy vs transformers.Trainer vs a hand loop",
        "settings": settings, "contenders": results,
        "peak_ratio_vs_trainer": ratios, "max_first_loss_gap_vs_hand": loss_gap,
        "twinkle_step_time_ratio_vs_hand": step_ratio,
        "meets_targets": {"memory": ratios["twinkle"] <= 0.6, "loss": loss_gap <= 1e-5, "step_time": step_ratio <= 1.05},
    }
    path = C.write_result("large_vocab_memory", payload, monitor, args.out_dir)
    print(f"Twinkle default / Trainer peak: {ratios['twinkle']:.3f} (target <= 0.6); loss gap {loss_gap:.2e} "
          f"(<= 1e-5); step time vs hand loop {step_ratio:.3f} (<= 1.05)\n{monitor.summary()}\n-> {path}")


if __name__ == "__main__":
    main()
