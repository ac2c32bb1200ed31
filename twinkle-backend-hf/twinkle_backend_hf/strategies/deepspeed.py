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
* **Precision.** The model's precision decides, at ``setup``: ``bf16`` runs DeepSpeed's bf16 mode (bf16
  weights, fp32 master weights); ``fp16`` is refused (its torch GradScaler cannot see the partitions).

The engine is created lazily, at the first training forward (or step / checkpoint) after
``set_optimizer``, so adapters can each get an optimizer first. Several optimizers (one per adapter)
share one engine through :class:`_OptimizerGroup`, which steps only the optimizer whose ``step`` is
being taken, so a tenant's update never moves another tenant's weights. Each optimizer's
:class:`DeepSpeedHandle` knows its parameters and whether its gradients are in the partitions.

On CPU, set nothing: the strategy selects ``DS_ACCELERATOR=cpu`` and the gloo process group. Nothing
needs compiling with torch optimizers.

This module holds the strategy class itself (options, process group, wrapping, engine creation); the pieces
it is built from live beside it:
:mod:`.deepspeed_config` (the generated DeepSpeed config), :mod:`.deepspeed_runtime` (importing DeepSpeed),
:mod:`.deepspeed_optimizer_group` (several optimizers on one engine), :mod:`.deepspeed_module` (the wrapped
module and handle), :mod:`.deepspeed_gradients` (backward, scaling, clipping, stepping) and
:mod:`.deepspeed_checkpoint` (full weights and ZeRO checkpoints).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from twinkle_backend_hf.strategies import _dist
from twinkle_backend_hf.strategies.deepspeed_checkpoint import _DeepSpeedCheckpoints
from twinkle_backend_hf.strategies.deepspeed_config import build_config
from twinkle_backend_hf.strategies.deepspeed_gradients import _DeepSpeedGradients
from twinkle_backend_hf.strategies.deepspeed_module import DeepSpeedHandle, DeepSpeedModule
from twinkle_backend_hf.strategies.deepspeed_optimizer_group import _OptimizerGroup
from twinkle_backend_hf.strategies.deepspeed_runtime import _import_deepspeed, _skip_cpu_inference_comm_op
from twinkle_core.capabilities import check_mesh
from twinkle_core.errors import ConfigError
from twinkle_core.mesh import DeviceMesh
from twinkle_core.strategy import Strategy

if TYPE_CHECKING:
    from twinkle_core.accelerator import Accelerator
    from twinkle_core.precision import Precision

_FP16_UNSUPPORTED = ("precision 'fp16' is not supported with strategy 'deepspeed' (its torch GradScaler cannot see "
                     "DeepSpeed's partitioned gradients); use precision 'bf16' or 'no'")


