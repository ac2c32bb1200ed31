"""Training throughput of Twinkle's VLM SFT (task ``vlm``) vs ``transformers.Trainer`` on the same job.

The job: ``--samples`` pictures of the VLM quickstart (``examples/vlm/make_images.py``, 56 x 56 pixels, one
question each), its processor (``examples/vlm/processor``: tokenizer + vision tokens, chat template, PIL
Qwen2-VL image processor) and its tiny Qwen2.5-VL config (``examples/vlm/recipe.yaml``), every part
trained, AdamW lr 1e-3 without weight decay, constant lr, clip 1.0, fp32, batch ``--batch-size``.
Every sample is encoded once by the model's processor through ``VLMTask.load_dataset`` (chat template,
image placeholders expanded, assistant-only labels): all contenders train on the same token ids, labels and
pixel values, in the same order.

Contenders (each pass trains a fresh model of each, from the same seed, one after the other):

* ``trainer``        - ``transformers.Trainer`` on ``AutoModelForImageTextToText``; the collator is the usual
  one for VLM SFT: ``DataCollatorForSeq2Seq`` pads the text (labels with -100), the vision tensors
  (``pixel_values``, ``image_grid_thw``) are concatenated; the model computes its 3-D RoPE positions itself.
  ``optim="adamw_torch"``, the plain ``torch.optim.AdamW`` Twinkle's ``"AdamW"`` builds.
* ``twinkle``        - ``TransformersModel`` + ``VLMTask.collate`` (padded) + ``task.prepare_batch`` (3-D RoPE
  positions) + ``forward_backward`` / ``clip_grad_and_step``, Twinkle's ``DataLoader``.
* ``twinkle_packed`` - the same samples packed padding-free (``load_dataset(packing=True)``), rows of
  ``--max-length`` tokens with per-sample RoPE positions, ``--batch-size`` rows a step (as in
  ``bench/throughput_vs_trainer.py``: a packed step holds several times the tokens of a padded one).

Tokens/s counts real tokens only (no padding); a step's time runs from the end of the previous step to the
end of this one (loading and collation included). The first ``--warmup`` steps of a run are not timed.
Reported: the median over passes of tokens/s, and of the per-pass ratios.

    python bench/vlm_sft.py           # default (~3 min on 1 idle core)
    python bench/vlm_sft.py --quick   # smoke run
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
import warnings
from typing import Any

import _common as C

LR, MAX_GRAD_NORM = 1e-3, 1.0
EXAMPLE = C.ROOT / "examples" / "vlm"
TRAIN_ALL = {"train_vision": "full", "train_projector": "full", "train_language": "full"}


def model_config() -> dict[str, Any]:
    import yaml

    return yaml.safe_load((EXAMPLE / "recipe.yaml").read_text())["model"]["config"]


def load_job(samples: int, max_length: int, directory: str, batch_size: int, seed: int) -> dict[str, Any]:
    import importlib.util

    from transformers import AutoTokenizer
    from twinkle_vlm.task import VLMTask

    from twinkle_core.data.loader import DataLoader

    spec = importlib.util.spec_from_file_location("vlm_make_images", EXAMPLE / "make_images.py")
    make_images = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_images)
    rows, _ = make_images.build(directory, train=samples, evaluation=0)
    for row in rows:  # image paths are relative to the data file; these rows have none
        row["messages"][0]["content"][0]["image"] = os.path.join(directory, row["messages"][0]["content"][0]["image"])
    tokenizer = AutoTokenizer.from_pretrained(str(EXAMPLE / "processor"))
    task, packed_task = VLMTask(**TRAIN_ALL), VLMTask(**TRAIN_ALL)
    features = task.load_dataset(rows, tokenizer, max_length=max_length)
    packed = packed_task.load_dataset(rows, tokenizer, max_length=max_length, packing=True)
    lengths = [len(f.input_ids) for f in features]
    order_loader = DataLoader(features, batch_size, shuffle=True, seed=seed)  # the padded runs' batches
    batches = [order_loader.batch_indices(0, b) for b in range(len(order_loader))]
    padded_slots = sum(max(lengths[i] for i in batch) * len(batch) for batch in batches)
    return {"padding_efficiency": sum(lengths) / padded_slots,
            "tokenizer": tokenizer, "task": task, "packed_task": packed_task, "features": features,
            "packed": packed, "real_tokens": sum(lengths), "length_stats": C.stats(lengths),
            "packing_efficiency": sum(lengths) / (len(packed) * max_length)}


def real_tokens(batch: dict[str, Any]) -> int:
    """Non-pad tokens of a collated batch (packed rows have no attention mask: every token is real)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None and mask.dim() == 2 else int(batch["input_ids"].numel())


