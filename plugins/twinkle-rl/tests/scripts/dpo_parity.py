"""DPO parity run: the same preference pairs, tiny model and optimizer on any backend; per-step results to JSON.

    python dpo_parity.py --init DIR                          # write the tiny HF weights and LoRA inits once
    python dpo_parity.py --weights DIR --out OUT.json --runs '[{"reference": "model"}, {"reference": "model",
                                                                "reverse": true}]'
    torchrun --nproc-per-node 2 dpo_parity.py --weights DIR --out OUT.json \
        --runs '[{"strategy": "ddp", "reference": "model"}]'

Everything goes through the Python API, exactly as ``twinkle train`` drives a preference run:
``PreferenceTask(reference=...)``, ``task.prepare_model(model)`` before the adapter,
``task.load_dataset`` + ``task.prepare_dataset(model, ...)`` once, then the trainer's own ``DataLoader``
(``task.collate``; a feature is a whole pair, dealt to the data-parallel ranks ``[dp_rank::dp_size]``, so
every rank takes its share of whole pairs of every global batch) and per batch ``task.prepare_batch(model, batch)``,
``model.forward_backward``, ``model.clip_grad_and_step`` and ``model.calculate_metric``.

:data:`STEPS` AdamW steps (fp32, clipping at :data:`MAX_GRAD_NORM`) of :data:`PAIRS` global pairs each, on a
fixed list of "reverse the word" pairs (:func:`pair_rows`).

Each run of ``--runs`` (several share one job and its start-up time) is a JSON object:

* ``backend``: ``hf`` (default, ``TransformersModel``), ``megatron`` (``MegatronModel``) or ``multi_lora``
  (``MultiLoraTransformersModel``);
* ``reference``: the task's ``task_options.reference`` (``model``, ``adapter``, ``precomputed``);
* ``lora``: the name of a LoRA init under ``--weights`` (``lora_a`` / ``lora_b``): train that adapter;
* ``strategy``, ``strategy_options``, ``mesh``: as the model takes them;
* ``reverse``: feed every batch's pairs in reverse order (the same mathematics in another summation order:
  the reference's own float spread, see ``twinkle_core.testing.tolerance``); ``--reverse`` sets it for all;
* ``float64`` (``hf`` only): train in float64 (the reference's distance from it is its rounding noise,
  see ``twinkle_core.testing.tolerance``);
* ``tenants`` (``multi_lora`` only): ``[{"name", "lora", "reference"}, ...]``; each tenant has its own
  ``PreferenceTask(reference=..., adapter_name=name)``; the tenants train interleaved, step by step, every
  model call with ``adapter_name``; the run's result has one entry per tenant.

A run's result: ``losses``, ``grad_norms`` (pre-clip), ``margins`` / ``accuracies`` / ``chosen`` /
``rejected`` (the ``rewards/*`` metrics of every step), ``logps_chosen`` / ``logps_rejected`` (``logps/*``),
``dp_size``, ``world_size`` and, for the rounding floors of the tolerances, ``tokens_per_step`` (sequence
tokens of a global batch), ``answer_tokens`` (per step) and ``trainable_numel``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
import warnings
from typing import Any

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
TOKENIZER_DIR = os.path.join(REPO, "examples", "quickstart", "tokenizer")

STEPS = 5
PAIRS = 4  # global pairs per step
LR = 2e-2
BETA = 0.5
MAX_GRAD_NORM = 1.0
VOCAB = 262  # the bundled chat tokenizer's
LORA = {"type": "lora", "r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
#: (name, torch seed) of the LoRA inits written by --init: random A and B (init_lora_weights=False), so the
#: policy differs from its base (the adapter reference) from the first step
LORA_INITS = (("lora_a", 11), ("lora_b", 12))

WORDS = ["moist", "apple", "zebra", "quiet", "lamp", "river", "stone", "cloud", "tiger", "piano",
         "grape", "north", "mint", "candle", "frost", "plum", "orbit", "velvet", "dusk", "maple"]


def pair_rows() -> list[dict[str, Any]]:
    """``STEPS * PAIRS`` preference pairs: the reversed word is chosen, a plausible wrong answer rejected
    (the first and last letters swapped, or the word itself), so answers of one pair differ in length too."""
    assert len(WORDS) == STEPS * PAIRS
    rows = []
    for i, word in enumerate(WORDS):
        wrong = word[-1] + word[1:-1] + word[0] if i % 2 else word + word[-1]
        rows.append({"prompt": f"reverse: {word}", "chosen": word[::-1], "rejected": wrong})
    return rows


# ---------------------------------------------------------------------- weights
def init_weights(directory: str) -> None:
    """The tiny Qwen2 as an HF directory (``base``) and two LoRA inits on it (PEFT directories)."""
    import torch
    from twinkle_backend_hf.model import TransformersModel
    from twinkle_backend_hf.testing import tiny_qwen2_config

    TransformersModel(config=tiny_qwen2_config(vocab_size=VOCAB), seed=0).save(
        "base", output_dir=directory, save_optimizer=False)
    for name, seed in LORA_INITS:
        model = TransformersModel(model_id=os.path.join(directory, "base"))
        torch.manual_seed(seed)
        model.add_adapter_to_model("t", {**LORA, "init_lora_weights": False})
        model.save(name, output_dir=directory, adapter_name="t", save_optimizer=False)


# ---------------------------------------------------------------------- one run
def build_model(spec: dict[str, Any], weights: str, task: Any) -> Any:
    base = os.path.join(weights, "base")
    backend = spec.get("backend", "hf")
    options = {"strategy_options": spec.get("strategy_options") or {}, "mesh": spec.get("mesh") or None,
               "task": task}
    if backend == "hf":
        from twinkle_backend_hf.model import TransformersModel

        model = TransformersModel(model_id=base, strategy=spec.get("strategy", "single"), **options)
        if spec.get("float64"):
            model.hf_model.double()  # before task.prepare_model: the frozen reference copy is float64 too
        return model
    if backend == "multi_lora":
        from twinkle_backend_hf.multi_lora import MultiLoraTransformersModel

        return MultiLoraTransformersModel(model_id=base, **options)
    if backend == "megatron":
        from twinkle_backend_megatron.model import MegatronModel

        return MegatronModel(model_id=base, **options)
    raise ValueError(f"unknown backend {backend!r}")


class Trainee:
    """One policy being trained (the model, or one tenant of a multi-LoRA model) with its own task."""

    def __init__(self, model: Any, task: Any, adapter: str | None, reference: str, lora: str | None,
                 weights: str, tokenizer: Any, work: str) -> None:
        self.model, self.task, self.adapter = model, task, adapter
        self.kw = {"adapter_name": adapter} if adapter else {}
        if lora:
            model.add_adapter_to_model(adapter, copy.deepcopy(LORA))
            model.load(os.path.join(weights, lora), adapter_name=adapter)
        model.set_loss("dpo", beta=BETA, **self.kw)
        model.set_optimizer("AdamW", lr=LR, weight_decay=0.01, **self.kw)
        self.features = task.load_dataset(pair_rows(), tokenizer)
        self.work = work
        self.result: dict[str, Any] = {"reference": reference, "lora": lora, "losses": [], "grad_norms": [],
                                       "margins": [], "accuracies": [], "chosen": [], "rejected": [],
                                       "logps_chosen": [], "logps_rejected": [], "tokens_per_step": [],
                                       "answer_tokens": [], "trainable_numel": sum(
                                           getattr(p, "ds_numel", p.numel())  # ZeRO-3 partitions in place
                                           for p in model.trainable_parameters(**self.kw))}

    def prepare(self, reverse: bool, dp_rank: int, dp_size: int) -> None:
        """``prepare_dataset`` once, then the trainer's loader over the pairs: global batch ``b`` is pairs
        ``b * PAIRS ...`` (reversed with ``reverse``), of which this rank takes ``[dp_rank::dp_size]``."""
        from twinkle_core.data.loader import DataLoader

        self.features = self.task.prepare_dataset(self.model, self.features, split="train", output_dir=self.work)
        if reverse:
            self.features = [f for b in range(0, len(self.features), PAIRS) for f in self.features[b:b + PAIRS][::-1]]
        self.loader = iter(DataLoader(self.features, PAIRS // dp_size, self.task.collate, shuffle=False,
                                      dp_rank=dp_rank, dp_size=dp_size))

    def step(self, step: int) -> None:
        full = self.task.collate(self.features[step * PAIRS:(step + 1) * PAIRS])  # only to count its tokens
        batch = self.task.prepare_batch(self.model, next(self.loader))
        self.model.forward_backward(inputs=batch, **self.kw)
        norm = self.model.clip_grad_and_step(max_grad_norm=MAX_GRAD_NORM, **self.kw)
        metrics = self.model.calculate_metric(**self.kw)
        r = self.result
        r["losses"].append(float(metrics["loss"]))
        r["grad_norms"].append(float(norm))
        for key in ("margins", "accuracies", "chosen", "rejected"):
            r[key].append(float(metrics[f"rewards/{key}"]))
        r["logps_chosen"].append(float(metrics["logps/chosen"]))
        r["logps_rejected"].append(float(metrics["logps/rejected"]))
        r["tokens_per_step"].append(int(full["attention_mask"].sum()))
        r["answer_tokens"].append(int((full["labels"] != -100).sum()))


def one_run(spec: dict[str, Any], weights: str, tokenizer: Any, reverse: bool, work: str) -> Any:
    from twinkle_rl.task import PreferenceTask

    from twinkle_core import distributed

    start = time.monotonic()
    reverse = bool(spec.get("reverse", reverse))
    tenants = spec.get("tenants")
    if tenants:  # one task per tenant, each with its own reference setting
        tasks = [PreferenceTask(reference=t["reference"], adapter_name=t["name"]) for t in tenants]
        model = build_model(spec, weights, tasks[0])
        for task in tasks:
            task.prepare_model(model)  # before the adapters, as the trainer does
        trainees = [Trainee(model, task, t["name"], t["reference"], t["lora"], weights, tokenizer,
                            os.path.join(work, t["name"])) for task, t in zip(tasks, tenants, strict=True)]
    else:
        task = PreferenceTask(reference=spec["reference"])
        model = build_model(spec, weights, task)
        task.prepare_model(model)  # before the adapter, as the trainer does (a frozen copy of the initial weights)
        lora = spec.get("lora")
        trainees = [Trainee(model, task, "default" if lora else None, spec["reference"], lora, weights, tokenizer,
                            work)]
    configs = model.get_train_configs()
    dp_rank, dp_size = int(configs["dp_rank"]), int(configs["dp_size"])
    assert PAIRS % dp_size == 0, f"{PAIRS} pairs a step do not split over {dp_size} data-parallel ranks"
    for trainee in trainees:
        trainee.prepare(reverse, dp_rank, dp_size)
    for step in range(STEPS):
        for trainee in trainees:  # tenants interleaved step by step
            trainee.step(step)
    meta = {"spec": spec, "reverse": reverse, "dp_size": dp_size, "world_size": distributed.world_size(),
            "seconds": round(time.monotonic() - start, 2)}
    if tenants:
        return {**meta, "tenants": {t.adapter: t.result for t in trainees}}
    return {**meta, **trainees[0].result}


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--init", default=None, help="write the tiny HF weights and LoRA inits to this directory")
    parser.add_argument("--weights", default=None, help="the --init directory to train from")
    parser.add_argument("--runs", default=None, help="JSON list of runs (see the module docstring)")
    parser.add_argument("--out", default=None, help="JSON file rank 0 writes: one result per run")
    parser.add_argument("--reverse", action="store_true", help="reverse every batch's pairs in every run")
    args = parser.parse_args()

    from twinkle_core import distributed

    if args.init:
        if distributed.is_main_process():
            init_weights(args.init)
        distributed.barrier()
    if args.runs:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
        runs = json.loads(args.runs)
        # each run's output directory (the precomputed reference's cache), next to the results
        results = [one_run(spec, args.weights, tokenizer, args.reverse, f"{args.out}.work/{i}")
                   for i, spec in enumerate(runs)]
        if distributed.is_main_process():
            tmp = args.out + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(results, fh, indent=1)
            os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
    from twinkle_core.testing.torchrun import exit_job

    exit_job()
