"""Accelerators: which device type this process trains on and which collective backend it uses.

An :class:`Accelerator` is the one place that knows a vendor's device runtime (``torch.cuda``,
``torch.npu`` ...). Everything else in Twinkle asks it: the device of this rank, the collective
backend, the device RNG state a checkpoint keeps, memory statistics, synchronisation, the autocast
device type, and why it cannot run here. A vendor plugin subclasses it (:class:`TorchDeviceAccelerator` when its
runtime is a ``torch.cuda``-shaped namespace such as ``torch.npu``) and registers it through
``twinkle_register_accelerators``; nothing in the core names a vendor outside this module.
"""

from __future__ import annotations

import importlib.util
import os
from abc import ABC, abstractmethod
from typing import Any, ClassVar


class Accelerator(ABC):
    """One kind of device. Subclasses are small; the core ships ``cpu`` and ``cuda``.

    The defaults describe a device without its own RNG, memory statistics or asynchronous
    execution (the CPU); a device accelerator overrides the ones its runtime provides.
    """

    name: ClassVar[str] = ""
    device_type: str = ""  # a ClassVar in the built-ins; a plugin may resolve it per instance
    dist_backend: ClassVar[str] = ""

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool: ...

    @classmethod
    def why_unavailable(cls, probe: bool = True) -> str | None:
        """Why this accelerator cannot run here, as a sentence naming the fix; ``None`` when it can.

        With ``probe=False`` only checks that import nothing heavy run (``twinkle plugins`` must
        stay fast and torch-free); ``None`` then means "nothing cheap rules it out".
        """
        if not probe:
            return None
        return None if cls.is_available() else f"{cls.name} is not available on this machine"

    def configure_distributed_env(self, timeout_s: float) -> None:
        """Set the vendor's environment for collectives before the process group starts.

        ``timeout_s`` is the core's collective timeout (:data:`twinkle_core.distributed.DEFAULT_TIMEOUT_S`).
        Implementations never override a variable the user already set.
        """

    def device(self, local_rank: int | None = None) -> Any:
        import torch

        if self.device_type == "cpu":
            return torch.device("cpu")
        rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        return torch.device(self.device_type, rank)

    def set_device(self, local_rank: int | None = None) -> None:
        """Bind this process to its device (no-op on CPU)."""

    @property
    def autocast_device_type(self) -> str:
        """The ``device_type`` argument of ``torch.autocast`` / ``torch.amp.GradScaler`` on this accelerator."""
        return self.device_type

    # ------------------------------------------------------------------ device RNG
    def get_rng_state(self) -> Any:
        """The device RNG state a checkpoint keeps (``None``: no RNG beyond torch's CPU generator)."""
        return None

    def set_rng_state(self, state: Any) -> None:
        """Restore what :meth:`get_rng_state` returned."""

    # ------------------------------------------------------------------ memory and sync
    def synchronize(self) -> None:
        """Wait for this device's queued work (timings, memory readings)."""

    def memory_allocated(self) -> int | None:
        """Bytes of device memory held by tensors now (``None``: the device keeps no statistics)."""
        return None

    def max_memory_allocated(self) -> int | None:
        """Peak of :meth:`memory_allocated` since the last :meth:`reset_peak_memory_stats`."""
        return None

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak for :meth:`max_memory_allocated`."""

    def supports_bf16(self) -> bool:
        return True

    def supports_fp8(self) -> bool:
        return False

    def describe(self) -> str:
        return self.name


class CPUAccelerator(Accelerator):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        return True


class TorchDeviceAccelerator(Accelerator):
    """A device whose runtime is a ``torch.<device_module>`` namespace shaped like ``torch.cuda`` (``torch.npu``,
    ``torch.xpu`` ...): the RNG state, memory statistics, synchronisation, bf16 support and the device name are
    the same calls on that namespace, so a vendor's accelerator names its module and inherits them.

    The namespace is looked up at each call (not at import): a vendor package such as torch_npu installs it only
    when it is imported, and the accessors must not import it before the accelerator is selected.
    """

    #: the attribute of ``torch`` that holds the device runtime (``"npu"`` for ``torch.npu``)
    device_module: ClassVar[str] = ""

    def runtime(self) -> Any:
        """The ``torch.<device_module>`` namespace."""
        import torch

        return getattr(torch, self.device_module)

    def set_device(self, local_rank: int | None = None) -> None:
        self.runtime().set_device(self.device(local_rank))

    def get_rng_state(self) -> Any:
        return self.runtime().get_rng_state_all()

    def set_rng_state(self, state: Any) -> None:
        self.runtime().set_rng_state_all(state)

    def synchronize(self) -> None:
        self.runtime().synchronize()

    def memory_allocated(self) -> int | None:
        return self.runtime().memory_allocated()

    def max_memory_allocated(self) -> int | None:
        return self.runtime().max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        self.runtime().reset_peak_memory_stats()

    def supports_bf16(self) -> bool:
        return bool(self.runtime().is_bf16_supported())

    def describe(self) -> str:
        return f"{self.name} ({self.runtime().get_device_name()})"


class CUDAAccelerator(TorchDeviceAccelerator):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    device_module = "cuda"

    @classmethod
    def is_available(cls) -> bool:
        if importlib.util.find_spec("torch") is None:
            return False
        import torch

        return torch.cuda.is_available()

    @classmethod
    def why_unavailable(cls, probe: bool = True) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed (pip install torch)"
        if not probe:
            return None
        import torch

        if torch.version.cuda is None:
            return f"this torch build ({torch.__version__}) has no CUDA support; install a CUDA build of torch"
        if not torch.cuda.is_available():
            return "no CUDA device is visible (check nvidia-smi, the driver and CUDA_VISIBLE_DEVICES)"
        return None

    def supports_fp8(self) -> bool:
        import torch

        # Float8 matmuls need compute capability 8.9 (Ada) or 9.0+ (Hopper).
        return torch.cuda.get_device_capability() >= (8, 9)


def current_accelerator() -> Accelerator:
    """The accelerator the plugins detect on this machine (``TWINKLE_ACCELERATOR`` overrides).

    A forced accelerator that cannot run here is an error naming why (its ``why_unavailable``),
    not a crash later on. The accelerator's distributed environment is configured before it is
    returned, so the process group a strategy starts next sees it.
    """
    from twinkle_core.distributed import DEFAULT_TIMEOUT_S
    from twinkle_core.errors import UnsupportedHardwareError
    from twinkle_core.plugins import get_plugins

    plugins = get_plugins()
    forced = os.environ.get("TWINKLE_ACCELERATOR")
    record = plugins.get("accelerator", forced) if forced else plugins.select_accelerator()
    cls = plugins.load_record("accelerator", record)
    if forced:
        reason = cls.why_unavailable()
        if reason is not None:
            raise UnsupportedHardwareError(f"TWINKLE_ACCELERATOR={forced} cannot be used: {reason}")
    accelerator = cls()
    accelerator.configure_distributed_env(DEFAULT_TIMEOUT_S)
    return accelerator


def accelerator_statuses(plugins: Any = None, probe: bool = False) -> list[dict[str, Any]]:
    """For ``twinkle plugins``: each registered accelerator, whether it is active, and why not.

    ``status`` is ``active`` (what training would use), ``available``, ``not active`` (with
    ``reason``), or ``not probed`` (``probe=False`` and nothing cheap ruled it out: finding out needs
    torch and the device runtime, which the fast listing does not import).
    """
    from twinkle_core.errors import TwinkleError
    from twinkle_core.plugins import PLUGIN_FAULTS, get_plugins

    plugins = plugins if plugins is not None else get_plugins()
    active = None
    if probe:
        forced = os.environ.get("TWINKLE_ACCELERATOR")
        try:
            active = forced or plugins.select_accelerator().name
        except PLUGIN_FAULTS:  # the per-accelerator reasons below say why nothing is selected
            active = None
    statuses = []
    for name in plugins.names("accelerator"):
        try:
            cls = plugins.load("accelerator", name)
            reason = cls.why_unavailable(probe=probe)
        except (TwinkleError, *PLUGIN_FAULTS) as exc:  # a broken plugin is reported in the listing
            reason = f"cannot be checked: {type(exc).__name__}: {exc}"
        if reason is not None:
            status = "not active"
        elif not probe:
            status = "not probed"
        else:
            status = "active" if name == active else "available"
        statuses.append({"name": name, "status": status, "reason": reason})
    return statuses
