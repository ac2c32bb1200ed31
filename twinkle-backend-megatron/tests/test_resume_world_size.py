"""``twinkle train --resume`` of a MegatronModel checkpoint at another layout: saved by 2 ranks at TP=2, resumed on
1 process (TP=1, the same global batch: one data-parallel rank either way). megatron-core's ``dist_checkpointing``
reshards the optimizer state and the weights come from the Hugging Face files, so the resumed run logs the
uninterrupted TP=2 run's losses, within the spread that splitting the matmuls over 2 ranks gives (the same run at
TP=2 vs 1 process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from twinkle_core.testing.torchrun import free_port

pytestmark = pytest.mark.distributed

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"

RECIPE = f"""
task: causal_lm
model:
  class_name: MegatronModel
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
strategy: megatron
precision: "no"
data:
  train: {QUICKSTART / "train.jsonl"}
  mode: chat
  max_length: 64
  batch_size: 4
optimizer:
  name: AdamW
  lr: 1.0e-2
train:
  max_steps: 4
  seed: 3
  log_every: 1
  save_every: 2
  eval_before_training: false
"""


def _train(tmp_path: Path, out: str, *extra: str, nproc: int = 1) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    launch = (["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
              if nproc > 1 else [])
    done = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(recipe),
                           f"train.output_dir={tmp_path / out}", *launch, *extra],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]


def _losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "eval" not in r}


@pytest.mark.timeout(900)
def test_a_tp2_checkpoint_resumes_on_one_process_with_the_same_losses(tmp_path):
    _train(tmp_path, "tp2", "mesh={tp: 2}", nproc=2)
    _train(tmp_path, "one", "train.max_steps=2")  # the same run on 1 process: how far TP=2 alone moves the losses
    _train(tmp_path, "resumed", "--resume", str(tmp_path / "tp2" / "checkpoint-2"))
    tp2, one, resumed = _losses(tmp_path / "tp2"), _losses(tmp_path / "one"), _losses(tmp_path / "resumed")
    spread = max(abs(tp2[s] - one[s]) for s in one)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        # two more optimizer steps may grow the gap a few times over; a wrong optimizer state would not be close
        assert abs(resumed[step] - tp2[step]) <= 10 * spread + 1e-6, (step, resumed[step], tp2[step], spread)
