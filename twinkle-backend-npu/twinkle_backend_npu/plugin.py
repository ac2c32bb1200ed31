"""Registrations of the Ascend NPU backend (entry point ``twinkle: npu``).

Importing this module imports neither torch nor torch_npu (``twinkle plugins`` stays fast).
"""

from __future__ import annotations

from twinkle_core import AcceleratorRecord, ConformanceTarget, hookimpl

_PKG = "twinkle_backend_npu"


@hookimpl
def twinkle_register_accelerators():
    yield AcceleratorRecord("npu", f"{_PKG}.accelerator:NPUAccelerator", "Ascend NPU via torch_npu, HCCL collectives")


@hookimpl
def twinkle_select_accelerator(accelerators):
    # ahead of the core's cuda/cpu choice: an NPU host trains on its NPUs when torch_npu imports and sees one
    record = accelerators.get("npu")
    if record is not None and record.load().is_available():
        return record
    return None


@hookimpl
def twinkle_register_conformance_targets():
    # TransformersModel on the npu accelerator (needs twinkle-backend-hf); the factory refuses any other accelerator
    factory = f"{_PKG}.testing.conformance:make_tiny_npu_model"
    yield ConformanceTarget("hf-npu", factory)
    yield ConformanceTarget("hf-npu-ddp", factory, options={"strategy": "ddp"}, world_size=2)


# ---------------------------------------------------------------------- fused kernels (N2 appends below)


@hookimpl
def twinkle_register_kernels():
    # npu_rms_norm, npu_rotary_mul, npu_swiglu, npu_fusion_attention and NpuFusedAdamW (twinkle_backend_npu.kernels)
    from twinkle_backend_npu.kernels import kernel_records

    yield from kernel_records()
