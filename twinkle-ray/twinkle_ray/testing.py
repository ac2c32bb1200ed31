"""Test helpers: rewards that misbehave on purpose, for testing the ``ray_pool`` reward (importable by Ray's workers),
and the tiny GRPO recipe the role tests run."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

#: the repository's examples (bundled tokenizer and GRPO prompts); an editable install's tests read them
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def grpo_recipe(out: Path, *, sampler: dict[str, Any], rewards: list[Any] | None = None,
                **task_options: Any) -> dict[str, Any]:
    """A tiny GRPO run on 2 DDP ranks: 3 steps of a 2-layer qwen2 of hidden size 32, 4 generations per prompt."""
    return {
        "task": "grpo",
        "task_options": {"num_generations": 4, "sampling": {"temperature": 1.0, "max_new_tokens": 6},
                         "sampler": sampler, "rewards": rewards or ["twinkle_ray.testing:length_reward"],
                         **task_options},
        "model": {"class_name": "TransformersModel", "tokenizer": str(EXAMPLES / "quickstart" / "tokenizer"),
                  "config": {"model_type": "qwen2", "vocab_size": 262, "hidden_size": 32, "intermediate_size": 64,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "max_position_embeddings": 128, "tie_word_embeddings": True, "bos_token_id": 0,
                             "eos_token_id": 0, "pad_token_id": 0}},
        "precision": "no",
        "strategy": {"name": "ddp"},
        "data": {"train": str(EXAMPLES / "grpo" / "train.jsonl"), "batch_size": 2},
        "optimizer": {"name": "AdamW", "lr": 1e-2, "weight_decay": 0.0},
        "lr_scheduler": {"name": "constant"},
        "train": {"output_dir": str(out), "max_steps": 3, "seed": 0, "log_every": 1, "eval_before_training": False},
    }


def length_reward(prompts, completions, **fields):
    return [float(len(c)) for c in completions]


def slow_on_marker(prompts, completions, **fields):
    """Hangs on a completion that contains ``SLOW``."""
    if any("SLOW" in c for c in completions):
        time.sleep(600)
    return length_reward(prompts, completions)


def dies_on_marker(prompts, completions, **fields):
    """Kills its own process on a completion that contains ``DIE``."""
    if any("DIE" in c for c in completions):
        os._exit(9)
    return length_reward(prompts, completions)


def exits_on_marker(prompts, completions, **fields):
    """Calls ``sys.exit`` on a completion that contains ``EXIT``."""
    if any("EXIT" in c for c in completions):
        sys.exit(3)
    return length_reward(prompts, completions)


def worker_pid(prompts, completions, **fields):
    return [float(os.getpid())] * len(completions)
