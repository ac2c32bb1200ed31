"""Run pytest with the fake ``torch_npu`` installed and ``TWINKLE_ACCELERATOR=npu`` (one process, or a torchrun rank).

::

    torchrun --nproc-per-node 2 -m twinkle_backend_npu.testing.run_on_fake_npu \\
        --pyargs twinkle_core.testing.conformance --twinkle-backend hf-npu-ddp

After pytest it prints one line, ``fake torch_npu: ...``, with what the run asked of ``torch.npu``
and the process group's backend, so a test can check the NPU path was taken on every rank.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    import pytest
    import torch.distributed as dist

    from twinkle_backend_npu.testing.fake_torch_npu import FakeTorchNPU, install

    fake = FakeTorchNPU(device_count=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    install(fake)  # for the whole process: this module exists to run one job on the fake
    os.environ["TWINKLE_ACCELERATOR"] = "npu"
    code = pytest.main(argv)
    summary = {"rank": int(os.environ.get("RANK", "0")),
               "set_device": sorted({args[0] for args in fake.called("set_device")}),
               "calls": sorted({name for name, _ in fake.calls}),
               "backend": dist.get_backend() if dist.is_initialized() else None}
    print(f"fake torch_npu: {json.dumps(summary)}", flush=True)
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
