"""The DPO quickstart (examples/dpo) meets its targets: after a short SFT the model gives the right answer to
a third of the held-out prompts and echoes the word for most others; DPO raises the right answers by at least
30 points and the held-out reward accuracy to at least 0.9, in under 5 minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "dpo"

pytest.importorskip("twinkle_backend_hf")


def _train(recipe: str, *overrides: str) -> float:
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(EXAMPLE / recipe), *overrides],
                   check=True, timeout=600, capture_output=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1"})
    return time.monotonic() - start


@pytest.mark.timeout(1200)
def test_dpo_quickstart_prefers_the_right_answers(tmp_path):
    sft_seconds = _train("sft.yaml", f"train.output_dir={tmp_path / 'sft'}")
    dpo_seconds = _train("recipe.yaml", f"train.output_dir={tmp_path / 'dpo'}",
                         f"model.model_id={tmp_path / 'sft' / 'final'}")
    records = [json.loads(line) for line in (tmp_path / "dpo" / "logs.jsonl").read_text().splitlines()]
    before, after = [r for r in records if r["event"] == "eval"]
    assert before["step"] == 0 and before["eval_preferred_rate"] <= 0.7, before
    assert after["eval_preferred_rate"] >= before["eval_preferred_rate"] + 0.30, (before, after)
    assert after["eval_rewards/accuracies"] >= 0.9, after
    assert dpo_seconds < 300
    print(f"dpo quickstart: preferred {before['eval_preferred_rate']:.3f} -> {after['eval_preferred_rate']:.3f}, "
          f"reward accuracy {after['eval_rewards/accuracies']:.3f}; sft {sft_seconds:.0f} s, dpo {dpo_seconds:.0f} s")
