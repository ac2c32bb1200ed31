"""(b) Training throughput of Twinkle vs ``transformers.Trainer`` on the same SFT job.

The job: the first ``--samples`` chats of ``examples/quickstart/train.jsonl`` (multi-turn SFT, its
bundled character-level tokenizer and chat template; 23-105 tokens per chat), tokenised once by
Twinkle's ``CausalLMTask`` (``max_length`` 128; assistant turns trained), one pass in the order of
Twinkle's ``DataLoader`` (seeded shuffle), batch size ``--batch-size``, the Qwen2 benchmark model of
``_common.BENCH_MODEL`` built from the same seed, AdamW lr 1e-3 with weight decay 0 (so the Trainer's
no-decay parameter groups change nothing), constant lr, clip 1.0, fp32, no evaluation, no saving, no
logging, no progress bar, ``dataloader_num_workers=0``.

Contenders (every pass trains a fresh model of each on the whole job; the Twinkle loops run step by
step inside a Trainer callback, so all contenders share the same machine load; passes alternate the
Trainer's optimizer between ``trainer`` and ``trainer_adamw``):

* ``trainer``         - ``transformers.Trainer`` as a user runs it: ``DataCollatorForSeq2Seq`` (pad to
  the longest in the batch, labels padded with -100), the default optimizer (``adamw_torch_fused``);
  ``train_sampling_strategy="sequential"`` over the samples already put in Twinkle's shuffled order,
  so both see identical batches.
* ``trainer_adamw``   - the same with ``optim="adamw_torch"``: the plain ``torch.optim.AdamW`` that
  Twinkle's ``"AdamW"`` builds, i.e. the framework comparison with identical math.
* ``twinkle``         - ``TransformersModel`` + ``model.forward_backward`` / ``clip_grad_and_step(1.0)``,
  Twinkle's ``DataLoader`` and ``CausalLMTask.collate`` (padded to the longest in the batch).
* ``twinkle_packed``  - the same samples packed padding-free (``load_dataset(packing=True)``: first-fit
  decreasing into rows of 128 tokens, ``position_ids`` restart per sample, no attention mask).

Tokens/s counts only real tokens (the samples' own tokens; no padding): each collate function
records the real tokens of its batch, and the time of a step is the wall time from the end of the
previous step to the end of this one (data loading and collation included, for both frameworks).
The first ``--warmup`` steps of every run are not counted. Reported per contender: the median over
passes of tokens/s, with min/max; ratios are medians over passes of the per-pass ratios. For the
padded comparison both see identical batches at every step, so the median of the per-step time
ratios is reported too (the most load-robust number).

Checks: the final weights of ``twinkle`` and ``trainer_adamw`` (same batches, same math) agree; the
packed forward gives the same logits as running each packed sample alone.

    python bench/throughput_vs_trainer.py          # default (~2-3 min on 2 idle cores)
    python bench/throughput_vs_trainer.py --quick  # smoke run (< 20 s on an idle machine)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
import warnings
from typing import Any

import _common as C

LR, MAX_GRAD_NORM, MAX_LENGTH = 1e-3, 1.0, 128
CONTENDERS = ("trainer", "trainer_adamw", "twinkle", "twinkle_packed")


# ---------------------------------------------------------------------- data
def load_job(samples: int, seed: int, batch_size: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from twinkle_core.data.loader import DataLoader
    from twinkle_core.tasks.causal_lm import CausalLMTask

    tokenizer = AutoTokenizer.from_pretrained(str(C.QUICKSTART / "tokenizer"))
    with open(C.QUICKSTART / "train.jsonl") as fh:
        rows = [json.loads(line) for _, line in zip(range(samples), fh)]
    task = CausalLMTask()
    features = task.load_dataset(rows, tokenizer, max_length=MAX_LENGTH)
    packed_task = CausalLMTask()
    packed = packed_task.load_dataset(rows, tokenizer, max_length=MAX_LENGTH, packing=True)
    order_loader = DataLoader(features, batch_size, shuffle=True, seed=seed)
    order = [i for b in range(len(order_loader)) for i in order_loader.batch_indices(0, b)]
    lengths = [len(f.input_ids) for f in features]
    padded_slots = sum(max(lengths[i] for i in order[k:k + batch_size]) * len(order[k:k + batch_size])
                       for k in range(0, len(order), batch_size))
    return {"tokenizer": tokenizer, "task": task, "packed_task": packed_task, "features": features,
            "packed": packed, "order": order, "real_tokens": sum(lengths),
            "padding_efficiency": sum(lengths) / padded_slots,
            "packing_efficiency": sum(lengths) / (len(packed) * MAX_LENGTH),
            "length_stats": C.stats(lengths)}


class CountingCollate:
    """Wraps a collate function; records the real (non-pad) tokens of every batch it builds."""

    def __init__(self, fn: Any, count: Any) -> None:
        self.fn, self.count, self.tokens, self.slots = fn, count, [], []

    def __call__(self, items: list) -> Any:
        self.tokens.append(int(self.count(items)))
        batch = self.fn(items)
        self.slots.append(int(batch["input_ids"].numel()))  # token positions computed, padding included
        return batch


# ---------------------------------------------------------------------- contenders
class TwinkleRunner:
    """Twinkle's loop, one step at a time: ``next(loader)`` -> ``forward_backward`` -> ``clip_grad_and_step``."""

    def __init__(self, job: dict[str, Any], packed: bool, batch_size: int, seed: int) -> None:
        from twinkle_backend_hf.model import TransformersModel

        from twinkle_core.data.loader import DataLoader

        task = job["packed_task"] if packed else job["task"]
        data = job["packed"] if packed else job["features"]
        self.model = TransformersModel(config=dict(C.BENCH_MODEL), seed=seed, task=task, tokenizer=job["tokenizer"])
        self.model.set_loss("cross_entropy")
        self.model.set_optimizer("AdamW", lr=LR, weight_decay=0.0)
        self.model.set_lr_scheduler("constant")
        self.collate = CountingCollate(task.collate, lambda items: sum(len(f.input_ids) for f in items))
        self.loader = DataLoader(data, batch_size, self.collate, shuffle=True, seed=seed)
        self.total = len(self.loader)
        self.iterator = iter(self.loader)
        self.times: list[float] = []

    def step(self) -> None:
        t0 = time.perf_counter()
        batch = next(self.iterator)
        self.model.forward_backward(inputs=batch)
        self.model.clip_grad_and_step(max_grad_norm=MAX_GRAD_NORM)
        self.times.append(time.perf_counter() - t0)

    @property
    def done(self) -> int:
        return len(self.times)

    def result(self) -> dict[str, Any]:
        return {"times": self.times, "tokens": self.collate.tokens, "slots": self.collate.slots,
                "module": self.model.module}