def run_twinkle(job: dict[str, Any], packed: bool, batch_size: int, seed: int, steps: int) -> dict[str, Any]:
    from twinkle_backend_hf.model import TransformersModel

    from twinkle_core.data.loader import DataLoader

    task = job["packed_task"] if packed else job["task"]
    model = TransformersModel(config=model_config(), seed=seed, task=task, tokenizer=job["tokenizer"])
    task.prepare_model(model)
    model.set_loss("cross_entropy")
    model.set_optimizer("AdamW", lr=LR, weight_decay=0.0)
    model.set_lr_scheduler("constant")
    loader = DataLoader(job["packed"] if packed else job["features"], batch_size, task.collate, shuffle=True,
                        seed=seed)
    times, tokens = [], []
    iterator = iter(loader)
    t0 = time.perf_counter()
    for _ in range(min(steps, len(loader))):
        batch = task.prepare_batch(model, next(iterator))
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step(max_grad_norm=MAX_GRAD_NORM)
        tokens.append(real_tokens(batch))
        now = time.perf_counter()
        times.append(now - t0)
        t0 = now
    return {"times": times, "tokens": tokens}


def run_trainer(job: dict[str, Any], batch_size: int, seed: int, steps: int) -> dict[str, Any]:
    import datasets
    import torch
    import transformers
    from transformers import (
        AutoModelForImageTextToText,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    vision_keys = ("pixel_values", "image_grid_thw")
    rows = [{"input_ids": list(f.input_ids), "attention_mask": [1] * len(f.input_ids), "labels": list(f.labels),
             "index": i} for i, f in enumerate(job["features"])]
    text_collator = DataCollatorForSeq2Seq(job["tokenizer"], padding=True, label_pad_token_id=-100,
                                           return_tensors="pt")
    tokens: list[int] = []

    def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
        vision = {k: torch.cat([job["features"][x["index"]].vision[k] for x in items]) for k in vision_keys}
        batch = text_collator([{k: v for k, v in x.items() if k != "index"} for x in items])
        tokens.append(real_tokens(batch))
        return {**batch, **vision}

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.last = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now

    spec = model_config()
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    timer = Timer()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, use_cpu=True, report_to="none", per_device_train_batch_size=batch_size, max_steps=steps,
            learning_rate=LR, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
            max_grad_norm=MAX_GRAD_NORM, seed=seed, data_seed=seed, eval_strategy="no", save_strategy="no",
            logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=False,
            remove_unused_columns=False)
        transformers.logging.set_verbosity_error()
        trainer = Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                          data_collator=collate, callbacks=[timer])
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        trainer.train()
    return {"times": timer.times, "tokens": tokens[: len(timer.times)]}


