"""Accelerators: which device type this process trains on and which collective backend it uses."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any, ClassVar


class Accelerator(ABC):
    """One kind of device. Subclasses are small; the core ships ``cpu`` and ``cuda``."""

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = ""
    dist_backend: ClassVar[str] = ""

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool: ...

    def device(self, local_rank: int | None = None) -> Any:
        import torch

        if self.device_type == "cpu":
            return torch.device("cpu")
        rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        return torch.device(self.device_type, rank)

    def set_device(self, local_rank: int | None = None) -> None:
        """Bind this process to its device (no-op on CPU)."""

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


class CUDAAccelerator(Accelerator):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"

    @classmethod
    def is_available(cls) -> bool:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            return False
        import torch

        return torch.cuda.is_available()

    def set_device(self, local_rank: int | None = None) -> None:
        import torch

        torch.cuda.set_device(self.device(local_rank))

    def supports_bf16(self) -> bool:
        import torch

        return torch.cuda.is_bf16_supported()

    def supports_fp8(self) -> bool:
        import torch

        # Float8 matmuls need compute capability 8.9 (Ada) or 9.0+ (Hopper).
        return torch.cuda.get_device_capability() >= (8, 9)

    def describe(self) -> str:
        import torch

        return f"cuda ({torch.cuda.get_device_name()})"


def current_accelerator() -> Accelerator:
    """The accelerator the plugins detect on this machine (``TWINKLE_ACCELERATOR`` overrides)."""
    from twinkle_core.plugins import get_plugins

    plugins = get_plugins()
    forced = os.environ.get("TWINKLE_ACCELERATOR")
    record = plugins.get("accelerator", forced) if forced else plugins.select_accelerator()
    return record.load()()
