"""The parallel-strategy contract: how a module is wrapped, how gradients are synchronised and
how weights and optimizer state are gathered for checkpoints.

The core ships ``single`` (one process). Backends register ``ddp``, ``native_fsdp``,
``deepspeed``, ``megatron`` ...

Two things reach a strategy, each by one road:

* the model's :class:`~twinkle_core.precision.Precision`, as ``precision=`` at construction
  (``self.precision``; engines that own mixed precision, such as DeepSpeed, configure it from there);
* each optimizer, through :meth:`Strategy.prepare_optimizer`, which returns an
  :class:`OptimizerHandle`. Every gradient hook receives that handle; whatever the strategy tracks per
  optimizer (an engine, a distributed optimizer, an accumulation flag) lives on its own handle subclass,
  never in a table keyed by ``id(optimizer)``.

Precision has one owner, the strategy (as Lightning's strategy owns its precision plugin). The model never
applies its precision itself: every forward runs in :meth:`Strategy.forward_context`, the loss it
back-propagates goes through :meth:`Strategy.scale_loss`, the gradients through
:meth:`Strategy.unscale_gradients` before they are normalised, measured or clipped, and the optimizer steps
in :meth:`Strategy.optimizer_step`. The defaults apply ``self.precision`` (autocast, the fp16 loss scaler,
its step); a strategy whose engine runs mixed precision itself overrides these hooks in one place (DeepSpeed:
bf16 with fp32 master weights in the engine, no loss scaling, ``engine.step()``), and a strategy with a
precision setting of its own derives it from ``self.precision`` and refuses one that contradicts it
(``native_fsdp``'s ``mixed_precision``).
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from twinkle_core import distributed
from twinkle_core.checkpoint_layout import CheckpointLayout
from twinkle_core.mesh import DeviceMesh

if TYPE_CHECKING:
    import torch

    from twinkle_core.accelerator import Accelerator
    from twinkle_core.loss.base import LossContext
    from twinkle_core.precision import Precision


@dataclass(eq=False)
class OptimizerHandle:
    """One optimizer as a strategy drives it: made by ``prepare_optimizer``, passed to every gradient hook.

    ``optimizer`` is what the model exposes (its ``param_groups`` carry the learning rate);
    ``parameters`` are the weights it updates. Strategies subclass the handle to keep per-optimizer state::

        @dataclass(eq=False)
        class EngineHandle(OptimizerHandle):
            engine: Any = None
            reduced: bool = False
    """

    optimizer: Any
    parameters: list[Any] = field(default_factory=list)
    gradient_accumulation_steps: int = 1


class Strategy(ABC):
    """Defaults implement one process; subclasses override what their parallelism changes."""

    name: ClassVar[str] = ""
    #: True when the wrapped module averages gradients over data-parallel ranks (DDP, FSDP).
    averages_gradients: ClassVar[bool] = False
    #: mesh dimensions this strategy implements; a mesh with any other dimension > 1 is refused
    #: before anything is built (see :mod:`twinkle_core.capabilities`)
    mesh_dimensions: ClassVar[tuple[str, ...]] = ()
    #: what to use instead of a mesh dimension the strategy does not implement (``{size}`` is filled in)
    dimension_notes: ClassVar[dict[str, str]] = {}
    #: model classes (by class name, subclasses included) this strategy can drive; ``None``: any
    supported_models: ClassVar[tuple[str, ...] | None] = None
    #: which of the model spec's aliases this strategy takes as its own constructor option rather than as a
    #: mesh size. Example: Megatron declares ``frozenset({"sequence_parallel"})``, so a spec's
    #: ``sequence_parallel=True`` becomes ``strategy_options["sequence_parallel"] = True`` (sequence parallelism
    #: inside tensor-parallel regions); every alias not named here is folded into the mesh by the model
    #: (``sequence_parallel=2`` is mesh ``sp=2``), and a boolean one is refused.
    spec_options: ClassVar[frozenset[str]] = frozenset()
    #: whether a training checkpoint written by this strategy resumes on another number of processes (its
    #: optimizer state is saved unsharded or resharded on load, as DCP and Megatron's dist_checkpointing do)
    reshards_checkpoints: ClassVar[bool] = False
    #: whether parameters, gradients and optimizer states are split over the data-parallel ranks (FSDP, ZeRO)
    #: rather than copied on each: what the memory model (``twinkle train --dry-run``) divides them by. A strategy
    #: whose answer depends on its options overrides :meth:`model_state_shards`.
    shards_state: ClassVar[bool] = False

    @classmethod
    def model_state_shards(cls, options: dict[str, Any], mesh: DeviceMesh) -> int:
        """Over how many ranks this strategy with ``options`` on ``mesh`` splits each parameter with its gradient and
        optimizer state: the tensor and pipeline ranks, times the data-parallel ranks when it shards the state
        (:attr:`shards_state`, or any mesh with an ``fsdp`` dimension). Example: the HF backend's ``ulysses``
        strategy with ``data_parallel: fsdp`` shards over every rank, sequence ranks included."""
        sharded = cls.shards_state or mesh.fsdp > 1
        return mesh.tp * mesh.pp * (mesh.data_parallel_size if sharded else 1)

    @classmethod
    def splits_vocabulary(cls, options: dict[str, Any]) -> bool:
        """Whether the loss sees only each tensor-parallel rank's vocabulary shard of the logits with ``options``
        (the memory model divides the logits by ``tp`` then). Example: Megatron's, unless
        ``vocab_parallel_loss: false``."""
        return False

    def __init__(self, mesh: DeviceMesh | None = None, *, precision: Precision | None = None,
                 **options: Any) -> None:
        self.mesh = mesh
        self.options = options
        self.accelerator: Accelerator | None = None
        #: the model's precision mode (``None`` only until a model binds a strategy built without one)
        self.precision = precision

    def bind_precision(self, precision: Precision) -> None:
        """Give a strategy built without ``precision=`` the model's; a different one is a configuration error."""
        if self.precision is None:
            self.precision = precision
        elif self.precision is not precision and self.precision.name != precision.name:
            from twinkle_core.errors import ConfigError

            raise ConfigError(f"strategy {self.name!r} was built with precision {self.precision.name!r}, but the "
                              f"model uses {precision.name!r}; pass the same precision to both, or only to the model")

    # ------------------------------------------------------------------ process group
    @classmethod
    def check_world_size(cls, world_size: int) -> None:
        """Raise :class:`~twinkle_core.errors.ConfigError` when this strategy cannot run a job of ``world_size``
        processes. :meth:`setup` calls it with ``WORLD_SIZE``; ``twinkle train`` (``--dry-run`` too) calls it with
        the job's size before anything is launched. Default: any size."""

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

    def loss_context(self) -> LossContext:
        """The parallel groups a loss may need (sequence-parallel strategies add theirs)."""
        from twinkle_core.loss.base import LossContext

        return LossContext(dp_group=self.dp_group, dp_size=self.dp_size, dp_rank=self.dp_rank)

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

    @property
    def forward_is_collective(self) -> bool:
        """Whether a forward of the unwrapped module communicates (sharded parameters are gathered), so that
        every rank must run the same number of forwards: an in-process sampler then decodes in lockstep."""
        return False

    def prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Adapt a batch before the forward (sequence parallelism shards it here)."""
        return inputs

    def no_sync(self, module: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context in which backward does not synchronise gradients (accumulation micro-steps)."""
        return contextlib.nullcontext()

    def prepare_optimizer(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                          parameters: list[torch.nn.Parameter],
                          gradient_accumulation_steps: int = 1) -> tuple[torch.nn.Module, OptimizerHandle]:
        """Called once the optimizer exists (built from the *wrapped* module's ``parameters``).

        Returns the module to run from now on and the handle every gradient hook will receive. Engines that
        own the optimizer (DeepSpeed) return their engine here and keep it on their handle.
        """
        return module, OptimizerHandle(optimizer, list(parameters), gradient_accumulation_steps)

    # ------------------------------------------------------------------ precision
    # The strategy owns the precision it was built with (Lightning's habit): the model reaches its forward
    # context, loss scaling, unscaling and the optimizer step only through these methods, so an engine that
    # runs mixed precision itself (DeepSpeed) overrides them in one place.
    def forward_context(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        """The context every forward runs in (autocast to the precision's dtype, or nothing)."""
        return self.precision.autocast(device_type)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to back-propagate (multiplied by the loss scale under fp16)."""
        return self.precision.scale_loss(loss)

    def unscale_gradients(self, handle: OptimizerHandle) -> None:
        """Divide ``handle``'s gradients by the loss scale, before they are normalised, measured or clipped."""
        self.precision.unscale_(handle.optimizer)

    def prepare_precision(self, module: torch.nn.Module) -> torch.nn.Module:
        """The network converted for the precision, before it is placed and wrapped (fp8: float8 linear layers)."""
        return self.precision.prepare_module(module)

    def precision_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the precision (the fp16 loss scaler's state; empty otherwise)."""
        return self.precision.state_dict()

    def load_precision_state(self, state: dict[str, Any]) -> None:
        self.precision.load_state_dict(state)

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

    def backward(self, loss: torch.Tensor, module: torch.nn.Module, handle: OptimizerHandle | None) -> None:
        """Back-propagate ``loss`` into the gradients of ``handle``'s parameters (``None``: no optimizer yet)."""
        loss.backward()

    def scale_gradients(self, module: torch.nn.Module, handle: OptimizerHandle, factor: float) -> None:
        """Multiply the accumulated gradients by ``factor`` (once per optimizer step)."""
        if factor == 1.0:
            return
        for p in handle.parameters:
            if p.grad is not None:
                p.grad.mul_(factor)

    def clip_grad_norm(self, module: torch.nn.Module, handle: OptimizerHandle, max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        """Clip in place and return the total norm before clipping (``max_norm=inf`` only measures)."""
        import torch

        return torch.nn.utils.clip_grad_norm_(handle.parameters, max_norm, norm_type=norm_type)

    def optimizer_step(self, module: torch.nn.Module, handle: OptimizerHandle) -> bool:
        """Apply the optimizer through the precision's scaler; False when the step was skipped."""
        return self.precision.step(handle.optimizer)

    def zero_grad(self, module: torch.nn.Module, handle: OptimizerHandle) -> None:
        for p in handle.parameters:
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

    def save_optimizer_state(self, directory: str, module: torch.nn.Module, handle: OptimizerHandle) -> None:
        """Write the optimizer state into ``directory`` (called on every rank; default: rank 0 writes one file)."""
        import torch

        state = handle.optimizer.state_dict()
        if self.is_main_process:
            torch.save(state, CheckpointLayout.optimizer_file(directory))

    def load_optimizer_state(self, directory: str, module: torch.nn.Module, handle: OptimizerHandle) -> None:
        from twinkle_core.checkpoint import load_state_file

        handle.optimizer.load_state_dict(load_state_file(CheckpointLayout.optimizer_file(directory)))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "mesh": self.mesh.to_dict() if self.mesh else None, **self.options}


class SingleProcessStrategy(Strategy):
    name = "single"

    @classmethod
    def check_world_size(cls, world_size: int) -> None:
        if world_size > 1:
            from twinkle_core.errors import ConfigError

            raise ConfigError(
                f"strategy 'single' runs one process, but the job has {world_size} (WORLD_SIZE > 1); choose a "
                "parallel strategy such as 'ddp' or 'native_fsdp' (pip install twinkle-backend-hf)"
            )

    def setup(self, accelerator: Accelerator) -> None:
        self.check_world_size(int(os.environ.get("WORLD_SIZE", "1")))
        super().setup(accelerator)
