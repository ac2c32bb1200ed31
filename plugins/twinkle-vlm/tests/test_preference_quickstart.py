"""The VLM preference quickstart (examples/vlm/make_pairs.py, preference.yaml): ``twinkle train`` with
``task: vlm_preference`` runs end to end in its smallest form (2 steps), evaluates held-out preference and reward
accuracy before and after, and saves a checkpoint that carries the processor."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from twinkle_core.testing.torchrun import run_python

pytest.importorskip("twinkle_backend_hf")
pytest.importorskip("twinkle_rl")

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "vlm"


def run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return run_python(*args, timeout=timeout, cwd=REPO)


def test_preference_quickstart_trains_two_steps_and_evaluates(tmp_path):
    data = tmp_path / "data"
    run(str(EXAMPLE / "make_pairs.py"), "--out", str(data), "--train", "32", "--eval", "8", timeout=120)
    rows = [json.loads(line) for line in (data / "pairs_train.jsonl").read_text().splitlines()]
    assert len(rows) == 32 and all(r["chosen"] != r["rejected"] for r in rows)
    out = tmp_path / "run"
    run("-m", "twinkle_core.cli", "train", str(EXAMPLE / "preference.yaml"), f"train.output_dir={out}",
        f"data.train={data / 'pairs_train.jsonl'}", f"data.eval={data / 'pairs_eval.jsonl'}", "data.batch_size=4",
        "train.max_steps=2", "train.log_every=1", timeout=240)
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["eval_before"], summary["eval_after"]
    # before any step the policy is its reference: every implicit reward is 0, the DPO loss ln 2
    assert before["eval_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert before["eval_reward_accuracy"] == 0.0
    for result in (before, after):
        assert result["eval_num_examples"] == 8
        assert 0.0 <= result["eval_preference_accuracy"] <= 1.0
    losses = [r["loss"] for r in map(json.loads, (out / "logs.jsonl").read_text().splitlines())
              if r.get("event") == "train"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "chat_template.jinja").is_file()
