"""``--resume`` at another world size and ``--resume-weights-only``, with real ``twinkle train`` processes.

* FSDP2 (``native_fsdp``, DCP optimizer state) saved by 2 ranks resumes on 1 process (the same global batch:
  ``data.batch_size`` 2 x 2 ranks -> 4 x 1) and logs the losses of the uninterrupted 2-rank run, within the
  spread that the data-parallel summation order alone gives (the same run on 1 process vs 2).
* DDP saved at 1 process is refused at 2 with a message naming both world sizes, the strategies that reshard and
  ``--resume-weights-only``.
* ``--resume-weights-only`` of a 1-process checkpoint at 2 DDP ranks (another batch size too) starts at step 0
  from the checkpoint's weights: its evaluation before training equals the checkpoint run's final one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from twinkle_core.testing.tolerance import assert_within_spread, sum_tolerance
from twinkle_core.testing.torchrun import free_port

pytestmark = pytest.mark.distributed  # torchrun jobs of 2 ranks: run one at a time (scripts/test.sh)

HERE = Path(__file__).resolve().parent
QUICKSTART = HERE.parents[1] / "examples" / "quickstart"

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
  warmup_steps: 1
train:
  max_steps: 4
  max_grad_norm: 1.0
  seed: 3
  log_every: 1
  save_every: 2
"""


def _train(tmp_path: Path, out: str, *extra: str, nproc: int = 1) -> subprocess.CompletedProcess:
    recipe = tmp_path / "recipe.yaml"
    if not recipe.exists():
        recipe.write_text(RECIPE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    launch = (["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
              if nproc > 1 else [])
    return subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(recipe),
                           f"train.output_dir={tmp_path / out}", *launch, *extra],
                          capture_output=True, text=True, timeout=600, env=env)


def _losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "eval" not in r}


def test_fsdp2_two_ranks_resume_on_one_process(tmp_path):
    fsdp = ("strategy.name=native_fsdp",)
    two = _train(tmp_path, "two", *fsdp, "data.batch_size=2", nproc=2)
    assert two.returncode == 0, two.stdout + two.stderr
    one = _train(tmp_path, "one", *fsdp)  # the same run, summed in one process's order
    assert one.returncode == 0, one.stdout + one.stderr
    resumed = _train(tmp_path, "resumed", *fsdp, "--resume", str(tmp_path / "two" / "checkpoint-2"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "at another world size" in resumed.stdout + resumed.stderr
    got = _losses(tmp_path / "resumed")
    assert sorted(got) == [3, 4], got
    reference, reordered = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    floor = sum_tolerance(terms=4 * 64, magnitude=max(reference.values()))
    assert_within_spread("losses of steps 3-4 resumed on 1 process", [got[3], got[4]], [reference[3], reference[4]],
                         [reordered[3], reordered[4]], floor=floor)


def test_ddp_at_another_world_size_is_refused(tmp_path):
    saved = _train(tmp_path, "out", "strategy.name=ddp", "train.max_steps=2")
    assert saved.returncode == 0, saved.stdout + saved.stderr
    refused = _train(tmp_path, "out", "strategy.name=ddp", "data.batch_size=2", "--resume", "latest", nproc=2)
    assert refused.returncode != 0
    text = refused.stdout + refused.stderr
    assert "1 processes" in text and "this run has 2" in text, text[-3000:]
    assert "native_fsdp" in text and "--resume-weights-only" in text, text[-3000:]


def test_weights_only_at_two_ddp_ranks(tmp_path):
    rows = (QUICKSTART / "train.jsonl").read_text().splitlines()[:8]
    (tmp_path / "eval.jsonl").write_text("\n".join(rows) + "\n")
    evaluate = (f"data.eval={tmp_path / 'eval.jsonl'}",)
    saved = _train(tmp_path, "src", *evaluate, "train.max_steps=2")
    assert saved.returncode == 0, saved.stdout + saved.stderr
    source = tmp_path / "src" / "final"
    # 2 DDP ranks and another batch size: the checkpoint's optimizer could not resume here, its weights can
    run = _train(tmp_path, "dst", *evaluate, "strategy.name=ddp", "data.batch_size=3", "train.max_steps=1",
                 "train.eval_before_training=true", "--resume-weights-only", str(source), nproc=2)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(_losses(tmp_path / "dst")) == [1]  # a new run: step 0 -> 1
    want = json.loads((tmp_path / "src" / "summary.json").read_text())["eval_after"]["eval_loss"]
    got = json.loads((tmp_path / "dst" / "summary.json").read_text())["eval_before"]["eval_loss"]
    # the same weights and rows, summed over 2 ranks instead of 1 (logged rounded to 6 significant digits)
    assert abs(got - want) <= sum_tolerance(terms=8 * 64, magnitude=want) + 1e-5 * abs(want), (got, want)
    # and not the untrained model's: the loaded weights are what trained
    fresh = _train(tmp_path, "fresh", *evaluate, "train.max_steps=1", "train.eval_before_training=true")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    untrained = json.loads((tmp_path / "fresh" / "summary.json").read_text())["eval_before"]["eval_loss"]
    assert abs(untrained - want) > 1e-3, (untrained, want)
