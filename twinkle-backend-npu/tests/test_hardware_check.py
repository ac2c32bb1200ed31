"""The Ascend hardware check runs end to end on the CPU fake of torch_npu, fails when the numbers are wrong, and
refuses clearly where there is no torch_npu. (On real hardware it has not run yet; see the README.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from twinkle_backend_npu import hardware_check
from twinkle_backend_npu.testing.fake_torch_npu import install_fake_torch_npu

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_on_ascend.sh"
#: the tiniest model the checks build: one layer, hidden 32, 2 x 16 tokens
TINY = ["--hidden", "32", "--layers", "1", "--heads", "4", "--vocab", "64", "--seq", "16", "--batch", "2",
        "--warmup", "1", "--repeats", "2"]
KERNELS = ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_fusion_attention", "npu_ring_block_attention")


def _run(check: str, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / f"{check}.json"
    code = hardware_check.main([check, *TINY, "--json", str(out), *extra])
    return code, json.loads(out.read_text())


def test_parity_on_the_fake_is_within_the_bf16_bound(fake_npu, tmp_path, capsys):
    code, result = _run("parity", tmp_path)
    assert code == 0, result
    assert result["passed"] and set(result["runs"]) == {"unfused", "fused"}
    assert result["runs"]["unfused"]["kernels"] == {}
    assert set(result["runs"]["fused"]["kernels"]) == set(KERNELS)
    for run in result["runs"].values():
        # bf16 really rounded (the fake autocasts on the CPU), and within the derived bound
        assert 0 < run["logits_max_abs_diff"] <= result["logits_bound"]
        assert run["loss_abs_diff"] <= result["loss_bound"]
    assert result["versions"]["torch_npu (imported)"] == torch.__version__.split("+")[0]
    assert "versions: python" in capsys.readouterr().out


def test_parity_fails_when_the_npu_logits_are_off(fake_npu, tmp_path, monkeypatch):
    forward = hardware_check._forward

    def off_by_a_bit(model, input_ids, autocast):
        logits, loss, magnitude = forward(model, input_ids, autocast)
        if autocast is None:
            return logits, loss, magnitude  # the CPU float32 reference stays right
        bound = hardware_check.bf16_logits_bound(magnitude, layers=1)
        return logits + 2 * bound, loss, magnitude

    monkeypatch.setattr(hardware_check, "_forward", off_by_a_bit)
    code, result = _run("parity", tmp_path)
    assert code == 1 and result["passed"] is False
    assert not any(run["passed"] for run in result["runs"].values())


def test_kernels_time_each_kernel_and_the_fused_optimizer(fake_npu, tmp_path):
    code, result = _run("kernels", tmp_path)
    assert code == 0, result
    for name in KERNELS:
        row = result["kernels"][name]
        assert row["passed"] and row["sites"] >= 1 and row["fused_ms"] > 0 and row["speedup"] > 0, (name, row)
    assert result["kernels"]["optimizer:AdamW"]["class"] == "NpuFusedAdamW"
    assert fake_npu.called("synchronize"), "timings must wait for the device queue"


def test_a_kernel_that_breaks_fails_the_check_and_the_others_still_report(fake_npu, tmp_path, monkeypatch):
    import twinkle_backend_npu.kernels.swiglu as swiglu

    def broken(self, x):
        raise RuntimeError("aclnnSwiGlu failed")

    monkeypatch.setattr(swiglu, "forward", broken)
    code, result = _run("kernels", tmp_path)
    assert code == 1 and "aclnnSwiGlu failed" in result["kernels"]["npu_swiglu"]["error"]
    assert result["kernels"]["npu_rms_norm"]["passed"]


@pytest.mark.parametrize(("options", "says"), [
    ({"installed": False}, "torch_npu is not installed"),
    ({"cann": False}, "set_env.sh"),
])
def test_refuses_with_the_reason_when_the_npu_cannot_run(options, says, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TWINKLE_ACCELERATOR", "npu")
    with install_fake_torch_npu(**options):
        code, result = _run("parity", tmp_path)
    assert code == 2 and says in result["error"]
    assert says in capsys.readouterr().err


def test_cann_version_is_read_from_the_toolkit(tmp_path, monkeypatch):
    (tmp_path / "version.cfg").write_text("# CANN\nversion=8.0.RC3\nother=1\n")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    assert hardware_check.cann_version() == "version=8.0.RC3"


def test_script_is_valid_bash():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_script_refuses_without_torch_npu(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("ASCEND")}
    env.update(PYTHON=sys.executable, ASCEND_TOOLKIT_HOME=str(tmp_path))  # no CANN here to source
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "torch_npu cannot be imported" in done.stderr and "versions: python" in done.stderr
    assert not (tmp_path / "out").exists()  # nothing pretends to have run


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_hccl_two_ranks_on_the_fake():
    from twinkle_backend_npu import hardware_check_hccl

    args = hardware_check.parse_args(["hccl", *TINY, "--timeout", "240"])
    result = hardware_check_hccl.check_hccl(args, worker=[str(Path(__file__).parent / "hccl_rank_on_fake_npu.py")])
    assert result["passed"], result["problems"]
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert {r["backend"] for r in result["ranks"]} == {"hccl"}
    losses = [r["local_losses"] for r in result["ranks"]]
    assert losses[0] != losses[1]  # each rank trained on its own rows: agreement below is not by construction


def test_hccl_judge_names_what_disagrees():
    from twinkle_backend_npu.hardware_check_hccl import judge

    good = {"rank": 0, "collective_errors": [], "local_losses": [1.0, 0.9, 0.8], "global_losses": [1.0, 0.9, 0.8],
            "weight_checksums": [3.0, 3.1, 3.2]}
    assert judge([good, {**good, "rank": 1}]) == []
    bad = {**good, "rank": 1, "weight_checksums": [3.0, 3.1, 3.3], "local_losses": [1.0, float("nan"), 0.8]}
    problems = judge([good, bad])
    assert any("weights differ" in p for p in problems) and any("non-finite" in p for p in problems)
    assert judge([good]) == ["1 of 2 ranks reported"]
