"""The ``reward_model`` and ``gkd`` tasks through the trainer on any backend; every step's log and the final weights.

    python post_training_dist.py --init DIR                          # pairs, chats, tiny teacher / HF weights, once
    python post_training_dist.py --init DIR --out OUT.json --runs '[{"task": "reward_model"}]'
    torchrun --nproc-per-node 2 post_training_dist.py --init DIR --out OUT.json \
        --runs '[{"task": "reward_model", "strategy": "ddp"}, {"task": "gkd", "strategy": "native_fsdp"}]'

Each run trains :data:`STEPS` AdamW steps (fp32, clipping at :data:`MAX_GRAD_NORM`) with
``twinkle_core.train.loop.Trainer`` (the trainer behind ``twinkle train``) on :data:`ROWS_PER_STEP` global rows per
step (``data.batch_size`` is that divided by the data-parallel ranks): preference pairs for ``reward_model``
(a one-score head, the ``bradley_terry`` loss), chats for ``gkd`` (the student a tiny Qwen2 from a config, the
teacher a sibling built from the saved tiny Qwen2 ``teacher`` under ``--init``, the ``gkd`` loss).

A run (a JSON object in ``--runs``):

* ``task``: ``reward_model`` or ``gkd``; ``lmbda`` (gkd, default 0: the data's answers, no sampling);
* ``strategy``: ``single``, ``ddp``, ``native_fsdp`` (TransformersModel);
* ``backend``: ``hf`` (default) or ``megatron`` (``MegatronModel`` with ``mesh``, from the saved ``student``
  weights; ``weights: true`` trains an HF run from them too: Megatron's reference);
* ``reverse``: every batch's rows in reverse order (the task's ``collate`` wrapped): the same mathematics in
  another summation order, the float spread of the reference (``twinkle_core.testing.tolerance``).

A run's result: ``logs`` (the trainer's train log lines), ``dp_size``, ``world_size``, ``weights`` (the final
``model.get_state_dict()`` saved by rank 0 as ``OUT.<run index>.pt``; every rank calls it, a collective under
FSDP2 and Megatron), ``seconds``; or ``error`` (the ``ConfigError`` message) when the backend refused the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import warnings
from typing import Any

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
TOKENIZER_DIR = os.path.join(REPO, "examples", "quickstart", "tokenizer")

ROWS_PER_STEP = 4  # global pairs (reward_model) or chats (gkd) per step
STEPS = 3
LR = 1e-2
MAX_GRAD_NORM = 1.0
TRAIN_SEED = 0
TEACHER_SEED = 1
TEACHER_INIT_RANGE = 0.5
MAX_NEW_TOKENS = 6


def words(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6))) for _ in range(count)]


def pair_rows() -> list[dict[str, Any]]:
    return [{"prompt": f"upper: {w}", "chosen": w.upper(), "rejected": w} for w in words(0, ROWS_PER_STEP * STEPS)]


def chat_rows() -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": f"upper: {w}"}, {"role": "assistant", "content": w.upper()}]}
            for w in words(1, ROWS_PER_STEP * STEPS)]


def tiny_config(tokenizer: Any, **overrides: Any) -> dict[str, Any]:
    from twinkle_backend_hf.testing import tiny_qwen2_config

    return tiny_qwen2_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **overrides)


# ---------------------------------------------------------------------- set-up
def init(directory: str, tokenizer: Any) -> None:
    """``pairs.jsonl``, ``chats.jsonl``, the tiny teacher ``teacher`` and the student's weights ``student`` (HF)."""
    from twinkle_backend_hf.model import TransformersModel

    os.makedirs(directory, exist_ok=True)
    for name, rows in (("pairs.jsonl", pair_rows()), ("chats.jsonl", chat_rows())):
        with open(os.path.join(directory, name), "w") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in rows)
    # the teacher's weights drawn wider than the student's: its distributions are far from uniform, a divergence
    # (and gradient) well above the rounding of the loss
    for name, seed, scale in (("teacher", TEACHER_SEED, TEACHER_INIT_RANGE), ("student", TRAIN_SEED, None)):
        config = tiny_config(tokenizer, **({"initializer_range": scale} if scale else {}))
        TransformersModel(config=config, seed=seed).save(name, output_dir=directory, save_optimizer=False)


