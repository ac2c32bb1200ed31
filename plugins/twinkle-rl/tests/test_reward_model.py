"""The reward_model task: the Bradley–Terry loss against TRL's RewardTrainer formula, the margin column, and a
`twinkle train` run whose saved model loads as a plain transformers sequence classifier and scores completions
through the reward_model reward exactly as the trained network does."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from twinkle_rl.losses.bradley_terry import BradleyTerryLoss
from twinkle_rl.reward_model_task import RewardModelTask

from twinkle_core.errors import ConfigError, DataFormatError
from twinkle_core.testing.tolerance import forward_tolerance, sum_tolerance

HERE = Path(__file__).resolve().parent
TOKENIZER = HERE.parents[2] / "examples" / "quickstart" / "tokenizer"


def _batch(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None) -> tuple[dict, dict]:
    """The layout the task collates: pair by pair, chosen then rejected."""
    scores = torch.stack([chosen, rejected], dim=1).reshape(-1, 1)
    inputs = {"pair_index": torch.arange(len(chosen)).repeat_interleave(2),
              "is_chosen": torch.tensor([True, False] * len(chosen))}
    if margin is not None:
        inputs["margin"] = margin.repeat_interleave(2)
    return {"logits": scores}, inputs


def _trl_loss(chosen, rejected, margin=None, center=None):
    """TRL's RewardTrainer.compute_loss (trl/trainer/reward_trainer.py), transcribed."""
    loss = -F.logsigmoid(chosen - rejected - (margin if margin is not None else 0.0)).mean()
    if center is not None:
        loss = loss + center * torch.mean((chosen + rejected) ** 2)
    return loss


