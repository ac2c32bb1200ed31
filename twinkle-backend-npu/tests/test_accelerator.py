"""The npu accelerator on the fake torch_npu: selection, every refusal message, and the device calls it makes."""

from __future__ import annotations

import pytest
import torch
from twinkle_backend_npu.accelerator import CANN_ENV, NO_DEVICE, NOT_INSTALLED, NPUAccelerator
from twinkle_backend_npu.testing import install_fake_torch_npu

from twinkle_core import checkpoint
from twinkle_core.accelerator import current_accelerator
from twinkle_core.errors import UnsupportedHardwareError
from twinkle_core.plugins import get_plugins

TORCH_RELEASE = torch.__version__.split("+")[0]


def forced_npu_error(monkeypatch, **fake_options) -> str:
    monkeypatch.setenv("TWINKLE_ACCELERATOR", "npu")
    with install_fake_torch_npu(**fake_options), pytest.raises(UnsupportedHardwareError) as error:
        current_accelerator()
    return str(error.value)


# ---------------------------------------------------------------------- refusals
def test_forced_without_torch_npu_names_the_pip_command(monkeypatch):
    message = forced_npu_error(monkeypatch, installed=False)
    assert message == f"TWINKLE_ACCELERATOR=npu cannot be used: {NOT_INSTALLED}"
    assert "pip install twinkle-backend-npu[ascend]" in message


def test_forced_without_cann_names_the_set_env_script(monkeypatch):
    message = forced_npu_error(monkeypatch, cann=False)
    assert "the CANN libraries are not found" in message and "libascendcl.so" in message
    assert f"run `{CANN_ENV}`" in message


def test_a_torch_npu_that_refuses_to_import_leaves_the_other_accelerators_selectable(monkeypatch):
    clash = RuntimeError("Two accelerators cannot be used at the same time in PyTorch: npu and cuda.")
    monkeypatch.delenv("TWINKLE_ACCELERATOR", raising=False)
    with install_fake_torch_npu(import_error=clash):
        assert "does not import (RuntimeError: Two accelerators cannot be used" in NPUAccelerator.why_unavailable()
        assert get_plugins().select_accelerator().name == "cpu"


def test_forced_with_a_mismatched_torch_npu_names_both_versions(monkeypatch):
    message = forced_npu_error(monkeypatch, version="2.6.0.post3")
    assert f"torch_npu 2.6.0.post3 is built for torch 2.6.0, but torch {torch.__version__} is installed" in message
    assert f"pip install 'torch_npu=={TORCH_RELEASE}.*'" in message


def test_forced_with_a_torch_missing_from_the_table_lists_the_supported_ones(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.2.0")
    message = forced_npu_error(monkeypatch, version="2.2.0")
    assert "torch 2.2.0 has no torch_npu release in twinkle-backend-npu's table" in message
    assert "2.1.0, 2.3.1" in message


def test_forced_without_a_visible_device_says_so(monkeypatch):
    message = forced_npu_error(monkeypatch, device_count=0)
    assert message.endswith(NO_DEVICE)


def test_without_torch_npu_the_cheap_check_needs_no_import():
    with install_fake_torch_npu(installed=False):
        assert NPUAccelerator.why_unavailable(probe=False) == NOT_INSTALLED
    with install_fake_torch_npu(cann=False):
        assert NPUAccelerator.why_unavailable(probe=False) is None  # installed: only importing it tells more


# ---------------------------------------------------------------------- selection
def test_npu_is_selected_when_torch_npu_imports_and_sees_a_device(monkeypatch):
    monkeypatch.delenv("TWINKLE_ACCELERATOR", raising=False)
    with install_fake_torch_npu():
        assert get_plugins().select_accelerator().name == "npu"
        assert current_accelerator().name == "npu"
    with install_fake_torch_npu(device_count=0):
        assert get_plugins().select_accelerator().name == "cpu"
    assert current_accelerator().name == "cpu"  # no torch_npu here: the CPU path is untouched


# ---------------------------------------------------------------------- the contract, through torch.npu
def test_device_binding_goes_through_torch_npu(fake_npu, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    accelerator = current_accelerator()
    assert (accelerator.name, accelerator.dist_backend) == ("npu", "hccl")
    # the fake's tensors live on the CPU (the seam); autocast follows the tensors
    assert accelerator.device() == torch.device("cpu") and accelerator.autocast_device_type == "cpu"
    accelerator.set_device()
    assert fake_npu.called("set_device") == [(3,)] and fake_npu.current == 3
    assert accelerator.describe() == "npu (Ascend910B2)"
    with pytest.raises(RuntimeError, match="Invalid device ID 8: 8 NPUs are visible"):
        torch.npu.set_device("npu:8")


def test_device_rng_is_saved_and_restored_by_checkpoints(fake_npu):
    accelerator = NPUAccelerator()
    fake_npu.generators[0].manual_seed(7)
    state = checkpoint.capture_rng_state(accelerator)
    assert "npu" in state and "cuda" not in state
    first = torch.rand(4, generator=fake_npu.generators[0])
    checkpoint.restore_rng_state(state, accelerator)
    assert torch.equal(torch.rand(4, generator=fake_npu.generators[0]), first)
    assert fake_npu.called("get_rng_state_all") and fake_npu.called("set_rng_state_all")


def test_memory_statistics_and_sync_come_from_torch_npu(fake_npu):
    accelerator = NPUAccelerator()
    fake_npu.set_allocated(900)
    fake_npu.set_allocated(300)
    accelerator.reset_peak_memory_stats()
    assert accelerator.max_memory_allocated() == 300
    fake_npu.set_allocated(500)
    fake_npu.set_allocated(100)
    assert accelerator.memory_allocated() == 100 and accelerator.max_memory_allocated() == 500
    accelerator.synchronize()
    assert fake_npu.called("synchronize") == [()]


def test_the_fake_exposes_the_fused_ops_by_their_torch_npu_names(fake_npu):
    import torch_npu
    from torch_npu.optim import NpuFusedAdamW
    from twinkle_backend_npu.testing import fake_ops

    for name in ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_fusion_attention"):
        assert getattr(torch_npu, name) is getattr(fake_ops, name)
    assert NpuFusedAdamW is fake_ops.NpuFusedAdamW
    with pytest.raises(AttributeError, match="no attribute 'npu_not_an_op'"):
        torch_npu.npu_not_an_op  # noqa: B018


def test_the_fake_is_removed_on_exit():
    import sys

    with install_fake_torch_npu():
        assert hasattr(torch, "npu") and "torch_npu" in sys.modules
    assert not hasattr(torch, "npu") and "torch_npu" not in sys.modules


# ---------------------------------------------------------------------- the version table
def test_the_version_rule_pairs_each_torch_with_its_own_torch_npu_release():
    from twinkle_backend_npu.versions import SUPPORTED, version_problem

    for row in SUPPORTED:
        assert version_problem(f"{row.torch}+cpu", row.torch) is None
        assert version_problem(row.torch, f"{row.torch}.post7") is None
    assert "built for torch 2.5.1" in version_problem("2.6.0", "2.5.1.post1")
    assert "no torch_npu release" in version_problem("2.2.0", "2.2.0")


def test_the_readme_lists_the_version_table():
    from pathlib import Path

    from twinkle_backend_npu.versions import SUPPORTED

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for row in SUPPORTED:
        assert f"| {row.torch.ljust(6)} | {(row.torch + '[.postN]').ljust(16)} |" in readme, row.torch
    assert "Nothing in this package has run on real Ascend hardware yet" in readme