# ====================================================================== the strategy
class DeepSpeedStrategy(_DeepSpeedGradients, _DeepSpeedCheckpoints, Strategy):
    name = "deepspeed"
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
        self._in_no_sync = False

    # ------------------------------------------------------------------ process group
    def setup(self, accelerator: Accelerator) -> None:
        self.bf16 = self._engine_bf16()  # refuses fp16 before the process group is joined
        self.deepspeed = _import_deepspeed(accelerator.name)
        import torch.distributed as dist

        super().setup(accelerator)
        if not dist.is_initialized():
            # A single process: DeepSpeed still wants a process group; a world of one needs no rendezvous.
            dist.init_process_group(accelerator.dist_backend, store=dist.HashStore(), rank=0, world_size=1)
            for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                os.environ.setdefault(key, value)  # DeepSpeed's engine checks LOCAL_RANK
        check_mesh(self.name, self.mesh, self.mesh_dimensions)
        if accelerator.name == "cpu":
            _skip_cpu_inference_comm_op()
        self.deepspeed.init_distributed(dist_backend=accelerator.dist_backend, auto_mpi_discovery=False)

    def _engine_bf16(self) -> bool:
        """bf16 autocast means DeepSpeed's bf16 mode; fp16 is refused (DeepSpeed owns the loss scaling). A
        ``bf16`` section of the user config has the last word, as it has in the generated config."""
        autocast_dtype = self.precision.autocast_dtype if self.precision is not None else None
        if autocast_dtype == "float16":
            raise ConfigError(_FP16_UNSUPPORTED)
        configured = (self.user_config.get("bf16") or {}).get("enabled")
        return bool(autocast_dtype == "bfloat16" if configured is None else configured)

    # ------------------------------------------------------------------ module
    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        wrapped = DeepSpeedModule(module, self)
        if self.stage == 3 and not any(p.requires_grad for p in module.parameters()):
            # A frozen model (a reference or teacher, see frozen_copy) never gets an optimizer, so no training
            # engine would ever partition it; ZeRO-3 partitions it now in an engine without optimizer
            # (DeepSpeed's ZeRO-Offload / ZeRO-Inference), placed like the policy. ZeRO-1/2 only partition
            # optimizer state and gradients, which a frozen model has none of: it stays a plain replica.
            self._create_inference_engine(wrapped)
        return wrapped

    def _create_inference_engine(self, wrapped: DeepSpeedModule) -> Any:
        config = build_config(stage=3, offload_optimizer=False, offload_param=self.offload_param,
                              gradient_accumulation_steps=1, bf16=self.bf16, user_config=self.user_config)
        engine, _, _, _ = self.deepspeed.initialize(model=wrapped.module, config=config, dist_init_required=False)
        object.__setattr__(wrapped, "engine", engine)
        engine.eval()
        return engine

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
        wrapped = self._wrapper(module)
        if wrapped.engine is not None:
            raise ConfigError("strategy 'deepspeed' builds one engine for all optimizers at the first training "
                              "step; call set_optimizer for every adapter before the first forward_backward")
        if any(optimizer is known.optimizer for known in wrapped.handles):
            raise ConfigError("this optimizer is already set on the model")
        handle = DeepSpeedHandle(optimizer, list(parameters), int(gradient_accumulation_steps))
        wrapped.handles.append(handle)
        return wrapped, handle

    def _wrapper(self, module: torch.nn.Module) -> DeepSpeedModule:
        if not isinstance(module, DeepSpeedModule):
            raise ConfigError("strategy 'deepspeed' was handed a module it did not wrap")
        return module

    def _create_engine(self, wrapped: DeepSpeedModule) -> Any:
        """Build the one engine for every registered optimizer."""
        if wrapped.engine is not None:
            return wrapped.engine
        if not wrapped.handles:
            raise ConfigError("strategy 'deepspeed' needs an optimizer: call set_optimizer(...) first")
        module = wrapped.module
        if any(p.grad is not None for p in module.parameters()):
            raise ConfigError("strategy 'deepspeed': gradients were computed before set_optimizer(); call "
                              "set_optimizer before the first forward_backward")
        optimizers = [handle.optimizer for handle in wrapped.handles]
        steps = {handle.gradient_accumulation_steps for handle in wrapped.handles}
        config = build_config(stage=self.stage, offload_optimizer=self.offload_optimizer,
                              offload_param=self.offload_param,
                              gradient_accumulation_steps=steps.pop() if len(steps) == 1 else 1,
                              bf16=self.bf16, user_config=self.user_config)
        group = optimizers[0] if len(optimizers) == 1 else _OptimizerGroup(optimizers)
        # DeepSpeed takes the parameters that require grad *now*; adapters that are not active
        # (PEFT freezes them) must be included too.
        with _dist.requiring_grad(wrapped.owned_parameters()):
            engine, _, _, _ = self.deepspeed.initialize(model=module, optimizer=group, config=config,
                                                        dist_init_required=False)
        object.__setattr__(wrapped, "engine", engine)
        wrapped.optimizer_group = group if isinstance(group, _OptimizerGroup) else None
        engine.train(wrapped.training)
        return engine

    def _engine(self, module: torch.nn.Module, *, create: bool = False) -> Any:
        if not isinstance(module, DeepSpeedModule):
            return None
        if module.engine is None and create and module.handles:
            self._create_engine(module)
        return module.engine

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "bf16": self.bf16,
                "deepspeed_version": getattr(getattr(self, "deepspeed", None), "__version__", None)}
