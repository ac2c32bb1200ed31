"""The ``grpo`` and ``ppo`` tasks trained end to end by ``twinkle train``'s loop, on a tiny Qwen2 from a config:
learning, exact resume, the one-step-off mode, the KL reference, dynamic sampling and every bad input."""

from __future__ import annotations

import json
import logging
import math
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


# --------------------------------------------------------------------------- gradient accumulation
def _one_optimizer_step(output_dir, prompts_file, accumulation):
    """One optimizer step from Python as the trainer runs it, with the model told its accumulation: the micro-batch
    shapes, the summed loss, the normalised gradients and the number of rollouts sampled."""
    from twinkle_core.train.batches import BatchStream
    from twinkle_core.train.loop import Trainer
    from twinkle_core.train.recipe import recipe_from_dict

    recipe = tiny_recipe(output_dir, prompts_file, steps=1, rewards=["rewards_for_tests:first_char_parity"])
    run = Trainer(recipe_from_dict(recipe)).build()
    model, task = run.model, run.task
    try:
        model.set_optimizer("AdamW", lr=1e-2, gradient_accumulation_steps=accumulation)
        draw = BatchStream(run.loader).next_batch
        shapes, loss = [], 0.0
        for _ in range(accumulation):
            batch = task.next_training_batch(model, draw)
            shapes.append(tuple(batch["input_ids"].shape))
            outputs = model.forward_backward(inputs=batch)
            loss += float(outputs["loss"]) * float(outputs["num_tokens"])  # the micro-batch's summed loss
        norm = model.clip_grad_norm(max_grad_norm=None)
        grads = {n: p.grad.detach().clone() for n, p in model.network.named_parameters() if p.grad is not None}
        return shapes, loss, norm, grads, task.rollouts
    finally:
        task.close()


@pytest.mark.timeout(300)
def test_gradient_accumulation_splits_one_rollout_and_trains_the_same(tmp_path, prompts_file):
    """GA=2 trains on the same rollout as GA=1, in two micro-batches of half the completions: one rollout, the same
    summed loss and gradients up to float32 reassociation, half the rows (and at most half the tokens) per forward."""
    whole = _one_optimizer_step(tmp_path / "ga1", prompts_file, 1)
    split = _one_optimizer_step(tmp_path / "ga2", prompts_file, 2)
    assert whole[4] == split[4] == 1  # one rollout each: GA splits it instead of sampling another
    (rows, width), = whole[0]
    assert rows == 16 and [r for r, _ in split[0]] == [8, 8]
    tokens_whole, tokens_split = rows * width, max(r * w for r, w in split[0])
    print(f"largest micro-batch: {rows}x{width} = {tokens_whole} tokens at GA=1, "
          f"{' and '.join(f'{r}x{w}' for r, w in split[0])} (max {tokens_split} tokens) at GA=2")
    assert tokens_split <= tokens_whole / 2  # each micro-batch is trimmed to its own longest row
    eps = torch.finfo(torch.float32).eps
    # a sum over the rollout's 16 sequences regrouped as 8 + 8: float32 reassociation, relative error ~ 16 eps
    assert split[1] == pytest.approx(whole[1], rel=64 * eps, abs=64 * eps)
    assert split[2] == pytest.approx(whole[2], rel=64 * eps)
    for name, grad in whole[3].items():
        scale = float(grad.abs().max()) + float(whole[3][name].numel() ** 0.5) * eps
        torch.testing.assert_close(split[3][name], grad, rtol=64 * eps, atol=64 * eps * scale, msg=name)


