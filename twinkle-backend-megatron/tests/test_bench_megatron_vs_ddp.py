"""bench/megatron_vs_ddp.py does not rot: a tiny run of it (its own 2-rank torchrun job) writes its result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "megatron_vs_ddp.py"


def test_quick_run(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(SCRIPT), "--quick", "--repeats", "2", "--warmup", "1", "--profile-steps", "1",
           "--out-dir", str(tmp_path), "--timeout", "400"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=450)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "megatron_vs_ddp.json").read_text())["result"]
    assert result["paired_ratio"]["n"] == 2
    assert result["max_abs_loss_diff"] < 1e-4  # same model, data and optimizer
    for name in ("megatron", "ddp"):
        where = result["where_time_goes"][name]
        assert 0 < where["comm_share"] < 1 and where["comm_ms_per_step"] > 0
        # a CPU job on one host all-reduces through shared memory (twinkle_core.shm_collectives)
        assert "twinkle_shm:all_reduce" in where["comm_ops_rank0"], where["comm_ops_rank0"]
