""":class:`TorchDeviceAccelerator`: a vendor accelerator names its ``torch.<module>`` runtime and inherits the
accessors (RNG state, memory statistics, synchronisation, bf16, device name) that the CUDA and NPU accelerators
share."""

from __future__ import annotations

import types

import pytest
import torch

from twinkle_core.accelerator import CUDAAccelerator, TorchDeviceAccelerator


class RecordingRuntime(types.SimpleNamespace):
    """A ``torch.cuda``-shaped namespace that records the calls made on it."""

    def __init__(self) -> None:
        super().__init__(calls=[])

    def __getattr__(self, name):
        answers = {"get_rng_state_all": ["state"], "memory_allocated": 100, "max_memory_allocated": 300,
                   "is_bf16_supported": 1, "get_device_name": "Fake X1"}

        def call(*args):
            self.calls.append((name, args))
            return answers.get(name)

        return call


class FakeAccelerator(TorchDeviceAccelerator):
    name = "fake"
    device_type = "cpu"
    dist_backend = "gloo"
    device_module = "twinkle_test_fake_device"

    @classmethod
    def is_available(cls) -> bool:
        return True


@pytest.fixture
def runtime(monkeypatch):
    runtime = RecordingRuntime()
    monkeypatch.setattr(torch, FakeAccelerator.device_module, runtime, raising=False)
    return runtime


def test_the_accessors_go_to_the_named_torch_module(runtime):
    accelerator = FakeAccelerator()
    assert accelerator.runtime() is runtime
    assert accelerator.get_rng_state() == ["state"]
    accelerator.set_rng_state(["state"])
    accelerator.synchronize()
    assert accelerator.memory_allocated() == 100 and accelerator.max_memory_allocated() == 300
    accelerator.reset_peak_memory_stats()
    assert accelerator.supports_bf16() is True  # the runtime's answer as a bool
    assert accelerator.describe() == "fake (Fake X1)"
    accelerator.set_device(0)
    assert [name for name, _ in runtime.calls] == [
        "get_rng_state_all", "set_rng_state_all", "synchronize", "memory_allocated", "max_memory_allocated",
        "reset_peak_memory_stats", "is_bf16_supported", "get_device_name", "set_device"]
    assert runtime.calls[-1] == ("set_device", (torch.device("cpu"),))


def test_the_runtime_is_looked_up_at_each_call(monkeypatch, runtime):
    accelerator = FakeAccelerator()
    replacement = RecordingRuntime()
    monkeypatch.setattr(torch, FakeAccelerator.device_module, replacement)
    accelerator.synchronize()
    assert replacement.calls == [("synchronize", ())] and runtime.calls == []


def test_cuda_is_a_torch_device_accelerator_over_torch_cuda():
    assert issubclass(CUDAAccelerator, TorchDeviceAccelerator)
    assert CUDAAccelerator.device_module == CUDAAccelerator.device_type
    assert CUDAAccelerator().runtime() is getattr(torch, CUDAAccelerator.device_type)