def recipe(spec: dict[str, Any], init_dir: str, output_dir: str, dp_size: int, tokenizer: Any) -> dict[str, Any]:
    backend, task = spec.get("backend", "hf"), spec["task"]
    model: dict[str, Any] = {"class_name": "MegatronModel" if backend == "megatron" else "TransformersModel",
                             "tokenizer": TOKENIZER_DIR}
    if spec.get("weights") or backend == "megatron":
        model["model_id"] = os.path.join(init_dir, "student")
    else:
        model["config"] = tiny_config(tokenizer)
    task_options: dict[str, Any] = {}
    if task == "gkd":
        task_options = {"teacher": os.path.join(init_dir, "teacher"), "lmbda": float(spec.get("lmbda", 0.0)),
                        "max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0, "seed": TRAIN_SEED}
    strategy: dict[str, Any] = {"name": "megatron" if backend == "megatron" else spec.get("strategy", "single")}
    if backend == "megatron":
        # the gkd loss compares whole next-token distributions: the logits are gathered over the TP ranks
        strategy["options"] = {"vocab_parallel_loss": False}
    return {
        "task": task,
        "task_options": task_options,
        "model": model,
        "strategy": strategy,
        "mesh": spec.get("mesh"),
        "precision": "no",
        "data": {"train": os.path.join(init_dir, "pairs.jsonl" if task == "reward_model" else "chats.jsonl"),
                 "batch_size": ROWS_PER_STEP // dp_size, "shuffle": False, "max_length": 48},
        "optimizer": {"name": "AdamW", "lr": LR, "weight_decay": 0.0},
        "lr_scheduler": {"name": "constant"},
        "train": {"output_dir": output_dir, "max_steps": STEPS, "max_grad_norm": MAX_GRAD_NORM, "seed": TRAIN_SEED,
                  "log_every": 1},
    }


def reverse_rows(reverse: bool) -> None:
    """Make both tasks' ``collate`` take every batch's rows in reverse order (or restore it)."""
    from twinkle_rl.distill_task import GKDTask
    from twinkle_rl.reward_model_task import RewardModelTask

    for cls in (RewardModelTask, GKDTask):
        original = cls.__dict__.get("original_collate") or cls.__dict__["collate"]
        cls.original_collate = original
        cls.collate = (lambda self, features, f=original: f(self, list(features)[::-1])) if reverse else original


# ---------------------------------------------------------------------- one run
def one_run(index: int, spec: dict[str, Any], init_dir: str, out: str, tokenizer: Any) -> dict[str, Any] | None:
    import torch

    from twinkle_core import distributed
    from twinkle_core.errors import ConfigError
    from twinkle_core.train.loop import Trainer
    from twinkle_core.train.recipe import recipe_from_dict

    start = time.monotonic()
    world = distributed.world_size()
    dp_size = 1 if spec.get("backend") == "megatron" else world  # TP ranks share their data-parallel rank
    output_dir = f"{out}.work/{index}"
    reverse_rows(bool(spec.get("reverse")))
    try:
        trainer = Trainer(recipe_from_dict(recipe(spec, init_dir, output_dir, dp_size, tokenizer)))
        trainer.run()
    except ConfigError as exc:  # a backend that refuses the task: the test reads the reason
        return {"spec": spec, "error": str(exc)} if distributed.is_main_process() else None
    assert (trainer.dp_size or 1) == dp_size, (trainer.dp_size, dp_size)
    state = {k: v.detach().float().cpu().clone() for k, v in trainer.model.get_state_dict().items()}
    if not distributed.is_main_process():
        return None
    weights = f"{out}.{index}.pt"
    torch.save(state, weights)
    with open(os.path.join(output_dir, "logs.jsonl")) as fh:
        logs = [json.loads(line) for line in fh if line.strip()]
    return {"spec": spec, "logs": [line for line in logs if line["event"] == "train"], "dp_size": dp_size,
            "world_size": world, "weights": weights, "seconds": round(time.monotonic() - start, 2)}


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--init", required=True, help="the data and tiny weights (written when missing)")
    parser.add_argument("--runs", default=None, help="JSON list of runs (see the module docstring)")
    parser.add_argument("--out", default=None, help="JSON file rank 0 writes: one result per run")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from twinkle_core import distributed

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    if not os.path.exists(os.path.join(args.init, "chats.jsonl")):
        if distributed.world_size() > 1:
            raise SystemExit(f"{args.init} has no chats.jsonl: run --init in one process first")
        init(args.init, tokenizer)
    if args.runs:
        results = [one_run(i, spec, args.init, args.out, tokenizer) for i, spec in enumerate(json.loads(args.runs))]
        if distributed.is_main_process():
            with open(args.out + ".tmp", "w") as fh:
                json.dump(results, fh)
            os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
    from twinkle_core.testing.torchrun import exit_job

    exit_job()
