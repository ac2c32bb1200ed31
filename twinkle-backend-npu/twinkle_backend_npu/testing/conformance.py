"""Conformance factory: the HF backend's tiny model, refused unless it really runs on the npu accelerator.

Registered as the conformance targets ``hf-npu`` and ``hf-npu-ddp`` (see :mod:`twinkle_backend_npu.plugin`).
On Ascend hardware they run as they are; on a CPU machine run them under the fake
(:mod:`twinkle_backend_npu.testing.run_on_fake_npu`). The checks below make a run that silently fell
back to the CPU accelerator or to gloo fail every test instead of passing.
"""

from __future__ import annotations

from typing import Any


def check_runs_on_npu(model: Any) -> None:
    """Raise unless ``model`` trains on the npu accelerator and its process group (if any) is HCCL."""
    import torch.distributed as dist

    accelerator = model.get_train_configs()["accelerator"]
    if accelerator != "npu":
        raise AssertionError(f"the model runs on the {accelerator!r} accelerator, not 'npu'; set "
                             f"TWINKLE_ACCELERATOR=npu (and on CPU install the fake torch_npu)")
    if dist.is_available() and dist.is_initialized() and dist.get_backend() != "hccl":
        raise AssertionError(f"the process group uses {dist.get_backend()!r}, not 'hccl'")


def make_tiny_npu_model(*, seed: int = 0, **options: Any) -> Any:
    from twinkle_backend_hf.testing import make_tiny_model

    model = make_tiny_model(seed=seed, **options)
    check_runs_on_npu(model)
    return model
