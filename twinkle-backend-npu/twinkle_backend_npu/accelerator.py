"""The ``npu`` accelerator: Ascend NPUs through torch_npu (devices ``npu:N``, collectives over HCCL).

Every device call goes through ``torch.npu``, the namespace torch_npu installs on import. Whether
the accelerator can run is decided in this order, each refusal naming its fix: torch_npu installed,
the torch / torch_npu pair in :mod:`twinkle_backend_npu.versions`, torch_npu importable (the CANN
libraries found), an NPU visible.

The one seam the CPU fake (:mod:`twinkle_backend_npu.testing.fake_torch_npu`) replaces is
:func:`tensor_device_type`: real torch_npu renames torch's PrivateUse1 backend to ``npu``, and CPU
torch cannot make such tensors, so under the fake the accelerator's tensors live on ``cpu``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import re
import sys
from typing import Any

from twinkle_backend_npu import hccl
from twinkle_backend_npu.versions import version_problem
from twinkle_core.accelerator import TorchDeviceAccelerator
from twinkle_core.errors import UnsupportedHardwareError

logger = logging.getLogger("twinkle.npu")

NOT_INSTALLED = "torch_npu is not installed (pip install twinkle-backend-npu[ascend])"
CANN_ENV = "source /usr/local/Ascend/ascend-toolkit/set_env.sh"
NO_DEVICE = ("torch_npu imports but no NPU is visible (check `npu-smi info`, the driver, and "
             "ASCEND_RT_VISIBLE_DEVICES)")
#: what a torch_npu import failure says when the CANN toolkit's shared libraries are not on the library path
_CANN_LIBRARY = re.compile(r"lib(ascendcl|hccl|acl\w*|ge_runner|graph|runtime|opapi|hccl_\w+)\.so", re.IGNORECASE)


def tensor_device_type() -> str:
    """The device type torch gives NPU tensors: torch_npu renames PrivateUse1 to ``npu`` when it imports."""
    import torch

    return torch._C._get_privateuse1_backend_name()


def installed_torch_npu_version() -> str | None:
    """torch_npu's version without importing it when possible (a mismatched build can crash on import)."""
    module = sys.modules.get("torch_npu")
    if module is not None and getattr(module, "__version__", None):
        return module.__version__
    try:
        return importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        return None


def import_problem(exc: BaseException) -> str:
    """Why ``import torch_npu`` failed, naming the fix."""
    text = f"{type(exc).__name__}: {exc}"
    if _CANN_LIBRARY.search(text) or "ascend" in text.lower():
        return (f"the CANN libraries are not found (import torch_npu failed with {text}); run `{CANN_ENV}` "
                f"(or the set_env.sh of your CANN install) in this shell and try again")
    return f"torch_npu is installed but does not import ({text}); reinstall it for this torch"


class NPUAccelerator(TorchDeviceAccelerator):
    """RNG state, memory statistics, synchronisation, bf16 support (Ascend 910B / Atlas A2 and later compute in
    bf16, the 910A does not) and the device name come from ``torch.npu`` through :class:`TorchDeviceAccelerator`;
    the device index goes through HCCL's visible-device mapping (:mod:`twinkle_backend_npu.hccl`)."""

    name = "npu"
    device_type = "npu"  # the instance asks torch (tensor_device_type) once torch_npu is imported
    dist_backend = "hccl"
    device_module = "npu"

    def __init__(self) -> None:
        reason = self.why_unavailable()
        if reason is not None:
            raise UnsupportedHardwareError(f"the npu accelerator cannot run: {reason}")
        self.device_type = tensor_device_type()

    @classmethod
    def is_available(cls) -> bool:
        return cls.why_unavailable() is None

    @classmethod
    def why_unavailable(cls, probe: bool = True) -> str | None:
        try:
            installed = importlib.util.find_spec("torch_npu") is not None
        except (ImportError, ValueError):  # a half-imported module without a spec
            installed = False
        if not installed:
            return NOT_INSTALLED
        if not probe:
            return None
        import torch

        npu_version = installed_torch_npu_version()
        if npu_version is not None:
            problem = version_problem(torch.__version__, npu_version)
            if problem is not None:
                return problem
        try:
            torch_npu = importlib.import_module("torch_npu")
        except (ImportError, OSError, RuntimeError) as exc:
            # RuntimeError: torch_npu refuses to import next to another accelerator's torch build (e.g. CUDA)
            return import_problem(exc)
        if npu_version is None:  # a build without distribution metadata: check what it reports
            problem = version_problem(torch.__version__, str(getattr(torch_npu, "__version__", "unknown")))
            if problem is not None:
                return problem
        if not torch.npu.is_available() or torch.npu.device_count() == 0:
            return NO_DEVICE
        return None

    def configure_distributed_env(self, timeout_s: float) -> None:
        added = hccl.configure_job_env(timeout_s)
        if added:
            logger.info("HCCL environment for this job: %s", ", ".join(f"{k}={v}" for k, v in sorted(added.items())))

    @staticmethod
    def device_index(local_rank: int | None = None) -> int:
        """The NPU index of ``local_rank`` (this process's by default) among the visible devices."""
        from twinkle_core import distributed

        return hccl.visible_device_index(distributed.local_rank() if local_rank is None else local_rank)

    def device(self, local_rank: int | None = None) -> Any:
        import torch

        index = self.device_index(local_rank)
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, index)

    def set_device(self, local_rank: int | None = None) -> None:
        # an index, not self.device(): under the CPU fake the device is ``cpu`` but torch.npu still binds a rank
        self.runtime().set_device(self.device_index(local_rank))

    def supports_fp8(self) -> bool:
        return False  # no float8 training path for Ascend in torch_npu's public API
