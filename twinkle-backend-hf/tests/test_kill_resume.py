"""kill -9 during training and during checkpoint writes, then ``--resume latest``: the run ends exactly as an
uninterrupted one (every logged loss and every final weight bit for bit).

The runs are real ``twinkle train`` processes of a tiny Qwen2 with dropout and shuffled data (so the RNG
and data-loader state must come back too); ``scripts/kill_train.py`` SIGKILLs the process at the chosen
moment, so no handler, ``finally`` or buffered write gets to run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from twinkle_core import checkpoint

HERE = Path(__file__).resolve().parent
QUICKSTART = HERE.parents[1] / "examples" / "quickstart"
KILL_TRAIN = HERE / "scripts" / "kill_train.py"
STEPS = 8

RECIPE = f"""
task: causal_lm
model:
  class_name: TransformersModel
  tokenizer: {QUICKSTART / "tokenizer"}
  config:
    model_type: qwen2
    vocab_size: 262
    hidden_size: 32
    intermediate_size: 64
    num_hidden_layers: 2
    num_attention_heads: 4
    num_key_value_heads: 2
    max_position_embeddings: 256
    attention_dropout: 0.2
    bos_token_id: 0
    eos_token_id: 0
    pad_token_id: 0
precision: "no"
data:
  train: {QUICKSTART / "train.jsonl"}
  mode: chat
  max_length: 64
  batch_size: 4
  shuffle: true
optimizer:
  name: AdamW
  lr: 1.0e-2
lr_scheduler:
  name: cosine
  warmup_steps: 2
train:
  max_steps: {STEPS}
  max_grad_norm: 1.0
  seed: 3
  log_every: 1
  save_every: 2
"""


def _train(tmp_path: Path, out: str, when: str = "never", *extra: str) -> subprocess.CompletedProcess:
    recipe = tmp_path / "recipe.yaml"
    if not recipe.exists():
        recipe.write_text(RECIPE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(KILL_TRAIN), when, "--", "train", str(recipe),
                           f"train.output_dir={tmp_path / out}", *extra],
                          capture_output=True, text=True, timeout=300, env=env)


def _losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "eval" not in r}


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    done = _train(root, "out")
    assert done.returncode == 0, done.stdout + done.stderr
    losses = _losses(root / "out")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses, _weights(root / "out")


def _killed_then_resumed(tmp_path: Path, when: str, reference) -> Path:
    killed = _train(tmp_path, "out", when)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-3000:])
    resumed = _train(tmp_path, "out", "never", "--resume", "latest")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    losses, weights = reference
    assert _losses(tmp_path / "out") == losses  # the killed run's steps, then the resumed run's, bit for bit
    got = _weights(tmp_path / "out")
    assert got.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(got[name], tensor), name
    return tmp_path / "out"


def _steps_of_checkpoints(out: Path) -> list[int]:
    return [step for step, _, _ in checkpoint.list_checkpoints(out)]


def test_kill_during_training_resumes_exactly(tmp_path, reference):
    out = _killed_then_resumed(tmp_path, "step:5", reference)
    assert _steps_of_checkpoints(out)[:2] == [2, 4]  # the resume started from checkpoint-4


def test_kill_before_a_checkpoint_is_complete_resumes_from_the_previous_one(tmp_path, reference):
    killed = _train(tmp_path, "out", "save:3:before-marker")  # the write of checkpoint-6
    assert killed.returncode == -signal.SIGKILL
    out = tmp_path / "out"
    assert (out / ".checkpoint-6.incomplete").is_dir() and not (out / "checkpoint-6").exists()
    assert checkpoint.latest_checkpoint(out) == out / "checkpoint-4"
    resumed = _train(tmp_path, "out", "never", "--resume", "latest")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "checkpoint-4" in resumed.stdout + resumed.stderr
    losses, weights = reference
    assert _losses(out) == losses
    got = _weights(out)
    assert all(torch.equal(got[name], tensor) for name, tensor in weights.items())
    assert not (out / ".checkpoint-6.incomplete").exists(), "the next write of checkpoint-6 replaces the leftover"


def test_kill_right_after_the_rename_keeps_that_checkpoint(tmp_path, reference):
    out = _killed_then_resumed(tmp_path, "save:3:after-rename", reference)
    assert 6 in _steps_of_checkpoints(out)
    checkpoint.verify_checkpoint(out / "checkpoint-6")