def interleaved_pass(job: dict[str, Any], batch_size: int, seed: int, optim: str | None) -> dict[str, Any]:
    """One ``Trainer.train()`` over the job; after each Trainer step a callback runs the Twinkle loops
    just as far as they should be at that point (the packed loop has fewer, fuller steps and is spread
    evenly). So all contenders run under the same machine load, step by step. The Trainer's step
    time excludes the time spent in the callback."""
    import datasets
    import transformers
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    features = job["features"]
    rows = [{"input_ids": list(features[i].input_ids), "attention_mask": [1] * len(features[i].input_ids),
             "labels": list(features[i].labels)} for i in job["order"]]
    dataset = datasets.Dataset.from_list(rows)
    model = C.build_hf_model(C.BENCH_MODEL, seed)
    collate = CountingCollate(
        DataCollatorForSeq2Seq(job["tokenizer"], padding=True, label_pad_token_id=-100, return_tensors="pt"),
        lambda items: sum(len(x["input_ids"]) for x in items))
    runners = {"twinkle": TwinkleRunner(job, False, batch_size, seed),
               "twinkle_packed": TwinkleRunner(job, True, batch_size, seed)}
    trainer_steps = -(-len(rows) // batch_size)

    class Interleave(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.last = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.times.append(time.perf_counter() - self.last)
            for runner in runners.values():
                while runner.done < round(state.global_step * runner.total / trainer_steps):
                    runner.step()
            self.last = time.perf_counter()

    timer = Interleave()
    with tempfile.TemporaryDirectory() as out:
        extra = {"optim": optim} if optim else {}
        args = TrainingArguments(
            output_dir=out, use_cpu=True, report_to="none", per_device_train_batch_size=batch_size,
            num_train_epochs=1, learning_rate=LR, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
            max_grad_norm=MAX_GRAD_NORM, seed=seed, data_seed=seed, train_sampling_strategy="sequential",
            eval_strategy="no", save_strategy="no", logging_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0, dataloader_pin_memory=False, gradient_accumulation_steps=1, **extra)
        transformers.logging.set_verbosity_error()
        trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate,
                          processing_class=job["tokenizer"], callbacks=[timer])
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        trainer.train()
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
        defaults = dict(inner.defaults)
    for runner in runners.values():  # in case rounding left a step
        while runner.done < runner.total:
            runner.step()
    return {"trainer": {"times": timer.times, "tokens": collate.tokens[: len(timer.times)],
                        "slots": collate.slots[: len(timer.times)], "module": model,
                        "optimizer": {"class": type(inner).__name__, "fused": defaults.get("fused"),
                                      "foreach": defaults.get("foreach")}},
            **{name: r.result() for name, r in runners.items()}}


def tokens_per_second(run: dict[str, Any], warmup: int) -> dict[str, Any]:
    times, tokens = run["times"], run["tokens"]
    if len(times) != len(tokens):
        raise RuntimeError(f"{len(times)} step times but {len(tokens)} token counts")
    w = min(warmup, len(times) - 1)
    slots = run["slots"]
    return {"tokens_per_s": sum(tokens[w:]) / sum(times[w:]), "steps": len(times), "timed_steps": len(times) - w,
            "real_tokens_timed": sum(tokens[w:]), "median_step_ms": C.stats(times[w:])["median"] * 1e3,
            "us_per_token_slot": 1e6 * sum(times[w:]) / sum(slots[w:]),
            "real_token_share_of_slots": sum(tokens[w:]) / sum(slots[w:])}


# ---------------------------------------------------------------------- checks
def packing_check(job: dict[str, Any], seed: int) -> float:
    """Max |logit difference| between a packed row and its samples run one by one."""
    import torch
    from twinkle_backend_hf.model import TransformersModel

    task = job["packed_task"]
    model = TransformersModel(config=dict(C.BENCH_MODEL), seed=seed, task=task)
    row = max(job["packed"][:20], key=lambda f: f.extra.get("num_sequences", 1))
    batch = task.collate([row])
    logits = model.forward_only(inputs=batch)["logits"][0]
    starts = [i for i, p in enumerate(row.position_ids) if p == 0] + [len(row.input_ids)]
    worst = 0.0
    for s, e in zip(starts, starts[1:]):
        ids = torch.tensor([row.input_ids[s:e]])
        alone = model.forward_only(inputs={"input_ids": ids, "attention_mask": torch.ones_like(ids)})["logits"][0]
        worst = max(worst, float((alone - logits[s:e]).abs().max()))
    return worst


def max_param_diff(a: Any, b: Any) -> float:
    import torch

    with torch.no_grad():
        sa, sb = a.state_dict(), b.state_dict()
        return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


# ---------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(parser, repeats=4)
    parser.add_argument("--samples", type=int, default=None, help="chats in the job (default 160)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps at the start of every run")
    args = parser.parse_args()
    threads = C.set_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    q = args.quick
    samples = args.samples or (24 if q else 160)
    repeats = args.repeats or (2 if q else 4)
    warmup = args.warmup if args.warmup is not None else (1 if q else 2)
    bs = args.batch_size

    with C.LoadMonitor() as mon:
        job = load_job(samples, args.seed, bs)
        packing_logit_diff = packing_check(job, args.seed)
        passes: list[dict[str, Any]] = []
        param_diffs: dict[str, float] = {}
        optimizers: dict[str, Any] = {}
        for r in range(repeats):
            trainer_name = "trainer" if r % 2 == 0 else "trainer_adamw"
            runs = interleaved_pass(job, bs, args.seed, None if trainer_name == "trainer" else "adamw_torch")
            optimizers[trainer_name] = runs["trainer"]["optimizer"]
            param_diffs[f"twinkle_vs_{trainer_name}"] = max_param_diff(runs["twinkle"]["module"],
                                                                       runs["trainer"]["module"])
            result = {"trainer_variant": trainer_name,
                      **{name: tokens_per_second(run, warmup) for name, run in runs.items()}}
            # identical batches at every step: the per-step time ratio is a paired, load-robust estimate
            t_tr, t_tw = runs["trainer"]["times"][warmup:], runs["twinkle"]["times"][warmup:]
            result["paired_step_ratio_trainer_over_twinkle"] = C.stats([a / b for a, b in zip(t_tr, t_tw)])
            passes.append(result)
            print(f"pass {r + 1}/{repeats} ({trainer_name}): " + ", ".join(
                f"{n} {result[n]['tokens_per_s']:.0f} tok/s" for n in ("trainer", "twinkle", "twinkle_packed"))
                + f"; load {os.getloadavg()[0]:.2f}", flush=True)
            del runs

    def of(variant: str) -> list[dict[str, Any]]:
        return [p for p in passes if p["trainer_variant"] == variant]

    summary: dict[str, Any] = {}
    for variant in ("trainer", "trainer_adamw"):
        if of(variant):
            summary[variant] = {"tokens_per_s": C.stats([p["trainer"]["tokens_per_s"] for p in of(variant)]),
                                "median_step_ms": C.stats([p["trainer"]["median_step_ms"] for p in of(variant)])["median"],
                                "us_per_token_slot": C.stats([p["trainer"]["us_per_token_slot"]
                                                              for p in of(variant)])["median"],
                                "timed_steps": of(variant)[0]["trainer"]["timed_steps"]}
    for name in ("twinkle", "twinkle_packed"):
        summary[name] = {"tokens_per_s": C.stats([p[name]["tokens_per_s"] for p in passes]),
                         "median_step_ms": C.stats([p[name]["median_step_ms"] for p in passes])["median"],
                         "us_per_token_slot": C.stats([p[name]["us_per_token_slot"] for p in passes])["median"],
                         "timed_steps": passes[0][name]["timed_steps"]}
    ratios: dict[str, Any] = {}
    for variant in ("trainer", "trainer_adamw"):
        if not of(variant):
            continue
        ratios[f"padded: twinkle / {variant}"] = C.stats(
            [p["twinkle"]["tokens_per_s"] / p["trainer"]["tokens_per_s"] for p in of(variant)])
        ratios[f"padded, paired per step: twinkle / {variant}"] = C.stats(
            [p["paired_step_ratio_trainer_over_twinkle"]["median"] for p in of(variant)])
        ratios[f"packed: twinkle_packed / {variant} (padded)"] = C.stats(
            [p["twinkle_packed"]["tokens_per_s"] / p["trainer"]["tokens_per_s"] for p in of(variant)])
    payload = {
        "question": "tokens/s (real tokens) of Twinkle vs transformers.Trainer on the same SFT job; targets: "
                    "padded >= 1.0, Twinkle packed vs Trainer padded >= 1.5",
        "settings": {"quick": q, "threads": threads, "samples": samples, "batch_size": bs, "passes": repeats,
                     "warmup_steps_per_run": warmup, "lr": LR, "weight_decay": 0.0, "lr_scheduler": "constant",
                     "max_grad_norm": MAX_GRAD_NORM, "max_length": MAX_LENGTH, "seed": args.seed,
                     "data": "examples/quickstart/train.jsonl (first N chats), quickstart tokenizer"},
        "model": {"config": C.BENCH_MODEL, "parameters": C.count_parameters(C.BENCH_MODEL)},
        "data": {"real_tokens": job["real_tokens"], "rows_padded": len(job["features"]),
                 "rows_packed": len(job["packed"]), "sample_length": job["length_stats"],
                 "padding_efficiency_padded_batches": job["padding_efficiency"],
                 "packing_efficiency_packed_rows": job["packing_efficiency"],
                 "packing_gain_bound_from_data": job["packing_efficiency"] / job["padding_efficiency"]},
        "trainer_optimizers": optimizers,
        "summary": summary,
        "ratios": ratios,
        "passes": passes,
        "checks": {"packed_vs_separate_max_abs_logit_diff": packing_logit_diff,
                   "final_weights_max_abs_diff": param_diffs},
        "targets": {"padded_min": 1.0, "packed_min": 1.5},
        "meets_targets": {"padded": ratios["padded: twinkle / trainer"]["median"] >= 1.0,
                          "packed": ratios["packed: twinkle_packed / trainer (padded)"]["median"] >= 1.5},
    }
    path = C.write_result("throughput_vs_trainer", payload, mon)

    rows = []
    for name, s in summary.items():
        t = s["tokens_per_s"]
        rows.append([name, C.fmt(t["median"]), f"{C.fmt(t['min'])}-{C.fmt(t['max'])}", t["n"],
                     C.fmt(s["median_step_ms"]), f"{s['us_per_token_slot']:.0f}", s["timed_steps"]])
    print(C.markdown_table(["contender", "real tokens/s (median)", "min-max", "passes", "median ms/step",
                            "µs per token slot", "timed steps/pass"], rows))
    print(C.markdown_table(["ratio", "median", "min-max"],
                           [[k, f"{v['median']:.3f}", f"{v['min']:.3f}-{v['max']:.3f}"] for k, v in ratios.items()]))
    print(f"upper bound of the packing gain from the data alone: {job['packing_efficiency']:.3f} / "
          f"{job['padding_efficiency']:.3f} = {job['packing_efficiency'] / job['padding_efficiency']:.3f}")
    print(f"padding efficiency of padded batches {job['padding_efficiency']:.3f}, packed rows "
          f"{job['packing_efficiency']:.3f}; packed-vs-separate max |logit diff| {packing_logit_diff:.1e}; "
          f"final weights max |diff| " + ", ".join(f"{k} {v:.1e}" for k, v in param_diffs.items()))
    print(mon.short())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