def tokens_per_second(run: dict[str, Any], warmup: int) -> dict[str, Any]:
    times, tokens = run["times"], run["tokens"]
    w = min(warmup, len(times) - 1)
    return {"tokens_per_s": sum(tokens[w:]) / sum(times[w:]), "timed_steps": len(times) - w,
            "median_step_ms": C.stats(times[w:])["median"] * 1e3, "real_tokens_timed": sum(tokens[w:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(parser, repeats=3)
    parser.add_argument("--samples", type=int, default=None, help="pictures in the job (default 1280)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=256, help="max tokens of a sample / of a packed row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every run")
    args = parser.parse_args()
    threads = C.set_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    samples = args.samples or (64 if args.quick else 1280)
    repeats = args.repeats or (1 if args.quick else 3)
    steps = -(-samples // args.batch_size)  # one pass over the padded samples

    with C.LoadMonitor() as mon, tempfile.TemporaryDirectory() as data_dir:
        job = load_job(samples, args.max_length, data_dir, args.batch_size, args.seed)
        passes = []
        for r in range(repeats):
            runs = {"trainer": run_trainer(job, args.batch_size, args.seed, steps),
                    "twinkle": run_twinkle(job, False, args.batch_size, args.seed, steps),
                    "twinkle_packed": run_twinkle(job, True, args.batch_size, args.seed, steps)}
            result = {name: tokens_per_second(run, args.warmup) for name, run in runs.items()}
            passes.append(result)
            print(f"pass {r + 1}/{repeats}: " + ", ".join(f"{n} {v['tokens_per_s']:.0f} tok/s"
                                                          for n, v in result.items())
                  + f"; load {os.getloadavg()[0]:.2f}", flush=True)

    summary = {name: {"tokens_per_s": C.stats([p[name]["tokens_per_s"] for p in passes]),
                      "median_step_ms": C.stats([p[name]["median_step_ms"] for p in passes])["median"],
                      "timed_steps": passes[0][name]["timed_steps"]}
               for name in ("trainer", "twinkle", "twinkle_packed")}
    ratios = {"padded: twinkle / trainer": C.stats([p["twinkle"]["tokens_per_s"] / p["trainer"]["tokens_per_s"]
                                                    for p in passes]),
              "packed: twinkle_packed / trainer (padded)": C.stats(
                  [p["twinkle_packed"]["tokens_per_s"] / p["trainer"]["tokens_per_s"] for p in passes])}
    payload = {
        "question": "tokens/s (real tokens) of Twinkle's vlm SFT vs transformers.Trainer on the same job; "
                    "targets: padded >= 1.0, Twinkle packed vs Trainer padded >= 1.3",
        "settings": {"quick": args.quick, "threads": threads, "samples": samples, "batch_size": args.batch_size,
                     "steps_per_run": steps, "max_length": args.max_length, "passes": repeats,
                     "warmup_steps_per_run": args.warmup, "lr": LR, "max_grad_norm": MAX_GRAD_NORM,
                     "seed": args.seed, "parts": TRAIN_ALL,
                     "packed_batch": "batch_size rows of max_length tokens each (as bench/throughput_vs_trainer.py): "
                                     "a packed step holds more tokens than a padded one",
                     "data": "examples/vlm/make_images.py pictures (56 x 56, 4 image tokens), examples/vlm/processor"},
        "model": {"config": model_config()},
        "data": {"real_tokens": job["real_tokens"], "rows_padded": len(job["features"]),
                 "rows_packed": len(job["packed"]), "sample_length": job["length_stats"],
                 "padding_efficiency_padded_batches": job["padding_efficiency"],
                 "packing_efficiency_packed_rows": job["packing_efficiency"],
                 "packing_gain_bound_from_data": job["packing_efficiency"] / job["padding_efficiency"]},
        "summary": summary,
        "ratios": ratios,
        "passes": passes,
        "targets": {"padded_min": 1.0, "packed_min": 1.3},
        "meets_targets": {"padded": ratios["padded: twinkle / trainer"]["median"] >= 1.0,
                          "packed": ratios["packed: twinkle_packed / trainer (padded)"]["median"] >= 1.3},
    }
    path = C.write_result("vlm_sft", payload, mon, args.out_dir)
    print(C.markdown_table(["contender", "real tokens/s (median)", "min-max", "median ms/step", "timed steps"],
                           [[n, C.fmt(s["tokens_per_s"]["median"]),
                             f"{C.fmt(s['tokens_per_s']['min'])}-{C.fmt(s['tokens_per_s']['max'])}",
                             C.fmt(s["median_step_ms"]), s["timed_steps"]] for n, s in summary.items()]))
    print(C.markdown_table(["ratio", "median", "min-max"],
                           [[k, f"{v['median']:.3f}", f"{v['min']:.3f}-{v['max']:.3f}"] for k, v in ratios.items()]))
    print(f"padding efficiency of padded batches {job['padding_efficiency']:.3f}, packed rows "
          f"{job['packing_efficiency']:.3f}: removing padding alone gains at most "
          f"{job['packing_efficiency'] / job['padding_efficiency']:.3f}x")
    print(mon.short())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
