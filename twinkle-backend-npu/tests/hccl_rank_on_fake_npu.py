"""One rank of the ``hccl`` hardware check with the fake torch_npu installed (torchrun runs it in the tests)."""

import os
import runpy

from twinkle_backend_npu.testing.fake_torch_npu import FakeTorchNPU, install

install(FakeTorchNPU(device_count=int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))  # for this whole rank
os.environ["TWINKLE_ACCELERATOR"] = "npu"
runpy.run_module("twinkle_backend_npu.hardware_check_hccl", run_name="__main__", alter_sys=True)
