"""``MegatronModel`` from a recipe, as ``twinkle train`` builds it: the trainer passes every model class
``attn_implementation`` and ``gradient_checkpointing``; MegatronModel takes them (the second as ``recompute:
full``, the first refused with the reason) instead of crashing on unknown options."""

from __future__ import annotations

import json
import os

import pytest

from twinkle_core.errors import ConfigError
from twinkle_core.train.loop import train

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
QUICKSTART = os.path.join(REPO, "examples", "quickstart")


def recipe(tmp_path, **model):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(os.path.join(QUICKSTART, "tokenizer")))
    return {
        "task": "causal_lm",
        "model": {"class_name": "MegatronModel", "tokenizer": os.path.join(QUICKSTART, "tokenizer"),
                  "config": {"model_type": "qwen2", "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "max_position_embeddings": 128, "tie_word_embeddings": True}, **model},
        "strategy": "megatron",
        "data": {"train": os.path.join(QUICKSTART, "train.jsonl"), "mode": "chat", "max_length": 64,
                 "batch_size": 4},
        "optimizer": {"name": "AdamW", "lr": 1e-3},
        "train": {"output_dir": str(tmp_path), "max_steps": 2, "seed": 0, "log_every": 1},
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_twinkle_train_builds_and_trains_a_megatron_model(tmp_path, checkpointing):
    summary = train(recipe(tmp_path, gradient_checkpointing=checkpointing))
    assert summary["steps"] == 2
    losses = [json.loads(line)["loss"] for line in (tmp_path / "logs.jsonl").read_text().splitlines()]
    assert all(loss is not None and loss > 0 for loss in losses)
    assert (tmp_path / "final" / "config.json").is_file()  # a plain transformers directory


def test_an_attention_implementation_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ConfigError, match="MegatronModel builds megatron-core's own attention"):
        train(recipe(tmp_path, attn_implementation="sdpa"))
