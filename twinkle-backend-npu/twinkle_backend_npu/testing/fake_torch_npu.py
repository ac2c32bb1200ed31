"""A fake ``torch_npu`` backed by the CPU, for tests on machines without Ascend hardware or CANN.

:func:`install_fake_torch_npu` puts a ``torch_npu`` module into ``sys.modules`` and a ``torch.npu``
namespace onto torch (what real torch_npu does on import), registers ``hccl`` as a
``torch.distributed`` backend that runs gloo, and exposes the fused ops of
:mod:`twinkle_backend_npu.testing.fake_ops` (``torch_npu.npu_rms_norm``, ``npu_rotary_mul``,
``npu_swiglu``, ``npu_fusion_attention``, ``torch_npu.optim.NpuFusedAdamW``) lazily. Its parameters
simulate each way a real install fails: not installed, CANN missing (or any other import error), a
mismatched version, no device, no bf16.

The seam. CPU torch cannot create tensors on an ``npu`` device, and torch's PrivateUse1 name (which
real torch_npu renames to ``npu``) cannot be changed to ``cpu`` without breaking torch's own CPU
autocast. So the fake replaces exactly one function of the production code,
:func:`twinkle_backend_npu.accelerator.tensor_device_type`, to answer ``cpu``: the accelerator then
places tensors on the CPU and still makes every other call (device binding, RNG, memory, sync,
bf16 support, collectives) through ``torch.npu`` and the ``hccl`` backend, which the fake records
in :attr:`FakeTorchNPU.calls`.

What cannot be undone: ``torch.distributed`` has no way to unregister a backend, so ``hccl`` stays
registered (as gloo) in a process that installed the fake once.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: the fused ops the fake exposes, all defined in twinkle_backend_npu.testing.fake_ops
FUSED_OPS = ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_fusion_attention")
FUSED_OPTIMIZERS = ("NpuFusedAdamW",)
#: what the dynamic loader says when CANN's set_env.sh was not sourced
CANN_MISSING_MESSAGE = "libascendcl.so: cannot open shared object file: No such file or directory"


@dataclass
class FakeTorchNPU:
    """How the fake behaves, and what was called on it (``calls``: ``(function, args)`` in order)."""

    installed: bool = True
    cann: bool = True
    version: str | None = None  # None: torch's own X.Y.Z, the supported pairing
    device_count: int = 8
    bf16: bool = True
    device_name: str = "Ascend910B2"
    import_error: BaseException | None = None  # raised by ``import torch_npu`` (cann=False: the libascendcl one)
    calls: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    current: int = 0
    allocated: int = 0
    peak: int = 0
    generators: list[Any] = field(default_factory=list)

    def called(self, name: str) -> list[tuple[Any, ...]]:
        return [args for function, args in self.calls if function == name]

    def set_allocated(self, nbytes: int) -> None:
        """Pretend the NPU now holds ``nbytes`` of tensors (the peak follows, as the real allocator's does)."""
        self.allocated, self.peak = nbytes, max(self.peak, nbytes)

    # ------------------------------------------------------------------ torch.npu
    def namespace(self) -> types.ModuleType:
        """The ``torch.npu`` module: each function records its call, then acts on the CPU."""
        import torch

        self.generators = [torch.Generator() for _ in range(self.device_count)]
        npu = types.ModuleType("torch_npu.npu")

        def record(function: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                self.calls.append((function.__name__, args))
                return function(*args, **kwargs)

            call.__name__ = function.__name__
            setattr(npu, function.__name__, call)
            return call

        def _index(device: Any = None) -> int:
            if device is None:
                return self.current
            if isinstance(device, str):  # "npu:1" (CPU torch cannot parse an npu torch.device)
                number = device.partition(":")[2]
                index = int(number) if number else None
            else:
                index = device if isinstance(device, int) else device.index
            index = self.current if index is None else index
            if not 0 <= index < self.device_count:
                raise RuntimeError(f"Invalid device ID {index}: {self.device_count} NPUs are visible")
            return index

        @record
        def is_available() -> bool:
            return self.device_count > 0

        @record
        def device_count() -> int:
            return self.device_count

        @record
        def set_device(device: Any) -> None:
            self.current = _index(device)

        @record
        def current_device() -> int:
            return self.current

        @record
        def synchronize(device: Any = None) -> None:
            _index(device)

        @record
        def get_device_name(device: Any = None) -> str:
            _index(device)
            return self.device_name

        @record
        def is_bf16_supported() -> bool:
            return self.bf16

        @record
        def manual_seed(seed: int) -> None:
            self.generators[self.current].manual_seed(seed)

        @record
        def manual_seed_all(seed: int) -> None:
            for generator in self.generators:
                generator.manual_seed(seed)

        @record
        def get_rng_state(device: Any = None) -> Any:
            return self.generators[_index(device)].get_state()

        @record
        def set_rng_state(state: Any, device: Any = None) -> None:
            self.generators[_index(device)].set_state(state)

        @record
        def get_rng_state_all() -> list[Any]:
            return [generator.get_state() for generator in self.generators]

        @record
        def set_rng_state_all(states: list[Any]) -> None:
            for generator, state in zip(self.generators, states, strict=True):
                generator.set_state(state)

        @record
        def memory_allocated(device: Any = None) -> int:
            return self.allocated

        @record
        def max_memory_allocated(device: Any = None) -> int:
            return self.peak

        @record
        def reset_peak_memory_stats(device: Any = None) -> None:
            self.peak = self.allocated

        return npu

    # ------------------------------------------------------------------ the torch_npu module
    def module(self) -> types.ModuleType:
        import torch

        torch_npu = types.ModuleType("torch_npu")
        torch_npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        torch_npu.__version__ = self.version or torch.__version__.split("+")[0]
        torch_npu.npu = self.namespace()
        torch_npu.__getattr__ = _lazy("torch_npu", FUSED_OPS)
        optim = types.ModuleType("torch_npu.optim")
        optim.__spec__ = importlib.machinery.ModuleSpec("torch_npu.optim", None)
        optim.__getattr__ = _lazy("torch_npu.optim", FUSED_OPTIMIZERS)
        torch_npu.optim = optim
        return torch_npu


def _lazy(module: str, names: tuple[str, ...]) -> Any:
    """A module ``__getattr__`` serving ``names`` from fake_ops on first use (the ops are N2's reference math)."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        fake_ops = importlib.import_module("twinkle_backend_npu.testing.fake_ops")
        return getattr(fake_ops, name)

    return __getattr__


class _FailingImportFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch_npu`` (it is installed) but fails to load it, as the real one does without CANN."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname == "torch_npu":
            return importlib.machinery.ModuleSpec("torch_npu", self)
        return None

    def create_module(self, spec: Any) -> Any:
        raise self.error

    def exec_module(self, module: Any) -> None:  # never reached: create_module raised
        raise self.error


def register_hccl_as_gloo() -> None:
    """Make ``hccl`` a ``torch.distributed`` backend that runs gloo on CPU tensors (once per process)."""
    import torch.distributed as dist

    if "hccl" in dist.Backend.backend_list:
        return

    def gloo(store: Any, rank: int, size: int, timeout: Any) -> Any:
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    dist.Backend.register_backend("hccl", gloo, devices=["cpu"])


def install(fake: FakeTorchNPU) -> dict[str, Any]:
    """Install ``fake`` process-wide; returns what :func:`uninstall` needs to put things back."""
    import torch

    from twinkle_backend_npu import accelerator

    saved = {"modules": {name: sys.modules.get(name, _ABSENT) for name in ("torch_npu", "torch_npu.optim")},
             "torch.npu": getattr(torch, "npu", _ABSENT), "tensor_device_type": accelerator.tensor_device_type,
             "finder": None}
    for name in ("torch_npu", "torch_npu.optim"):
        sys.modules.pop(name, None)
    if not fake.installed:
        sys.modules["torch_npu"] = None  # find_spec answers None and import raises ModuleNotFoundError
    elif not fake.cann or fake.import_error is not None:
        saved["finder"] = _FailingImportFinder(fake.import_error or ImportError(CANN_MISSING_MESSAGE))
        sys.meta_path.insert(0, saved["finder"])
    else:
        module = fake.module()
        sys.modules["torch_npu"] = module
        sys.modules["torch_npu.optim"] = module.optim
        torch.npu = module.npu
        register_hccl_as_gloo()
        accelerator.tensor_device_type = lambda: "cpu"  # the seam: see the module docstring
    return saved


def uninstall(saved: dict[str, Any]) -> None:
    import torch

    from twinkle_backend_npu import accelerator

    if saved["finder"] is not None:
        sys.meta_path.remove(saved["finder"])
    for name, module in saved["modules"].items():
        if module is _ABSENT:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module
    if saved["torch.npu"] is _ABSENT:
        if hasattr(torch, "npu"):
            del torch.npu
    else:
        torch.npu = saved["torch.npu"]
    accelerator.tensor_device_type = saved["tensor_device_type"]


_ABSENT = object()


@contextlib.contextmanager
def install_fake_torch_npu(**options: Any) -> Iterator[FakeTorchNPU]:
    """Install a :class:`FakeTorchNPU` built from ``options`` for the ``with`` block, then restore everything
    (except the ``hccl`` backend registration, which torch cannot undo)."""
    fake = FakeTorchNPU(**options)
    saved = install(fake)
    try:
        yield fake
    finally:
        uninstall(saved)
