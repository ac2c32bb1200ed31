"""``twinkle train --dry-run`` finds a data row's missing image, with the message the real run gives
(``VLMTask.check_data``: the same row and image checks as ``load_dataset``), before anything is built (issue 26)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twinkle_core import cli

pytest.importorskip("twinkle_backend_hf")

RECIPE = str(Path(__file__).resolve().parents[3] / "examples" / "vlm" / "recipe.yaml")


def test_a_missing_image_fails_the_dry_run_as_the_real_run(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "<image>Which colour?"},
                                             {"role": "assistant", "content": "red"}],
                                "images": ["missing.png"]}) + "\n")
    argv = ["train", RECIPE, f"data.train={data}", "data.eval=null", "train.max_steps=1",
            f"train.output_dir={tmp_path / 'out'}", "train.eval_before_training=false", "train.evaluate_options=null"]
    assert cli.main([*argv, "--dry-run"]) == 1
    dry = capsys.readouterr().err
    message = f"{data}:1: image file not found: {tmp_path / 'missing.png'}"
    assert "twinkle: error: VLMDataError: 1 problem(s) in the VLM data" in dry and message in dry
    assert not (tmp_path / "out").exists()  # nothing was built
    assert cli.main(argv) == 1
    real = capsys.readouterr().err
    assert dry.strip().splitlines()[-2:] == real.strip().splitlines()[-2:]
