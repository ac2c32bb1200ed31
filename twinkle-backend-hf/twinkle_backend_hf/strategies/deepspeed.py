"""DeepSpeed ZeRO stage 1/2/3 as a Twinkle strategy.

``strategy="deepspeed", strategy_options={"stage": 2, "offload_optimizer": False, "offload_param": False,
"config": {...}}``. The DeepSpeed engine owns the optimizer's master weights and the partitioned gradients;
Twinkle keeps the contract it has with every strategy:

* **Gradient normalisation.** Losses are token *sums*. ``engine.backward`` is called with
  ``scale_wrt_gas=False`` (no ``1/gradient_accumulation_steps``), ZeRO averages over the data-parallel
  ranks (``gradient_average_size == dp_size``), and once per optimizer step the partitioned fp32
  gradients are multiplied by ``dp_size / global_tokens`` (ZeRO-3 through
  ``deepspeed.utils.safe_get_local_grad`` / ``safe_set_local_grad``; ZeRO-1/2 through the gradient
  fragment each parameter's ``_hp_mapping`` names, the object ``safe_get_full_grad`` reads).
* **Accumulation.** The model's ``no_sync`` micro-steps are DeepSpeed non-boundary backwards; the
  last backward before a step is the boundary (``engine.set_gradient_accumulation_boundary``).
* **Clipping.** DeepSpeed's ``gradient_clipping`` is 0; :meth:`DeepSpeedStrategy.clip_grad_norm` computes
  the global norm over the gradient partitions and scales them, so it returns the true pre-clip norm.
* **Weights.** :meth:`full_state_dict` returns the complete fp32 weights (ZeRO-3 gathers them; with
  bf16 the trainable weights come from the fp32 master copies); :meth:`load_state_dict` writes a full
  state dict into the (partitioned) module and into the optimizer's fp32 master weights.
* **Optimizer state.** ``engine.save_checkpoint`` / ``load_checkpoint`` into ``<state dir>/deepspeed``
  (every rank writes its own partition).
* **Precision.** The engine owns mixed precision. The model's precision decides, at ``setup``: ``bf16`` runs
  DeepSpeed's bf16 mode (bf16 weights, fp32 master weights); ``fp16`` is refused (its torch GradScaler cannot
  see the partitions). So nothing scales the loss and nothing unscales the gradients (``scale_loss`` /
  ``unscale_gradients`` leave them as they are), and the step is ``engine.step()``; the forward still runs in
  the precision's autocast (``forward_context``).

The engine is created lazily, at the first training forward (or step / checkpoint) after
``set_optimizer``, so adapters can each get an optimizer first. Several optimizers (one per adapter)
share one engine through :class:`~.deepspeed_optimizer_group.OptimizerGroup`, which steps only the optimizer whose ``step`` is
being taken, so a tenant's update never moves another tenant's weights. Each optimizer's
:class:`DeepSpeedHandle` knows its parameters and whether its gradients are in the partitions.

On CPU, set nothing: the strategy selects ``DS_ACCELERATOR=cpu`` and the gloo process group. Nothing
needs compiling with torch optimizers.

This module holds the strategy class itself (options, process group, wrapping, the hooks of the strategy
contract); it composes objects that live beside it and get the engine, the wrapped module and the handle as
arguments: :mod:`.deepspeed_config` (the generated DeepSpeed config), :mod:`.deepspeed_runtime` (importing
DeepSpeed, creating engines), :mod:`.deepspeed_optimizer_group` (several optimizers on one engine),
:mod:`.deepspeed_module` (the wrapped module and handle), :mod:`.deepspeed_gradients` (:class:`ZeroGradients`:
backward, scaling, clipping, stepping) and :mod:`.deepspeed_checkpoint` (:class:`ZeroCheckpoints`: full
weights and ZeRO checkpoints).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from twinkle_backend_hf.strategies.deepspeed_checkpoint import ZeroCheckpoints
from twinkle_backend_hf.strategies.deepspeed_config import engine_bf16
from twinkle_backend_hf.strategies.deepspeed_gradients import ZeroGradients
from twinkle_backend_hf.strategies.deepspeed_module import DeepSpeedHandle, DeepSpeedModule
from twinkle_backend_hf.strategies.deepspeed_runtime import (
    EngineSettings,
    create_inference_engine,
    create_training_engine,
    import_deepspeed,
    skip_cpu_inference_comm_op,
)
from twinkle_core.capabilities import check_mesh
from twinkle_core.errors import ConfigError
from twinkle_core.mesh import DeviceMesh
from twinkle_core.strategy import OptimizerHandle, Strategy

if TYPE_CHECKING:
    from twinkle_core.accelerator import Accelerator
    from twinkle_core.precision import Precision


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
    shards_state = True
    averages_gradients = True  # ZeRO's reduce-scatter / all-reduce averages over the data-parallel ranks
    mesh_dimensions: ClassVar[tuple[str, ...]] = ("dp", "fsdp")  # ZeRO shards over all dp * fsdp ranks

    def __init__(self, mesh: DeviceMesh | None = None, *, precision: Precision | None = None, stage: int = 2,
                 offload_optimizer: bool = False, offload_param: bool = False,
                 config: dict[str, Any] | None = None, **unknown: Any) -> None:
        if unknown:
            raise ConfigError(f"strategy 'deepspeed' got unknown option(s) {sorted(unknown)}; known: stage, "
                              f"offload_optimizer, offload_param, config")
        if stage not in (1, 2, 3) or isinstance(stage, bool):
            raise ConfigError(f"strategy_options.stage must be 1, 2 or 3 (ZeRO stage), got {stage!r}")
        if offload_param and stage != 3:
            raise ConfigError("strategy_options.offload_param needs ZeRO stage 3 (strategy_options.stage=3)")
        if config is not None and not isinstance(config, dict):
            raise ConfigError(f"strategy_options.config must be a dict (a DeepSpeed config), "
                              f"got {type(config).__name__}")
        super().__init__(mesh, precision=precision, stage=stage, offload_optimizer=bool(offload_optimizer),
                         offload_param=bool(offload_param), config=dict(config or {}))
        self.stage = stage
        self.offload_optimizer = bool(offload_optimizer)
        self.offload_param = bool(offload_param)
        self.user_config = dict(config or {})
        #: DeepSpeed's bf16 mode (bf16 weights, fp32 master weights); decided from the precision in setup
        self.bf16 = False
        #: the partitioned gradients of this strategy's engines
        self.gradients = ZeroGradients(stage)
        self._in_no_sync = False

    # ------------------------------------------------------------------ process group
    def setup(self, accelerator: Accelerator) -> None:
        self.bf16 = engine_bf16(self.precision, self.user_config)  # refuses fp16 before the process group is joined
        self.deepspeed = import_deepspeed(accelerator.name)
        import torch.distributed as dist

        super().setup(accelerator)
        if not dist.is_initialized():
            # A single process: DeepSpeed still wants a process group; a world of one needs no rendezvous.
            dist.init_process_group(accelerator.dist_backend, store=dist.HashStore(), rank=0, world_size=1)
            for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                os.environ.setdefault(key, value)  # DeepSpeed's engine checks LOCAL_RANK
        check_mesh(self.name, self.mesh, self.mesh_dimensions)
        if accelerator.name == "cpu":
            skip_cpu_inference_comm_op()
        self.deepspeed.init_distributed(dist_backend=accelerator.dist_backend, auto_mpi_discovery=False)

    def engine_settings(self) -> EngineSettings:
        return EngineSettings(stage=self.stage, offload_optimizer=self.offload_optimizer,
                              offload_param=self.offload_param, bf16=self.bf16, user_config=self.user_config)

    def _device(self) -> torch.device:
        return self.accelerator.device() if self.accelerator is not None else torch.device("cpu")

    def _checkpoints(self) -> ZeroCheckpoints:
        return ZeroCheckpoints(deepspeed=self.deepspeed, stage=self.stage, bf16=self.bf16, device=self._device())

    # ------------------------------------------------------------------ module
    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        wrapped = DeepSpeedModule(module, self.create_engine)
        if self.stage == 3 and not any(p.requires_grad for p in module.parameters()):
            # A frozen model (a reference or teacher, see frozen_copy) never gets an optimizer, so no training
            # engine would ever partition it; ZeRO-3 partitions it now in an engine without optimizer
            # (DeepSpeed's ZeRO-Offload / ZeRO-Inference), placed like the policy. ZeRO-1/2 only partition
            # optimizer state and gradients, which a frozen model has none of: it stays a plain replica.
            wrapped.attach_engine(create_inference_engine(self.deepspeed, self.engine_settings(), module))
        return wrapped

    def unwrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.module if isinstance(module, DeepSpeedModule) else module

    @property
    def forward_is_collective(self) -> bool:
        return self.stage == 3  # ZeRO-3 gathers each layer's partitioned parameters in its forward

    @contextlib.contextmanager
    def no_sync(self, module: torch.nn.Module) -> Iterator[None]:
        """A micro-step that is not the last before a step: a DeepSpeed non-boundary backward."""
        previous, self._in_no_sync = self._in_no_sync, True
        try:
            yield
        finally:
            self._in_no_sync = previous

    def prepare_optimizer(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                          parameters: list[torch.nn.Parameter],
                          gradient_accumulation_steps: int = 1) -> tuple[torch.nn.Module, DeepSpeedHandle]:
        wrapped = DeepSpeedModule.of(module)
        if wrapped.engine is not None:
            raise ConfigError("strategy 'deepspeed' builds one engine for all optimizers at the first training "
                              "step; call set_optimizer for every adapter before the first forward_backward")
        if any(optimizer is known.optimizer for known in wrapped.handles):
            raise ConfigError("this optimizer is already set on the model")
        handle = DeepSpeedHandle(optimizer, list(parameters), int(gradient_accumulation_steps))
        wrapped.handles.append(handle)
        return wrapped, handle

    def create_engine(self, wrapped: DeepSpeedModule) -> Any:
        """The one training engine of every optimizer registered on ``wrapped`` (built on first call)."""
        if wrapped.engine is None:
            engine, group = create_training_engine(self.deepspeed, self.engine_settings(), wrapped)
            wrapped.attach_engine(engine, group)
            engine.train(wrapped.training)
        return wrapped.engine

    def _engine(self, module: torch.nn.Module, *, create: bool = False) -> Any:
        """``module``'s engine (``None`` before it exists; ``create``: build it once an optimizer is set)."""
        if not isinstance(module, DeepSpeedModule):
            return None
        if module.engine is None and create and module.handles:
            self.create_engine(module)
        return module.engine

    # ------------------------------------------------------------------ precision
    # The engine owns mixed precision (bf16 with fp32 master weights; fp16 is refused in setup): the loss is
    # back-propagated as it is and the gradients need no unscaling. The step is the engine's (optimizer_step).
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_gradients(self, handle: OptimizerHandle) -> None:
        return None

    # ------------------------------------------------------------------ gradients (ZeroGradients once the engine exists)
    def backward(self, loss: torch.Tensor, module: torch.nn.Module, handle: OptimizerHandle | None) -> None:
        engine = self._engine(module)
        if engine is None:
            return super().backward(loss, module, handle)
        self.gradients.backward(engine, module, handle, loss, accumulating=self._in_no_sync)

    def scale_gradients(self, module: torch.nn.Module, handle: OptimizerHandle, factor: float) -> None:
        engine = self._engine(module, create=True)
        if engine is None:
            return super().scale_gradients(module, handle, factor)
        self.gradients.scale(engine, handle, factor)

    def clip_grad_norm(self, module: torch.nn.Module, handle: OptimizerHandle, max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        engine = self._engine(module, create=True)
        if engine is None:
            return super().clip_grad_norm(module, handle, max_norm, norm_type)
        return self.gradients.clip(engine, handle, max_norm, norm_type, device=self._device(), group=self.dp_group)

    def optimizer_step(self, module: torch.nn.Module, handle: OptimizerHandle) -> bool:
        engine = self._engine(module, create=True)
        if engine is None:
            return super().optimizer_step(module, handle)
        return self.gradients.step(engine, module, handle)

    def zero_grad(self, module: torch.nn.Module, handle: OptimizerHandle) -> None:
        engine = self._engine(module)
        if engine is not None and handle.gradients is not None:
            self.gradients.discard(engine, module, handle)
        super().zero_grad(module, handle)

    # ------------------------------------------------------------------ checkpoints (ZeroCheckpoints)
    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The complete weights, on every rank (ZeRO-3 gathers one submodule at a time)."""
        if self._engine(module) is None:
            return super().full_state_dict(module)
        return self._checkpoints().full_state_dict(module)

    def load_state_dict(self, module: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                        strict: bool = True) -> None:
        """Write complete weights into the module (ZeRO-3: into its partitions) and into the fp32 master
        weights the optimizer keeps, so the next step continues from them."""
        if self._engine(module) is None:
            return super().load_state_dict(module, state_dict, strict)
        self._checkpoints().load_full_weights(module, state_dict, strict)

    def save_optimizer_state(self, directory: str, module: torch.nn.Module, handle: OptimizerHandle) -> None:
        """``engine.save_checkpoint`` into ``directory/deepspeed`` (each rank writes its partitions)."""
        engine = self._engine(module, create=True)
        if engine is None:
            return super().save_optimizer_state(directory, module, handle)
        checkpoints = self._checkpoints()
        checkpoints.save(engine, directory, checkpoints.layout(module, self.dp_size),
                         write_layout=self.is_main_process)
        self.barrier()

    def load_optimizer_state(self, directory: str, module: torch.nn.Module, handle: OptimizerHandle) -> None:
        """``engine.load_checkpoint``: the optimizer state and fp32 master weights of this optimizer's partitions;
        the other optimizers (adapters) on the engine keep their weights and states."""
        if not isinstance(module, DeepSpeedModule):
            return super().load_optimizer_state(directory, module, handle)
        checkpoints = self._checkpoints()
        checkpoints.check_saved(directory, checkpoints.layout(module, self.dp_size))
        checkpoints.load(self.create_engine(module), module, directory, handle)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "bf16": self.bf16,
                "deepspeed_version": getattr(getattr(self, "deepspeed", None), "__version__", None)}