@pytest.mark.parametrize("with_margin", [False, True])
@pytest.mark.parametrize("center", [None, 0.01])
def test_the_loss_is_trl_reward_trainers(with_margin, center):
    g = torch.Generator().manual_seed(0)
    chosen, rejected = (torch.randn(13, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    margin = torch.rand(13, generator=g, dtype=torch.float64) if with_margin else None
    outputs, inputs = _batch(chosen, rejected, margin)
    out = BradleyTerryLoss(center_rewards_coefficient=center)(outputs, inputs)
    assert out.num_tokens == 13
    # the loss computes in float32: each pair's few operations round at the scale of its inputs, then 13 terms sum
    scale = chosen.abs() + rejected.abs() + (margin if margin is not None else 0.0)
    scale = scale + (center or 0.0) * (chosen + rejected) ** 2
    tolerance = sum_tolerance(13 * 4, float(scale.sum()) / 13, torch.float32)
    assert float(out.mean) == pytest.approx(float(_trl_loss(chosen, rejected, margin, center)), abs=tolerance)
    assert out.metrics["accuracy"] == pytest.approx(float((chosen > rejected).double().mean()))
    assert out.metrics["margin"] == pytest.approx(float((chosen - rejected).mean()), rel=1e-6)


def test_the_gradient_pushes_chosen_up_and_rejected_down():
    chosen = torch.tensor([0.5, -1.0], requires_grad=True)
    rejected = torch.tensor([0.7, 2.0], requires_grad=True)
    logits = torch.stack([chosen, rejected], dim=1).reshape(-1, 1)
    _, inputs = _batch(chosen.detach(), rejected.detach())
    BradleyTerryLoss()({"logits": logits}, inputs).loss.backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()


def test_the_loss_refuses_per_token_outputs():
    _, inputs = _batch(torch.zeros(2), torch.zeros(2))
    with pytest.raises(ConfigError, match="one score per sequence"):
        BradleyTerryLoss()({"logits": torch.zeros(4, 7, 262)}, inputs)


def test_margin_column_reaches_the_batch_and_is_validated(tokenizer, write_jsonl):
    task = RewardModelTask()
    rows = [{"prompt": "reverse: abc", "chosen": "cba", "rejected": "abc", "margin": 2},
            {"prompt": "reverse: xyz", "chosen": "zyx", "rejected": "xyz", "margin": 0.5}]
    batch = task.collate(task.load_dataset(write_jsonl(rows), tokenizer))
    assert batch["margin"].tolist() == [2.0, 2.0, 0.5, 0.5]
    assert "labels" not in batch  # nothing for a sequence classifier's own loss to pick up
    rows[1].pop("margin")
    with pytest.raises(ValueError, match="give every row a margin or none"):
        task.collate(task.load_dataset(write_jsonl(rows), tokenizer))
    rows[1]["margin"] = "high"
    with pytest.raises(DataFormatError, match="'margin' must be a finite number"):
        task.load_dataset(write_jsonl(rows), tokenizer)


def test_packing_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="last token.*packing: false"):
        RewardModelTask(packing=True)


# ---------------------------------------------------------------------- end to end
def _pairs(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
        rows.append({"prompt": f"upper: {word}", "chosen": word.upper(), "rejected": word})
    return rows


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    for name, rows in (("train.jsonl", _pairs(0, 64)), ("eval.jsonl", _pairs(1, 16))):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {
        "task": "reward_model",
        "model": {"class_name": "TransformersModel", "tokenizer": str(TOKENIZER),
                  "config": {"model_type": "qwen2", "vocab_size": 262, "hidden_size": 32, "intermediate_size": 64,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "max_position_embeddings": 128, "bos_token_id": 0, "eos_token_id": 0,
                             "pad_token_id": 0}},
        "precision": "no",
        "data": {"train": str(root / "train.jsonl"), "eval": str(root / "eval.jsonl"), "max_length": 48,
                 "batch_size": 8},
        "optimizer": {"name": "AdamW", "lr": 3.0e-3},
        "train": {"max_steps": 16, "seed": 0, "log_every": 4, "eval_before_training": True,
                  "output_dir": str(root / "out")},
    }
    (root / "recipe.yaml").write_text(json.dumps(recipe))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TWINKLE_NO_PROGRESS": "1"}
    proc = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(root / "recipe.yaml")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, json.loads((root / "out" / "summary.json").read_text()), proc.stdout + proc.stderr


def test_a_run_learns_the_preference_and_shows_it_on_the_console(trained):
    _, summary, console = trained
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["eval_accuracy"] <= 0.75 and after["eval_accuracy"] == 1.0, (before, after)
    assert after["eval_margin"] > before["eval_margin"] + 1.0
    assert " accuracy " in console and " margin " in console  # the task's headline metrics on the step line


def test_the_saved_model_is_a_plain_sequence_classifier_and_the_reward_scores_like_training(trained, tokenizer):
    from transformers import AutoModelForSequenceClassification
    from twinkle_rl.model_reward import RewardModelScore

    root, _, _ = trained
    model = AutoModelForSequenceClassification.from_pretrained(root / "out" / "final")
    assert model.config.num_labels == 1 and model.config.pad_token_id == 0
    task = RewardModelTask()
    rows = _pairs(1, 16)
    batch = task.collate(task.load_dataset(rows, tokenizer))
    with torch.no_grad():
        trained_scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    reward = RewardModelScore(str(root / "out"), batch_size=5)  # the output directory: its final model
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                             add_generation_prompt=True) for r in rows for _ in range(2)]
    completions = [answer for r in rows for answer in (r["chosen"], r["rejected"])]
    scores = torch.tensor(reward(prompts, completions))
    # the same tokens in batches of other padded widths: only the reductions' order differs (2 layers of width 64)
    tolerance = forward_tolerance(float(trained_scores.abs().max()), width=64, depth=2)
    torch.testing.assert_close(scores, trained_scores.float(), rtol=0, atol=tolerance)


def test_the_reward_is_registered_for_online_rl(trained):
    from twinkle_rl.rewards import RewardSet

    root, _, _ = trained
    rewards = RewardSet([{"name": "reward_model", "options": {"path": str(root / "out" / "final")}}])
    prompt = "<|im_start|>user\nupper: abc<|im_end|>\n<|im_start|>assistant\n"
    scores = rewards.score([prompt, prompt], ["ABC", "abc"], {})
    assert scores.total[0] > scores.total[1]


def test_a_lora_adapter_trains_and_saves_the_new_score_head_whole():
    from peft import LoraConfig

    task = RewardModelTask()
    assert task.adapter_config(None, {"r": 4})["modules_to_save"] == ["score"]
    placed = task.adapter_config(None, LoraConfig(r=4, target_modules="all-linear"))
    assert placed.modules_to_save == ["score"]
    chosen = LoraConfig(r=4, modules_to_save=["head"])
    assert task.adapter_config(None, chosen) is chosen  # the user's own choice stays
