"""Precision on the npu accelerator: bf16 only where the SoC has it, fp16 with loss scaling, fp8 refused."""

from __future__ import annotations

import pytest
import torch
from twinkle_backend_npu.accelerator import NPUAccelerator
from twinkle_backend_npu.testing import install_fake_torch_npu

from twinkle_core.errors import UnsupportedHardwareError
from twinkle_core.precision import BF16Precision, FP8Precision, FP16Precision
from twinkle_core.testing.conformance import make_batch


def test_bf16_is_refused_on_a_soc_without_it_and_fp16_is_suggested():
    with install_fake_torch_npu(bf16=False, device_name="Ascend910A"):
        accelerator = NPUAccelerator()
        with pytest.raises(UnsupportedHardwareError, match=r"^precision 'bf16' is not supported on npu "
                                                           r"\(Ascend910A\); use precision 'fp16' or 'no'$"):
            BF16Precision().check_supported(accelerator)
        FP16Precision().check_supported(accelerator)


def test_bf16_is_accepted_where_the_soc_has_it():
    with install_fake_torch_npu(bf16=True, device_name="Ascend910B2") as fake:
        BF16Precision().check_supported(NPUAccelerator())
        assert fake.called("is_bf16_supported")


def test_fp8_is_refused(fake_npu):
    with pytest.raises(UnsupportedHardwareError, match=r"this machine has npu \(Ascend910B2\)\. Use precision 'bf16'"):
        FP8Precision().check_supported(NPUAccelerator())


def test_a_bf16_model_is_refused_before_it_is_built(monkeypatch):
    from twinkle_backend_npu.testing.conformance import make_tiny_npu_model

    monkeypatch.setenv("TWINKLE_ACCELERATOR", "npu")
    with install_fake_torch_npu(bf16=False, device_name="Ascend910A"), \
            pytest.raises(UnsupportedHardwareError, match="use precision 'fp16'"):
        make_tiny_npu_model(precision="bf16")


def test_fp16_trains_with_dynamic_loss_scaling_on_the_npu_accelerator(fake_npu):
    from twinkle_backend_npu.testing.conformance import make_tiny_npu_model

    model = make_tiny_npu_model(precision="fp16")
    model.set_optimizer("SGD", lr=0.1)
    before = {k: v.detach().clone() for k, v in model.get_state_dict().items()}
    model.forward_backward(inputs=make_batch(0, rows=4, length=8))
    model.clip_grad_and_step()
    scaler = model.precision.state_dict()["scaler"]
    # the loss was scaled by the initial 2**16 and the step was taken (no overflow on a tiny model)
    assert scaler["scale"] == 2.0**16 and scaler["_growth_tracker"] == 1
    after = model.get_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in after.values())
