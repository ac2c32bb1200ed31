"""bench/gpu_check.py does not rot: its CPU ``--smoke`` run works end to end, and the GPU peak table
maps device names as ``torch.cuda.get_device_name()`` spells them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def _module():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("name", "tflops"), [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA H200", 989.4), ("NVIDIA H800", 989.4), ("NVIDIA H20", 148.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100-PCIE-40GB", 312.0), ("NVIDIA A800-SXM4-80GB", 312.0),
    ("NVIDIA L40S", 362.05), ("NVIDIA L40", 181.05), ("NVIDIA L20", 119.5), ("NVIDIA A10", 125.0),
    ("NVIDIA GeForce RTX 4090", 165.2),
    ("NVIDIA A10G", None), ("Tesla V100-SXM2-32GB", None), (None, None),
])
def test_peak_table(name, tflops):
    peak, message = _module().peak_bf16_flops(name)
    if tflops is None:
        assert peak is None and "null" in message
    else:
        assert peak == pytest.approx(tflops * 1e12)


def test_smoke_run(tmp_path):
    pytest.importorskip("transformers")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out-dir", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["settings"]["smoke"] and result["settings"]["device"] == "cpu"
    for name in ("twinkle", "trainer"):
        run = result["runs"][name]
        assert run["tokens_per_s"] > 0 and run["mfu"] is None
    assert result["ratio_tokens_per_s_twinkle_over_trainer"] > 0
    assert result["data"]["packing_efficiency"] > 0.8  # the batches really are packed
    assert result["messages"] and "MFU" in result["messages"][0]
    assert "load" in result and "environment" in result
