"""The ``grpo`` and ``ppo`` tasks trained end to end by ``twinkle train``'s loop, on a tiny Qwen2 from a config:
learning, exact resume, the one-step-off mode, the KL reference, dynamic sampling and every bad input."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
from twinkle_rl.experience import experience_batch
from twinkle_rl.rewards import RewardError

from twinkle_core.errors import ConfigError
from twinkle_core.sampling import Completion
from twinkle_core.train.loop import train

pytest.importorskip("twinkle_backend_hf")

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DIR = os.path.join(HERE, "..", "..", "..", "examples", "quickstart", "tokenizer")
X_REGEX = {"name": "regex", "options": {"pattern": r"^\s*x"}}


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    rng = random.Random(0)
    rows = [{"prompt": "say: " + "".join(rng.choice("abcdefgh") for _ in range(4)), "answer": "x"}
            for _ in range(64)]
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tiny_recipe(output_dir, prompts, *, task="grpo", steps=2, lr=1e-2, rewards=None, loss=None, **task_options):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(TOKENIZER_DIR))
    options = {"num_generations": 4, "sampling": {"temperature": 1.0, "max_new_tokens": 4},
               "rewards": rewards or [X_REGEX], **task_options}
    recipe = {
        "task": task,
        "task_options": options,
        "model": {"class_name": "TransformersModel", "tokenizer": TOKENIZER_DIR,
                  "config": {"model_type": "qwen2", "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "max_position_embeddings": 64, "tie_word_embeddings": True}},
        "precision": "no",
        "data": {"train": prompts, "batch_size": 4},
        "optimizer": {"name": "AdamW", "lr": lr, "weight_decay": 0.0},
        "lr_scheduler": {"name": "constant"},
        "train": {"output_dir": str(output_dir), "max_steps": steps, "seed": 0, "log_every": 1},
    }
    if loss is not None:
        recipe["loss"] = loss
    return recipe


def train_lines(output_dir):
    lines = [json.loads(line) for line in (Path(output_dir) / "logs.jsonl").read_text().splitlines()]
    return [line for line in lines if line["event"] == "train"]


def final_weights(output_dir):
    from safetensors.torch import load_file

    return load_file(str(Path(output_dir) / "final" / "model.safetensors"))


# --------------------------------------------------------------------------- learning
@pytest.mark.timeout(300)
def test_a_tiny_model_learns_to_answer_with_x_within_60_s(tmp_path, prompts_file):
    recipe = tiny_recipe(tmp_path, prompts_file, steps=40, num_generations=8)
    recipe["data"]["batch_size"] = 8
    recipe["train"]["log_every"] = 5
    started = time.monotonic()
    train(recipe)
    seconds = time.monotonic() - started
    lines = train_lines(tmp_path)
    first, last = lines[0]["reward_mean"], lines[-1]["reward_mean"]
    print(f"answer-with-x: reward {first:.3f} -> {last:.3f} in {seconds:.1f} s")
    assert first < 0.1 and last > 0.9, (first, last)
    assert seconds < 60
    for key in ("reward_std", "accuracy", "completion_length_mean", "completion_length_max", "clipped_fraction",
                "clip_fraction", "entropy", "sampler_time_s", "sampler_tokens_per_s", "tokens_per_s"):
        assert key in lines[-1], key


# --------------------------------------------------------------------------- resume
@pytest.mark.timeout(300)
@pytest.mark.parametrize("task", ["grpo", "ppo"])
def test_resume_mid_rollout_is_exact(tmp_path, prompts_file, task):
    """Two epochs per rollout: checkpoint-1 falls between the two passes over a rollout, so the resumed run
    continues from the saved queue (and, for ppo, the saved critic) rather than sampling anew."""
    def recipe(out):
        r = tiny_recipe(out, prompts_file, task=task, steps=4, ppo_epochs=2)
        r["train"]["save_every"] = 1
        return r

    train(recipe(tmp_path / "whole"))
    # an interrupted run: the uninterrupted run's checkpoint-1 in a fresh output directory, resumed to step 4
    shutil.copytree(tmp_path / "whole" / "checkpoint-1", tmp_path / "resumed" / "checkpoint-1")
    train(recipe(tmp_path / "resumed"), resume=str(tmp_path / "resumed" / "checkpoint-1"))
    whole = {line["step"]: line for line in train_lines(tmp_path / "whole")}
    resumed = {line["step"]: line for line in train_lines(tmp_path / "resumed")}
    for step in (2, 3, 4):
        for key in ("loss", "reward_mean", "grad_norm"):
            assert resumed[step].get(key) == whole[step].get(key), (step, key, resumed[step], whole[step])
    a, b = final_weights(tmp_path / "whole"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    if task == "ppo":
        assert (tmp_path / "resumed" / "checkpoint-1" / "critic").is_dir()
        assert "critic/loss" in whole[4]


# --------------------------------------------------------------------------- modes
@pytest.mark.timeout(300)
def test_one_step_off_samples_with_the_previous_weights(tmp_path, prompts_file):
    recipe = tiny_recipe(tmp_path, prompts_file, steps=3, one_step_off=True,
                         sampler={"name": "hf_generate", "copy_weights": True})
    train(recipe)
    lines = train_lines(tmp_path)
    assert [line["policy_lag"] for line in lines] == [0.0, 1.0, 1.0]
    assert lines[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # the first rollout is on-policy


def test_one_step_off_needs_a_sampler_with_its_own_weights(tmp_path, prompts_file):
    with pytest.raises(ConfigError, match="copy_weights"):
        train(tiny_recipe(tmp_path, prompts_file, steps=1, one_step_off=True))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("adapter", [False, True])
def test_kl_to_the_reference(tmp_path, prompts_file, adapter):
    recipe = tiny_recipe(tmp_path, prompts_file, steps=3, loss={"name": "grpo", "options": {"beta": 0.1}},
                         rewards=["rewards_for_tests:first_char_parity"])
    if adapter:
        recipe["model"]["adapter"] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    train(recipe)
    lines = train_lines(tmp_path)
    assert lines[0]["kl_mean"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as its reference
    assert lines[-1]["kl_mean"] > 0.0


@pytest.mark.timeout(300)
def test_dynamic_sampling_fills_the_batch_and_counts(tmp_path, prompts_file):
    recipe = tiny_recipe(tmp_path, prompts_file, steps=1, dynamic_sampling=True, max_sampling_rounds=2,
                         rewards=["rewards_for_tests:always_one"])
    train(recipe)
    line = train_lines(tmp_path)[0]
    assert line["groups_filled_uninformative"] == 4.0  # no group ever differs: the batch is filled with them


# --------------------------------------------------------------------------- bad inputs
def test_a_reward_that_raises_names_itself(tmp_path, prompts_file):
    with pytest.raises(RewardError, match="rewards_for_tests:raises.*grader is down"):
        train(tiny_recipe(tmp_path, prompts_file, steps=1, rewards=["rewards_for_tests:raises"]))


def test_a_reward_list_of_the_wrong_length_is_refused(tmp_path, prompts_file):
    with pytest.raises(RewardError, match="one_short"):
        train(tiny_recipe(tmp_path, prompts_file, steps=1, rewards=["rewards_for_tests:one_short"]))


@pytest.mark.timeout(300)
def test_nan_rewards_are_counted_and_score_nothing(tmp_path, prompts_file):
    train(tiny_recipe(tmp_path, prompts_file, steps=1, rewards=["rewards_for_tests:nan_for_odd"]))
    line = train_lines(tmp_path)[0]
    assert line["nan_rewards"] == 8.0  # half of 4 prompts x 4 completions
    assert line["reward_mean"] == pytest.approx(0.5)


def test_a_prompt_longer_than_the_budget_is_refused_by_name(tmp_path):
    rows = tmp_path / "long.jsonl"
    rows.write_text(json.dumps({"prompt": "a" * 200}) + "\n")
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        train(tiny_recipe(tmp_path / "out", str(rows), steps=1))


def test_over_long_prompts_are_skipped_and_counted(tmp_path, prompts_file, caplog):
    rows = tmp_path / "mixed.jsonl"
    rows.write_text(json.dumps({"prompt": "a" * 200}) + "\n" + Path(prompts_file).read_text())
    train(tiny_recipe(tmp_path / "out", str(rows), steps=1, max_prompt_length=32))
    assert "1 skipped" in caplog.text


def test_an_empty_completion_trains_nothing():
    batch = experience_batch([[5, 6], [5, 6]], [Completion([7], [-0.5], "stop"), Completion([], [], "stop")],
                             pad_token_id=0)
    assert (batch["labels"][1] == -100).all()  # a padding row: the losses count no sequence for it
    assert batch["labels"][0].tolist() == [-100, -100, 7]
    assert batch["old_logps"][0].tolist() == [0.0, -0.5]


@pytest.mark.parametrize("options, match", [
    ({"rewards": []}, "at least one reward"),
    ({"num_generations": 1}, "num_generations must be >= 2"),
    ({"sampling": {"temprature": 0.7}}, "did you mean|unknown option"),
    ({"advantage": "ppo"}, "advantage must be one of"),
])
def test_bad_task_options_are_refused(tmp_path, prompts_file, options, match):
    recipe = tiny_recipe(tmp_path, prompts_file, steps=1)
    recipe["task_options"].update(options)
    with pytest.raises(ConfigError, match=match):
        train(recipe)


@pytest.mark.timeout(300)
def test_ppo_with_its_critic_learns_to_answer_with_x(tmp_path, prompts_file):
    recipe = tiny_recipe(tmp_path, prompts_file, task="ppo", steps=40, num_generations=4, critic={"lr": 1e-2})
    recipe["data"]["batch_size"] = 16
    recipe["train"]["log_every"] = 5
    train(recipe)
    lines = train_lines(tmp_path)
    first, last = lines[0]["reward_mean"], lines[-1]["reward_mean"]
    print(f"ppo answer-with-x: reward {first:.3f} -> {last:.3f}; critic loss {lines[0]['critic/loss']:.4f} -> "
          f"{lines[-1]['critic/loss']:.4f}")
    assert first < 0.1 and last > 0.8, (first, last)
    assert "critic/value_clip_fraction" in lines[-1]


def test_the_policy_loss_scores_at_the_sampling_temperature_unless_the_recipe_says_otherwise(tmp_path, prompts_file):
    from twinkle_core.train.loop import Trainer
    from twinkle_core.train.recipe import recipe_from_dict

    def loss_spec(**loss):
        recipe = tiny_recipe(tmp_path, prompts_file, steps=1, sampling={"temperature": 0.7, "max_new_tokens": 4},
                             loss={"name": "grpo", **loss})
        trainer = Trainer(recipe_from_dict(recipe))
        trainer.build()
        return trainer.model.get_train_configs()["loss"]

    assert loss_spec()["temperature"] == 0.7  # TRL scores logits / T of the sampling T: so does the default
    assert loss_spec(options={"temperature": 1.0})["temperature"] == 1.0
