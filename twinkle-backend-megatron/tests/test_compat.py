"""The CPU compatibility layer: applied only without a GPU, pinned to one megatron-core release, scoped to it."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from twinkle_backend_megatron import compat

from twinkle_core.errors import UnsupportedHardwareError

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer applies only without a GPU")


def test_pinned_version_and_clear_error_for_others(monkeypatch):
    assert compat.megatron_version() == compat.SUPPORTED_VERSION == "0.16.1"
    monkeypatch.setattr(compat, "megatron_version", lambda: "0.17.0")
    with pytest.raises(UnsupportedHardwareError, match=r"megatron-core==0\.16\.1.*0\.17\.0 is installed"):
        compat.check_version()


def test_megatron_sees_a_cpu_torch_but_torch_itself_is_untouched():
    assert compat.apply() is True
    from megatron.core.tensor_parallel import mappings

    assert mappings.torch is not torch and isinstance(mappings.torch, compat._CpuTorch)
    assert mappings.torch.cuda.current_device() == torch.device("cpu")
    assert mappings.torch.zeros(2, device="cuda").device.type == "cpu"
    assert mappings.torch.empty(1, device=0).device.type == "cpu"
    assert mappings.torch.Tensor is torch.Tensor and mappings.torch.float32 is torch.float32
    mappings.torch.cuda.synchronize()  # a no-op, not an error
    # outside megatron-core nothing changed
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_modules_imported_later_are_patched_too():
    compat.apply()
    name = "megatron.core.transformer.multi_token_prediction"
    sys.modules.pop(name, None)
    module = importlib.import_module(name)
    assert isinstance(module.torch, compat._CpuTorch)


def test_type_names_are_only_cuda_like_inside_the_scoped_functions():
    compat.apply()
    seen = {}

    def probe(t):
        seen["type"], seen["cuda"] = t.type(), t.cuda() is t

    compat._scoped(probe)(torch.zeros(1))
    assert seen == {"type": "torch.cuda.FloatTensor", "cuda": True}
    assert torch.zeros(1).type() == "torch.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).to(torch.float32).type() == "torch.FloatTensor"


def test_rng_tracker_forks_cpu_generator_states():
    compat.apply()
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    tensor_parallel.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # the default stream is not consumed
    tensor_parallel.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    with mrandom.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), first)  # same seed, same model-parallel stream
