"""examples/serve in its smallest form: the server started from the example's config, the SFT client for 2 steps and
the RL client for 1 iteration, all through the Tinker SDK."""

from __future__ import annotations

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
    config = yaml.safe_load((EXAMPLE / "server.yaml").read_text())
    config["base_models"][0]["model"]["tokenizer"] = str(EXAMPLE.parent / "quickstart" / "tokenizer")
    config.update(port=0, state_dir=str(tmp_path / "state"))
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "server.yaml").write_text(yaml.safe_dump(config))
    with ServerProcess(tmp_path / "server" / "server.yaml") as server:
        sft = run("train_sft.py", "--base-url", server.base_url, "--steps", "2", "--batch-size", "4",
                  "--eval-size", "2", "--result", str(tmp_path / "sft.json"))
        assert "held-out exact match" in sft and (tmp_path / "sft.json").exists()
        rl = run("rl.py", "--base-url", server.base_url, "--iterations", "1", "--prompts", "2", "--group", "2",
                 "--eval-size", "2", "--sft-result", str(tmp_path / "sft.json"))
        assert "mean reward" in rl
