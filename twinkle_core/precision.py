"""Precision modes: how the forward runs (autocast) and how gradients are scaled.

``no`` (fp32), ``bf16`` and ``fp16`` (autocast; fp16 adds a dynamic loss scaler) work on any torch
device that supports them. ``fp8`` needs float8 training (torchao) on a GPU with compute capability
8.9+; elsewhere it is a clear error.
"""

from __future__ import annotations

import contextlib
import importlib.util
from abc import ABC
from typing import TYPE_CHECKING, Any, ClassVar

from twinkle_core.errors import UnsupportedHardwareError

if TYPE_CHECKING:
    import torch

    from twinkle_core.accelerator import Accelerator


class Precision(ABC):
    """Subclasses override the pieces they change; the defaults are plain fp32 training."""

    name: ClassVar[str] = ""
    autocast_dtype: ClassVar[str | None] = None
    #: the accelerator's capability this mode needs (``"bf16"`` asks ``accelerator.supports_bf16()``), and what
    #: to say when it is missing (``{accelerator}`` is the accelerator's description)
    needs: ClassVar[str | None] = None
    refusal: ClassVar[str] = ""

    def check_supported(self, accelerator: Accelerator) -> None:
        """Raise :class:`UnsupportedHardwareError` when ``accelerator`` cannot run this mode."""
        if self.needs is not None and not getattr(accelerator, f"supports_{self.needs}")():
            raise UnsupportedHardwareError(self.refusal.format(accelerator=accelerator.describe()))

    def prepare_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(device_type=device_type, dtype=getattr(torch, self.autocast_dtype))

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Undo loss scaling on the gradients before clipping or stepping."""

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; return False when the step was skipped (fp16 overflow)."""
        optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class FullPrecision(Precision):
    name = "no"


class BF16Precision(Precision):
    name = "bf16"
    autocast_dtype = "bfloat16"
    needs = "bf16"
    refusal = "precision 'bf16' is not supported on {accelerator}; use precision 'fp16' or 'no'"


class FP16Precision(Precision):
    """fp16 autocast with dynamic loss scaling (``torch.amp.GradScaler``)."""

    name = "fp16"
    autocast_dtype = "float16"

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.init_scale, self.growth_interval = init_scale, growth_interval
        self._scaler: Any = None

    def scaler(self, device_type: str = "cpu") -> Any:
        if self._scaler is None:
            import torch

            self._scaler = torch.amp.GradScaler(device_type, init_scale=self.init_scale,
                                                growth_interval=self.growth_interval)
        return self._scaler

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        self.scaler(device_type)
        return super().autocast(device_type)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler(loss.device.type).scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        # once per gradient window: the model normalises (and so unscales) a window's gradients only once
        self.scaler().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        scaler = self.scaler()
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        return scaler.get_scale() >= scale_before

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self._scaler.state_dict()} if self._scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scaler" in state:
            self.scaler().load_state_dict(state["scaler"])


class FP8Precision(Precision):
    """Float8 linear layers through torchao (``convert_to_float8_training``) under bf16 autocast."""

    name = "fp8"
    autocast_dtype = "bfloat16"
    needs = "fp8"
    refusal = ("precision 'fp8' needs a GPU with float8 tensor cores (NVIDIA Ada/Hopper, compute capability >= 8.9); "
               "this machine has {accelerator}. Use precision 'bf16' instead.")

    def check_supported(self, accelerator: Accelerator) -> None:
        super().check_supported(accelerator)
        if importlib.util.find_spec("torchao") is None:
            raise UnsupportedHardwareError("precision 'fp8' needs torchao: pip install torchao")

    def prepare_module(self, module: torch.nn.Module) -> torch.nn.Module:
        from torchao.float8 import convert_to_float8_training

        def dims_fit(mod: Any, _fqn: str) -> bool:
            # float8 matmuls need both dimensions divisible by 16
            weight = getattr(mod, "weight", None)
            return weight is not None and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0

        convert_to_float8_training(module, module_filter_fn=dims_fit)
        return module
