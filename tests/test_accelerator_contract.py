"""The Accelerator contract any vendor implements: device RNG, memory, sync, autocast type, why it cannot run."""

from __future__ import annotations

import re

import pytest
import torch

from twinkle_core import checkpoint
from twinkle_core.accelerator import Accelerator, CPUAccelerator, CUDAAccelerator, current_accelerator
from twinkle_core.errors import UnsupportedHardwareError


class CountingAccelerator(CPUAccelerator):
    """A vendor accelerator whose device RNG is its own generator (as a real device's is)."""

    name = "counting"

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(3)

    def get_rng_state(self):
        return self.generator.get_state()

    def set_rng_state(self, state) -> None:
        self.generator.set_state(state)


def test_the_cpu_defaults_describe_a_device_without_its_own_runtime():
    cpu = CPUAccelerator()
    assert cpu.get_rng_state() is None and cpu.memory_allocated() is None and cpu.max_memory_allocated() is None
    assert cpu.autocast_device_type == "cpu" and CPUAccelerator.why_unavailable() is None
    cpu.synchronize()
    cpu.reset_peak_memory_stats()


def test_a_checkpoint_keeps_the_device_rng_of_the_accelerator_under_its_name():
    accelerator = CountingAccelerator()
    state = checkpoint.capture_rng_state(accelerator)
    assert "counting" in state
    first = torch.rand(3, generator=accelerator.generator)
    checkpoint.restore_rng_state(state, accelerator)
    assert torch.equal(torch.rand(3, generator=accelerator.generator), first)
    # a CPU run saves no device state, and a state saved by another accelerator is left alone on restore
    assert set(checkpoint.capture_rng_state(CPUAccelerator())) == {"python", "numpy", "torch"}
    checkpoint.restore_rng_state(state, CPUAccelerator())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_says_why_it_cannot_run_and_forcing_it_is_an_error(monkeypatch):
    reason = CUDAAccelerator.why_unavailable()
    assert reason is not None and ("no CUDA support" in reason or "no CUDA device is visible" in reason)
    assert CUDAAccelerator.why_unavailable(probe=False) is None  # the cheap check cannot tell without torch
    monkeypatch.setenv("TWINKLE_ACCELERATOR", "cuda")
    with pytest.raises(UnsupportedHardwareError, match=re.escape(f"TWINKLE_ACCELERATOR=cuda cannot be used: {reason}")):
        current_accelerator()


def test_a_vendor_gets_its_distributed_env_configured_with_the_core_timeout(monkeypatch):
    from twinkle_core.distributed import DEFAULT_TIMEOUT_S

    seen = []
    monkeypatch.setattr(CPUAccelerator, "configure_distributed_env", lambda self, timeout_s: seen.append(timeout_s))
    monkeypatch.setenv("TWINKLE_ACCELERATOR", "cpu")
    assert current_accelerator().name == "cpu"
    assert seen == [DEFAULT_TIMEOUT_S]


def test_the_contract_defaults_are_safe_for_a_minimal_vendor():
    class Minimal(Accelerator):
        name = device_type = "minimal"

        @classmethod
        def is_available(cls) -> bool:
            return False

    assert Minimal.why_unavailable() == "minimal is not available on this machine"
    assert Minimal.why_unavailable(probe=False) is None
