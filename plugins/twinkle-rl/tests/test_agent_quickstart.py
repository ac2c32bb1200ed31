"""The agent quickstart (examples/agent): after the SFT start point, GRPO with the calculator environment raises
the held-out greedy success, both steps in under 10 minutes. Measured: 0.00 -> 0.825 (SFT 536 s and GRPO 47 s on 2
cores at load average 3-3.5; about 380 s + 40 s idle); the test asserts the issue's target, a gain of at least 0.3.
Slow: it trains for minutes (``-m slow``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "agent"

pytest.importorskip("twinkle_backend_hf")


def _train(recipe: str, *overrides: str) -> float:
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(EXAMPLE / recipe), *overrides],
                   check=True, timeout=900, capture_output=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1"})
    return time.monotonic() - start


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_agent_quickstart_learns_to_use_the_calculator(tmp_path):
    sft_seconds = _train("sft.yaml", f"train.output_dir={tmp_path / 'sft'}")
    grpo_seconds = _train("recipe.yaml", f"train.output_dir={tmp_path / 'agent'}",
                          f"model.model_id={tmp_path / 'sft' / 'final'}")
    records = [json.loads(line) for line in (tmp_path / "agent" / "logs.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["event"] == "eval"]
    before, after = evals[0], evals[-1]
    print(f"agent quickstart: held-out success {before['eval_accuracy']:.3f} -> {after['eval_accuracy']:.3f}, "
          f"tool calls {before['eval_tool_calls_mean']:.2f} -> {after['eval_tool_calls_mean']:.2f}; "
          f"sft {sft_seconds:.0f} s, grpo {grpo_seconds:.0f} s")
    assert before["step"] == 0
    assert after["eval_accuracy"] >= before["eval_accuracy"] + 0.30, (before, after)
    assert sft_seconds + grpo_seconds < 600
