"""The README's main job: the bundled quickstart reaches >= 90% held-out exact match and leaves a
checkpoint that plain transformers loads and generates from.

CI runs a shortened schedule (300 of the recipe's 500 steps, the cosine schedule fitted to them) whose target is
still checked: it reached 0.995 in 235 s on a loaded 2-core machine (the full run: 1.00), so the test does not
depend on how busy the machine is. ``scripts/regenerate_figures.py`` and the README measure the full run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "examples", "quickstart", "recipe.yaml")
STEPS = 300

pytest.importorskip("twinkle_backend_hf")  # the quickstart trains a TransformersModel


@pytest.mark.timeout(1200)
def test_quickstart_learns_the_task_and_exports_a_transformers_checkpoint(tmp_path):
    out = tmp_path / "quickstart"
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", RECIPE, f"train.output_dir={out}",
                    f"train.max_steps={STEPS}"], check=True, timeout=1100, env={**os.environ, "HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1"})
    elapsed = time.monotonic() - start
    evals = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines() if '"eval"' in line]
    before, after = evals[0], evals[-1]
    assert before["step"] == 0 and before["eval_exact_match"] < 0.05
    assert after["eval_exact_match"] >= 0.9, after
    print(f"quickstart: exact match {before['eval_exact_match']:.3f} -> {after['eval_exact_match']:.3f} "
          f"in {elapsed:.0f} s")

    generated = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart", "generate.py"),
                                str(out / "final"), "reverse: galaxy", "upper: star"],
                               check=True, capture_output=True, text=True, timeout=300)
    assert "'reverse: galaxy' -> 'yxalag'" in generated.stdout, generated.stdout
    assert "'upper: star' -> 'STAR'" in generated.stdout, generated.stdout
