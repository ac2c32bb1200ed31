"""Installed without CANN or torch_npu: the CPU path works and ``twinkle plugins`` says why the NPU is not active."""

from __future__ import annotations

import os
import subprocess
import sys

from twinkle_backend_npu.accelerator import NOT_INSTALLED
from twinkle_backend_npu.testing import install_fake_torch_npu

from twinkle_core.cli import collect_plugins, format_plugins

HEAVY = ("torch", "torch_npu", "transformers")


def twinkle_plugins(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWINKLE_") and k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "twinkle_core.cli", "plugins", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_twinkle_plugins_lists_the_npu_as_not_active_and_why_without_importing_torch():
    result = twinkle_plugins()
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert any(line.split()[:2] == ["npu", "twinkle-backend-npu"] and "accelerator: npu" in line for line in lines)
    assert f"  npu   not active: {NOT_INSTALLED}" in lines
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert not [m for m in imported if m.split(".")[0] in HEAVY]


def test_probing_shows_the_cpu_active_when_torch_npu_is_missing():
    result = twinkle_plugins("--probe")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "  cpu   active" in result.stdout.splitlines()
    assert f"  npu   not active: {NOT_INSTALLED}" in result.stdout.splitlines()


def test_probing_with_torch_npu_and_a_device_shows_the_npu_active(monkeypatch):
    monkeypatch.delenv("TWINKLE_ACCELERATOR", raising=False)
    with install_fake_torch_npu():
        data = collect_plugins(probe=True)
    statuses = {a["name"]: (a["status"], a["reason"]) for a in data["accelerators"]}
    assert statuses["npu"] == ("active", None) and statuses["cpu"] == ("available", None)
    assert "  npu   active" in format_plugins(data).splitlines()


def test_probing_without_cann_names_the_set_env_script(monkeypatch):
    monkeypatch.delenv("TWINKLE_ACCELERATOR", raising=False)
    with install_fake_torch_npu(cann=False):
        data = collect_plugins(probe=True)
    npu = next(a for a in data["accelerators"] if a["name"] == "npu")
    assert npu["status"] == "not active"
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in npu["reason"]
