"""Multi-turn agentic rollouts trained end to end by ``twinkle train``'s loop on a tiny Qwen2 from a config: the
bundled calculator with LoRA, and an environment that always answers, one step off (full weights)."""

from __future__ import annotations

import json
import math
import os

import pytest

from twinkle_core.environments import Environment, StepResult
from twinkle_core.train.loop import train

pytest.importorskip("twinkle_backend_hf")

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DIR = os.path.join(HERE, "..", "..", "..", "examples", "quickstart", "tokenizer")


class Chatty(Environment):
    """Answers every turn (so that every trajectory holds environment tokens) and rewards turns with an 'e'."""

    def step(self, message):
        return StepResult(observation="noted", reward=float("e" in message.text) / 4)


def prompts(tmp_path):
    rows = [{"prompt": f"{a}*{b}=?", "answer": str(a * b)} for a in range(11, 15) for b in range(21, 23)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def agent_recipe(tmp_path, environment, **task_options):
    return {
        "task": "grpo",
        "task_options": {"num_generations": 2, "environment": environment,
                         # stop strings end a turn early: the untrained model rarely writes its end-of-turn token
                         "sampling": {"max_new_tokens": 6, "stop": ["e", "a", "o", "1"]}, **task_options},
        "model": {"class_name": "TransformersModel", "tokenizer": TOKENIZER_DIR,
                  "config": {"model_type": "qwen2", "vocab_size": 262, "hidden_size": 32, "intermediate_size": 64,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "max_position_embeddings": 128, "tie_word_embeddings": True}},
        "precision": "no",
        "data": {"train": prompts(tmp_path), "batch_size": 2},
        "optimizer": {"name": "AdamW", "lr": 1e-2, "weight_decay": 0.0},
        "lr_scheduler": {"name": "constant"},
        "train": {"output_dir": str(tmp_path / "out"), "max_steps": 2, "seed": 0, "log_every": 1},
    }


def train_lines(tmp_path):
    lines = [json.loads(line) for line in (tmp_path / "out" / "logs.jsonl").read_text().splitlines()]
    return [line for line in lines if line["event"] == "train"]


@pytest.mark.timeout(120)
def test_grpo_with_lora_and_the_calculator(tmp_path):
    recipe = agent_recipe(tmp_path, {"name": "calculator", "max_turns": 2, "max_total_tokens": 40})
    recipe["model"]["adapter"] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    recipe["data"]["eval"] = recipe["data"]["train"]
    recipe["train"].update(eval_before_training=True, evaluate_options={"limit": 3, "batch_size": 2})
    train(recipe)
    lines = train_lines(tmp_path)
    assert len(lines) == 2
    evaluation = [json.loads(line) for line in (tmp_path / "out" / "logs.jsonl").read_text().splitlines()
                  if json.loads(line)["event"] == "eval"][0]  # greedy trajectories of held-out prompts
    assert evaluation["eval_num_examples"] == 3 and "eval_turns_mean" in evaluation
    assert evaluation["eval_accuracy"] == evaluation["eval_reward/environment"]
    for key in ("reward/environment", "accuracy", "turns_mean", "tool_calls_mean", "env_timeouts", "env_errors"):
        assert key in lines[-1], key
    assert all(math.isfinite(line["loss"]) for line in lines)
    assert 1.0 <= lines[0]["turns_mean"] <= 2.0


@pytest.mark.timeout(120)
def test_one_step_off_with_environment_turns(tmp_path):
    recipe = agent_recipe(tmp_path, {"name": f"{__name__}:Chatty", "max_turns": 3, "max_total_tokens": 60},
                          one_step_off=True, sampler={"name": "hf_generate", "copy_weights": True})
    train(recipe)
    lines = train_lines(tmp_path)
    assert [line["policy_lag"] for line in lines] == [0.0, 1.0]
    assert lines[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy: the model's tokens' logprobs match
    assert lines[0]["turns_mean"] > 1.0  # the environment answered, and its tokens did not train
    assert lines[-1]["env_errors"] == 0 and lines[-1]["env_timeouts"] == 0


@pytest.mark.timeout(120)
def test_ppo_with_environment_turns(tmp_path):
    recipe = agent_recipe(tmp_path, {"name": f"{__name__}:Chatty", "max_turns": 2, "max_total_tokens": 40})
    recipe["task"] = "ppo"
    train(recipe)
    lines = train_lines(tmp_path)
    assert len(lines) == 2 and all(math.isfinite(line["loss"]) for line in lines)
    assert lines[0]["turns_mean"] > 1.0 and "critic/loss" in lines[-1]
