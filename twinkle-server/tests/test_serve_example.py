"""examples/serve in its smallest form: a base model from the example's base.yaml trained for 2 steps, the server
started from the example's config on it, the SFT client for 2 steps and the RL client for 1 iteration, all through
the Tinker SDK; and the base corpus is what make_base_data.py writes, without the held-out words or `upper`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from twinkle_server.testing import ServerProcess

pytestmark = [pytest.mark.timeout(400)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve"


def run(*argv: str, cwd: Path = EXAMPLE) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": os.environ.get("TWINKLE_TEST_THREADS", "1")}
    result = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return result.stdout


def test_the_serve_example_runs_end_to_end(tmp_path: Path):
    pytest.importorskip("tinker")
    # the example's base (base.yaml), 2 steps instead of the full run: the server only needs a final model directory
    run("-m", "twinkle_core.cli", "train", str(EXAMPLE / "base.yaml"), "train.max_steps=2", "train.save_every=1000",
        f"train.output_dir={tmp_path / 'base'}", "data.eval=null")
    assert (tmp_path / "base" / "final" / "config.json").exists()
    config = yaml.safe_load((EXAMPLE / "server.yaml").read_text())
    assert config["base_models"][0]["model"]["path"] == "../../outputs/serve-base/final"  # what base.yaml writes
    config["base_models"][0]["model"]["path"] = str(tmp_path / "base" / "final")
    config.update(port=0, state_dir=str(tmp_path / "state"))
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "server.yaml").write_text(yaml.safe_dump(config))
    with ServerProcess(tmp_path / "server" / "server.yaml") as server:
        sft = run("train_sft.py", "--base-url", server.base_url, "--steps", "2", "--batch-size", "4",
                  "--eval-size", "2", "--early-step", "1", "--result", str(tmp_path / "sft.json"))
        assert "held-out exact match of the base" in sft and "held-out exact match:" in sft
        result = json.loads((tmp_path / "sft.json").read_text())
        assert result["early_state"] and result["state"] and len(result["losses"]) == 2
        rl = run("rl.py", "--base-url", server.base_url, "--iterations", "1", "--prompts", "2", "--group", "2",
                 "--eval-size", "2", "--sft-result", str(tmp_path / "sft.json"))
        assert f"starting from {result['early_state']}" in rl and "mean reward" in rl
        assert len(json.loads((tmp_path / "serve-rl.json").read_text())["rewards"]) == 1


def test_the_base_corpus_is_make_base_data_output_without_held_out_words_or_upper():
    spec = importlib.util.spec_from_file_location("make_base_data", EXAMPLE / "make_base_data.py")
    make_base_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_base_data)
    rows = [json.loads(line) for line in (EXAMPLE / "base_train.jsonl").read_text().splitlines()]
    assert rows == make_base_data.build_rows()
    questions = [m["content"] for row in rows for m in row["messages"] if m["role"] == "user"]
    assert {q.split(": ")[0] for q in questions} == {"reverse", "double"}
    assert not {q.split(": ")[1] for q in questions} & make_base_data.held_out_words()