@pytest.mark.timeout(300)
def test_twinkle_train_with_accumulation_trains_one_rollout_per_step(tmp_path, prompts_file):
    from twinkle_core.train.loop import Trainer
    from twinkle_core.train.recipe import recipe_from_dict

    def run(name, accumulation, **options):
        recipe = tiny_recipe(tmp_path / name, prompts_file, steps=2, lr=0.5,
                             rewards=["rewards_for_tests:first_char_parity"], **options)
        recipe["optimizer"] = {"name": "SGD", "lr": 0.5}  # AdamW's first step is sign(g): too sensitive to compare
        recipe["train"]["gradient_accumulation_steps"] = accumulation
        trainer = Trainer(recipe_from_dict(recipe))
        trainer.run()
        return trainer.task.rollouts, {line["step"]: line for line in train_lines(tmp_path / name)}

    rollouts, whole = run("ga1", 1)
    # twinkle train gives the model the recipe's accumulation: without micro_batch_size the rollout is split in 2
    rollouts_split, split = run("ga2", 2)
    rollouts_sized, sized = run("ga2-sized", 2, micro_batch_size=8)
    assert rollouts == rollouts_split == rollouts_sized == 2  # one rollout per optimizer step, not per micro-batch
    for step in (1, 2):
        for key in ("loss", "grad_norm", "reward_mean"):
            assert split[step][key] == pytest.approx(whole[step][key], rel=1e-5, abs=1e-6), (step, key)
            assert sized[step][key] == split[step][key], (step, key)  # the same 2 micro-batches of 8
    a, b = final_weights(tmp_path / "ga1"), final_weights(tmp_path / "ga2")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("accumulation, options, match", [
    (3, {}, r"gradient_accumulation_steps: 3 does not divide a rollout of 16 completions"),
    (3, {"micro_batch_size": 8}, r"gradient_accumulation_steps: 3 does not divide the 2 micro-batches"),
    (1, {"micro_batch_size": 5}, r"micro_batch_size: 5 does not divide a rollout of 16"),
])
def test_a_rollout_that_does_not_fill_whole_steps_is_refused_before_building(tmp_path, prompts_file, accumulation,
                                                                              options, match):
    from twinkle_core.train.recipe import recipe_from_dict

    recipe = tiny_recipe(tmp_path, prompts_file, steps=1, **options)
    recipe["train"]["gradient_accumulation_steps"] = accumulation
    with pytest.raises(ConfigError, match=match):
        recipe_from_dict(recipe)


def test_a_rollout_used_up_mid_step_is_refused(tmp_path, prompts_file):
    """From Python: the optimizer accumulates two micro-batches but the model was not told (GA 1), so the rollout
    is one micro-batch; asking for a second one before the step would mix two rollouts into one step."""
    from twinkle_core.train.batches import BatchStream
    from twinkle_core.train.loop import Trainer
    from twinkle_core.train.recipe import recipe_from_dict

    run = Trainer(recipe_from_dict(tiny_recipe(tmp_path, prompts_file, steps=1))).build()
    try:
        draw = BatchStream(run.loader).next_batch
        run.model.forward_backward(inputs=run.task.next_training_batch(run.model, draw))
        with pytest.raises(ConfigError, match="used up in the middle of an optimizer step"):
            run.task.next_training_batch(run.model, draw)
        run.model.clip_grad_and_step()
        run.task.next_training_batch(run.model, draw)  # after the step: the next rollout
    finally:
        run.task.close()


# --------------------------------------------------------------------------- non-finite values and rewards
@pytest.mark.parametrize("loss", [
    {"name": "grpo", "options": {"beta": float("nan")}},
    {"name": "grpo", "options": {"epsilon": float("inf")}},
    {"name": "dapo", "options": {"epsilon_high": float("nan")}},
    {"name": "gspo", "options": {"temperature": float("nan")}},
    {"name": "dr_grpo", "options": {"max_completion_length": float("nan")}},
])
def test_non_finite_loss_options_are_refused(tmp_path, prompts_file, loss):
    with pytest.raises(ConfigError, match="must be a finite number|must be an integer"):
        train(tiny_recipe(tmp_path, prompts_file, steps=1, loss=loss))


@pytest.mark.parametrize("task, options, match", [
    ("grpo", {"num_generations": float("nan")}, "num_generations must be an integer"),
    ("grpo", {"ppo_epochs": float("inf")}, "ppo_epochs must be an integer"),
    ("grpo", {"advantage_options": {"eps": float("nan")}}, r"advantage_options.eps must be a finite number > 0"),
    ("grpo", {"advantage_options": {"bogus": 1}}, "do not fit advantage 'grpo'"),
    ("grpo", {"overlong_penalty": {"max_length": 8, "cache_length": float("nan")}}, "cache_length must be an integer"),
    ("grpo", {"max_sampling_rounds": float("nan")}, "max_sampling_rounds must be an integer"),
    ("grpo", {"rewards": [{"name": "regex", "weight": float("inf"), "options": {"pattern": "x"}}]}, "finite"),
    ("grpo", {"rewards": [{"name": "numeric_answer", "options": {"tolerance": float("inf")}}]}, "tolerance"),
    ("ppo", {"gamma": float("nan")}, r"gamma must be a finite number in \[0, 1\]"),
    ("ppo", {"lam": float("inf")}, r"lam must be a finite number in \[0, 1\]"),
    ("ppo", {"critic": {"lr": float("nan")}}, "critic.lr must be a finite number > 0"),
    ("ppo", {"critic": {"clip_range_value": float("nan")}}, "clip_range_value"),
])
def test_non_finite_task_options_are_refused(tmp_path, prompts_file, task, options, match):
    from twinkle_core.plugins import get_plugins

    recipe = tiny_recipe(tmp_path, prompts_file, task=task, steps=1, **options)
    with pytest.raises(ConfigError, match=match):
        get_plugins().load("task", task)(**recipe["task_options"])


