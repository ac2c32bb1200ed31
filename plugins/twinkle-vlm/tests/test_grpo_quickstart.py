"""The VLM GRPO quickstart (examples/vlm/make_grpo_data.py, recipe.yaml on the mislabelled rows, grpo.yaml):
``twinkle train`` with ``task: vlm_grpo`` runs end to end in its smallest form (a few steps each), evaluates
held-out accuracy before and after, and saves a checkpoint that carries the processor; the full form (slow) lifts
held-out accuracy by at least 0.3."""

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


def quickstart(tmp_path: Path, *, train: int, evaluation: int, sft_steps: int, grpo_steps: int,
               batch_size: int | None = None) -> tuple[dict, list[float]]:
    data = tmp_path / "data"
    run(str(EXAMPLE / "make_grpo_data.py"), "--out", str(data), "--train", str(train), "--eval", str(evaluation),
        timeout=120)
    sft = tmp_path / "sft"
    run("-m", "twinkle_core.cli", "train", str(EXAMPLE / "recipe.yaml"), f"train.output_dir={sft}",
        f"data.train={data / 'sft.jsonl'}", f"data.eval={data / 'eval.jsonl'}", f"train.max_steps={sft_steps}",
        "train.eval_before_training=false", timeout=600)
    out = tmp_path / "grpo"
    options = [f"data.batch_size={batch_size}"] if batch_size else []
    run("-m", "twinkle_core.cli", "train", str(EXAMPLE / "grpo.yaml"), f"train.output_dir={out}",
        f"model.model_id={sft / 'final'}", f"data.train={data / 'train.jsonl'}", f"data.eval={data / 'eval.jsonl'}",
        f"train.max_steps={grpo_steps}", "train.log_every=1", *options, timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    rewards = [r["reward_mean"] for r in map(json.loads, (out / "logs.jsonl").read_text().splitlines())
               if r.get("event") == "train"]
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "processor_config.json").is_file()
    return summary, rewards


def test_grpo_quickstart_trains_two_steps_and_evaluates(tmp_path):
    rows = tmp_path / "data"
    summary, rewards = quickstart(tmp_path, train=32, evaluation=8, sft_steps=2, grpo_steps=2, batch_size=4)
    sft = [json.loads(line) for line in (rows / "sft.jsonl").read_text().splitlines()]
    truth = [json.loads(line) for line in (rows / "train.jsonl").read_text().splitlines()]
    answers = [(s["messages"][-1]["content"][0]["text"], t["messages"][-1]["content"][0]["text"]) for s, t in zip(sft, truth, strict=True)]
    assert all(given == true or (true in ("red", "blue") and given == "yellow") for given, true in answers)
    assert any(given != true for given, true in answers), "the SFT labels carry the error"
    before, after = summary["eval_before"], summary["eval_after"]
    for result in (before, after):
        assert result["eval_num_examples"] == 8 and 0.0 <= result["eval_accuracy"] <= 1.0
    assert len(rewards) == 2 and all(math.isfinite(r) for r in rewards)


@pytest.mark.slow
def test_full_grpo_quickstart_fixes_the_mislabelled_colours(tmp_path):
    summary, _ = quickstart(tmp_path, train=1000, evaluation=200, sft_steps=200, grpo_steps=100)
    before, after = summary["eval_before"]["eval_accuracy"], summary["eval_after"]["eval_accuracy"]
    print(f"held-out accuracy {before:.3f} -> {after:.3f}")
    assert after - before >= 0.3, (before, after)
