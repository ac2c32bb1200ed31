"""`twinkle train` with the preference task, end to end on a tiny Qwen2: LoRA (reference = the base), full
fine-tuning (reference = a frozen copy), precomputed reference log-probs (cached, reused on resume) and SimPO
(no reference). The loss falls, the reward metrics are logged, resume is exact, and the output loads with
plain transformers / peft."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
TOKENIZER = HERE.parents[2] / "examples" / "quickstart" / "tokenizer"
STEPS = 12

pytest.importorskip("twinkle_backend_hf")


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))


def _pairs(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        word = _word(rng)
        while word == word[::-1]:
            word = _word(rng)
        rows.append({"prompt": f"reverse: {word}", "chosen": word[::-1], "rejected": word})
    return rows


def _recipe(root: Path, mode: str) -> Path:
    train = _pairs(0, 32)
    # evaluated on pairs it trains on: a random tiny model learns them in 12 steps, it cannot generalise
    for name, rows in (("train.jsonl", train), ("eval.jsonl", train[:8])):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    task_options = {"reference": "precomputed"} if mode == "precomputed" else {}
    loss = {"name": "simpo"} if mode == "simpo" else {"name": "dpo", "options": {"beta": 0.5}}
    model = {"class_name": "TransformersModel", "tokenizer": str(TOKENIZER),
             "config": {"model_type": "qwen2", "vocab_size": 262, "hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "max_position_embeddings": 128, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}}
    if mode == "lora":
        model["adapter"] = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
    recipe = {
        "task": "preference", "task_options": task_options, "model": model, "precision": "no",
        "data": {"train": str(root / "train.jsonl"), "eval": str(root / "eval.jsonl"), "max_length": 48,
                 "batch_size": 4},
        "loss": loss, "optimizer": {"name": "AdamW", "lr": 1.0e-2 if mode == "lora" else 3.0e-3},
        "train": {"max_steps": STEPS, "seed": 0, "log_every": 1, "save_every": 6, "eval_every": STEPS,
                  "eval_before_training": True, "evaluate_options": {"max_new_tokens": 8},
                  "output_dir": str(root / "out")},
    }
    path = root / "recipe.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def _twinkle(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def _records(out: Path, event: str = "train") -> list[dict]:
    lines = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("event") == event]


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    name = "adapter_model.safetensors" if (directory / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(str(directory / name))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["lora", "full", "precomputed", "simpo"])
def test_preference_training_from_the_cli(tmp_path, mode):
    recipe = _recipe(tmp_path, mode)
    first = _twinkle(recipe)
    out = tmp_path / "out"
    train = [r for r in _records(out) if "rewards/accuracies" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1)), "every step logs the reward metrics"
    assert train[-1]["loss"] < train[0]["loss"], [r["loss"] for r in train]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert key in train[0]
    evals = [r for r in _records(out, "eval") if "eval_rewards/accuracies" in r]
    assert len(evals) == 2 and evals[-1]["eval_rewards/margins"] > evals[0]["eval_rewards/margins"]
    assert all(0 <= e["eval_preferred_rate"] + e["eval_rejected_rate"] <= 1 for e in evals)
    if mode in ("lora", "full"):
        assert "eval_rewards/accuracies" in evals[0] and evals[0]["eval_rewards/margins"] == pytest.approx(0, abs=1e-6)
    if mode == "precomputed":
        assert (out / "reference_logps" / "train.pt").is_file() and (out / "reference_logps" / "eval.pt").is_file()

    # plain transformers / peft load the result
    import transformers

    final = out / "final"
    if mode == "lora":
        import peft

        base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
            **json.loads(recipe.read_text())["model"]["config"]))
        peft.PeftModel.from_pretrained(base, str(final))
    else:
        transformers.AutoModelForCausalLM.from_pretrained(str(final))

    # resume from the middle: the same losses and final weights, bit for bit; cached reference values reused
    expected = {r["step"]: r["loss"] for r in train}
    weights = _weights(final)
    shutil.rmtree(final)
    second = _twinkle(recipe, "--resume", str(out / "checkpoint-6"))
    resumed = {r["step"]: r["loss"] for r in _records(out)[len(train):]}  # the resumed run's records
    assert {s: resumed[s] for s in range(7, STEPS + 1)} == {s: expected[s] for s in range(7, STEPS + 1)}
    again = _weights(final)
    assert again.keys() == weights.keys() and all(torch.equal(again[k], v) for k, v in weights.items())
    if mode == "precomputed":
        assert "reusing" in second.stderr + second.stdout and "one pass over" not in second.stderr + second.stdout
        assert "one pass over" in first.stderr + first.stdout


def test_a_preference_loss_on_an_sft_task_is_refused_before_anything_is_built(tmp_path):
    """The silent mis-pairing of the past (dpo on causal_lm took batch halves as pairs) is a recipe error now."""
    from twinkle_core.errors import ConfigError
    from twinkle_core.train.recipe import recipe_from_dict, validate_components

    recipe = recipe_from_dict({"task": "causal_lm", "loss": {"name": "dpo", "options": {"reference_free": True}},
                               "model": {"class_name": "TransformersModel", "model_id": str(tmp_path)},
                               "data": {"train": str(tmp_path / "train.jsonl")}})
    with pytest.raises(ConfigError) as info:
        validate_components(recipe)
    assert str(info.value) == ("loss.name: the loss 'dpo' needs batches with preference_pairs, which the task "
                               "'causal_lm' does not produce; use task: 'preference' or 'vlm_preference'")
