"""The DPO and GRPO quickstarts (examples/dpo, examples/grpo) meet their targets. After a short SFT (shared by
both) the model gives the right answer to a third of the held-out prompts and echoes the word for most others;
DPO raises the right answers by at least 30 points and the held-out reward accuracy to at least 0.9, in under
5 minutes; GRPO with an exact-match reward raises held-out exact match by at least 0.3 in under 10 minutes and
draws its reward curve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
EXAMPLE = EXAMPLES / "dpo"

pytest.importorskip("twinkle_backend_hf")


def _train(recipe: str, *overrides: str, example: Path = EXAMPLE) -> float:
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(example / recipe), *overrides],
                   check=True, timeout=600, capture_output=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1"})
    return time.monotonic() - start


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    """Step 1 of both quickstarts: the SFT model that answers right a third of the time (about 70 s)."""
    out = tmp_path_factory.mktemp("sft")
    seconds = _train("sft.yaml", f"train.output_dir={out}")
    return out / "final", seconds


@pytest.mark.timeout(1200)
def test_dpo_quickstart_prefers_the_right_answers(tmp_path, sft_model):
    sft_path, sft_seconds = sft_model
    dpo_seconds = _train("recipe.yaml", f"train.output_dir={tmp_path / 'dpo'}", f"model.model_id={sft_path}")
    records = [json.loads(line) for line in (tmp_path / "dpo" / "logs.jsonl").read_text().splitlines()]
    before, after = [r for r in records if r["event"] == "eval"]
    assert before["step"] == 0 and before["eval_preferred_rate"] <= 0.7, before
    assert after["eval_preferred_rate"] >= before["eval_preferred_rate"] + 0.30, (before, after)
    assert after["eval_rewards/accuracies"] >= 0.9, after
    assert dpo_seconds < 300
    print(f"dpo quickstart: preferred {before['eval_preferred_rate']:.3f} -> {after['eval_preferred_rate']:.3f}, "
          f"reward accuracy {after['eval_rewards/accuracies']:.3f}; sft {sft_seconds:.0f} s, dpo {dpo_seconds:.0f} s")


@pytest.mark.timeout(1200)
def test_grpo_quickstart_raises_exact_match(tmp_path, sft_model):
    sft_path, _ = sft_model
    seconds = _train("recipe.yaml", f"train.output_dir={tmp_path / 'grpo'}", f"model.model_id={sft_path}",
                     example=EXAMPLES / "grpo")
    records = [json.loads(line) for line in (tmp_path / "grpo" / "logs.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["event"] == "eval"]
    before, after = evals[0], evals[-1]
    assert before["step"] == 0 and 0.2 <= before["eval_accuracy"] <= 0.5, before
    assert after["eval_accuracy"] >= before["eval_accuracy"] + 0.30, (before, after)
    assert seconds < 600
    assert (tmp_path / "grpo" / "curves.png").stat().st_size > 10_000  # the reward curve the README shows
    print(f"grpo quickstart: held-out exact match {before['eval_accuracy']:.3f} -> {after['eval_accuracy']:.3f} "
          f"in {seconds:.0f} s")
