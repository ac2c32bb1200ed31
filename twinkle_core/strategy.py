"""The parallel-strategy contract: how a module is wrapped, how gradients are synchronised and
how weights and optimizer state are gathered for checkpoints.

The core ships ``single`` (one process). Backends register ``ddp``, ``native_fsdp``,
``deepspeed``, ``megatron`` ...
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC
from typing import TYPE_CHECKING, Any, ClassVar

from twinkle_core import distributed
from twinkle_core.mesh import DeviceMesh

if TYPE_CHECKING:
    import torch

    from twinkle_core.accelerator import Accelerator


class Strategy(ABC):
    """Defaults implement one process; subclasses override what their parallelism changes."""

    name: ClassVar[str] = ""
    #: True when the wrapped module averages gradients over data-parallel ranks (DDP, FSDP).
    averages_gradients: ClassVar[bool] = False

    def __init__(self, mesh: DeviceMesh | None = None, **options: Any) -> None:
        self.mesh = mesh
        self.options = options
        self.accelerator: Accelerator | None = None
        #: the model's precision mode, set by the model before ``setup`` (engines that own the
        #: optimizer, such as DeepSpeed, configure their own mixed precision from it)
        self.precision: Any = None

    # ------------------------------------------------------------------ process group
    def setup(self, accelerator: Accelerator) -> None:
        """Join the process group and validate the mesh against the world size."""
        self.accelerator = accelerator
        distributed.init_process_group(accelerator.dist_backend)
        accelerator.set_device()
        if self.mesh is None:
            self.mesh = DeviceMesh.infer(distributed.world_size())
        self.mesh.validate(distributed.world_size())

    @property
    def dp_size(self) -> int:
        return self.mesh.data_parallel_size if self.mesh else 1

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (ranks with the same index see the same data)."""
        return distributed.rank() // max(1, distributed.world_size() // self.dp_size)

    @property
    def dp_group(self) -> Any:
        """Process group over which data-parallel ranks are reduced (``None`` = world)."""
        return None

    @property
    def is_main_process(self) -> bool:
        return distributed.is_main_process()

    def barrier(self) -> None:
        distributed.barrier()

    # ------------------------------------------------------------------ module
    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def unwrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Adapt a batch before the forward (sequence parallelism shards it here)."""
        return inputs

    def no_sync(self, module: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context in which backward does not synchronise gradients (accumulation micro-steps)."""
        return contextlib.nullcontext()

    def prepare_optimizer(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                          gradient_accumulation_steps: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Called once the optimizer exists (built from the *wrapped* module's parameters).

        Engines that own the optimizer (DeepSpeed) return their engine and wrapped optimizer here.
        """
        return module, optimizer

    # ------------------------------------------------------------------ gradients
    def global_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum ``value`` over the data-parallel ranks."""
        return distributed.all_reduce_sum(value, group=self.dp_group)

    @property
    def gradient_average_size(self) -> int:
        """How many ranks the wrapped module averages gradients over (1 when it sums or does not sync)."""
        return self.dp_size if self.averages_gradients else 1

    def gradient_scale(self, global_tokens: float) -> float:
        """Factor that turns the wrapped module's gradients into d(sum loss / global tokens)."""
        return self.gradient_average_size / max(global_tokens, 1.0)

    def backward(self, loss: torch.Tensor, module: torch.nn.Module) -> None:
        loss.backward()

    def scale_gradients(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        parameters: list[torch.nn.Parameter], factor: float) -> None:
        """Multiply the accumulated gradients by ``factor`` (once per optimizer step)."""
        if factor == 1.0:
            return
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(factor)

    def clip_grad_norm(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       parameters: list[torch.nn.Parameter], max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        """Clip in place and return the total norm before clipping (``max_norm=inf`` only measures)."""
        import torch

        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def optimizer_step(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: Any) -> bool:
        """Apply the optimizer through the precision's scaler; False when the step was skipped."""
        return precision.step(optimizer)

    def zero_grad(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  parameters: list[torch.nn.Parameter]) -> None:
        for p in parameters:
            p.grad = None

    # ------------------------------------------------------------------ checkpoints
    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The unsharded state dict, complete on every rank (collective: all ranks call it)."""
        return self.unwrap_module(module).state_dict()

    def load_state_dict(self, module: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                        strict: bool = True) -> None:
        """Load a full (unsharded) state dict into the possibly sharded module."""
        missing, unexpected = self.unwrap_module(module).load_state_dict(state_dict, strict=False)
        if strict and (missing or unexpected):
            raise KeyError(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def save_optimizer_state(self, directory: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Write the optimizer state into ``directory`` (called on every rank; default: rank 0 writes one file)."""
        import torch

        state = optimizer.state_dict()
        if self.is_main_process:
            torch.save(state, os.path.join(directory, "optimizer.pt"))

    def load_optimizer_state(self, directory: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import torch

        optimizer.load_state_dict(torch.load(os.path.join(directory, "optimizer.pt"), weights_only=False))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "mesh": self.mesh.to_dict() if self.mesh else None, **self.options}


class SingleProcessStrategy(Strategy):
    name = "single"

    def setup(self, accelerator: Accelerator) -> None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from twinkle_core.errors import ConfigError

            raise ConfigError(
                "strategy 'single' runs one process, but WORLD_SIZE > 1; choose a parallel strategy such as "
                "'ddp' or 'native_fsdp' (pip install twinkle-backend-hf)"
            )
        super().setup(accelerator)