def test_a_reward_that_calls_sys_exit_names_itself(tmp_path, prompts_file):
    with pytest.raises(RewardError, match=r"rewards_for_tests:exits.*called sys.exit\(2\)") as info:
        train(tiny_recipe(tmp_path, prompts_file, steps=1, rewards=["rewards_for_tests:exits"]))
    assert isinstance(info.value.__cause__, SystemExit)


@pytest.mark.timeout(300)
def test_huge_finite_rewards_train_with_grpo_and_are_named_with_dr_grpo(tmp_path, prompts_file):
    """Rewards of +-1e308 are finite, but their group std overflows float64: GRPO (scale-free) trains on them; Dr.
    GRPO's advantages are in reward units and overflow the float32 loss, which names the reward."""
    train(tiny_recipe(tmp_path / "grpo", prompts_file, steps=1, rewards=["rewards_for_tests:huge"]))
    line = train_lines(tmp_path / "grpo")[0]
    assert math.isfinite(line["loss"]) and line["grad_norm"] > 0  # the advantages were not silently all 0
    with pytest.raises(RewardError, match=r"not finite in float32.*rewards_for_tests:huge.*1e\+308.*advantage: grpo"):
        train(tiny_recipe(tmp_path / "dr", prompts_file, steps=1, rewards=["rewards_for_tests:huge"],
                          advantage="dr_grpo"))
    with pytest.raises(RewardError, match=r"the rewards of this rollout are not finite in float32.*huge"):
        train(tiny_recipe(tmp_path / "ppo", prompts_file, task="ppo", steps=1, rewards=["rewards_for_tests:huge"]))


@pytest.mark.timeout(300)
def test_groups_without_a_score_train_nothing_and_warn(tmp_path, prompts_file, caplog):
    with caplog.at_level(logging.WARNING, logger="twinkle.rl"):
        train(tiny_recipe(tmp_path, prompts_file, steps=2, rewards=["rewards_for_tests:nan_for_first_prompt"]))
    lines = train_lines(tmp_path)
    assert [line["groups_without_score"] for line in lines] == [1.0, 1.0]  # the first prompt of each rollout
    assert lines[0]["nan_rewards"] == 4.0
    warnings = [r.getMessage() for r in caplog.records if "returned nan for every completion" in r.getMessage()]
    assert len(warnings) == 2 and "rewards_for_tests:nan_for_first_prompt" in warnings[0]  # once per rollout


# --------------------------------------------------------------------------- one step off: exact resume
@pytest.mark.timeout(300)
def test_one_step_off_resume_is_exact(tmp_path, prompts_file):
    """The checkpoint holds the in-flight rollout itself (sampled with the weights of the step before), so the
    resumed run trains on exactly what the uninterrupted one did; resampling it differed from step 3 on."""
    def recipe(out):
        r = tiny_recipe(out, prompts_file, steps=5, one_step_off=True, rewards=["rewards_for_tests:first_char_parity"],
                        sampler={"name": "hf_generate", "copy_weights": True})
        r["train"]["save_every"] = 1
        return r

    train(recipe(tmp_path / "whole"))
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    train(recipe(tmp_path / "resumed"), resume=str(tmp_path / "resumed" / "checkpoint-2"))
    whole = {line["step"]: line for line in train_lines(tmp_path / "whole")}
    resumed = {line["step"]: line for line in train_lines(tmp_path / "resumed")}
    for step in (3, 4, 5):
        for key in ("loss", "reward_mean", "grad_norm", "policy_lag"):
            assert resumed[step].get(key) == whole[step].get(key), (step, key, resumed[step], whole[step])
    a, b = final_weights(tmp_path / "whole"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dr_grpo_gets_the_generation_limit_as_its_constant_length():
    """Dr. GRPO divides by a constant L; without one it fell back to each micro-batch's padded width (prompt
    included), which changes from batch to batch. The task hands it the sampler's max_new_tokens; a recipe's
    loss.options still win (the trainer merges them over loss_options)."""
    from twinkle_rl.online_task import OnlineRLTask

    task = OnlineRLTask(sampling={"max_new_tokens": 8, "temperature": 0.7},
                        rewards=[{"name": "exact_match", "options": {"field": "answer"}}])
    assert task.loss_options("dr_grpo") == {"temperature": 0.7, "max_completion_length": 8}
    assert task.loss_options("grpo") == {"temperature": 0.7}
    assert task.loss_options("dpo") == {}
