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
"""

from __future__ import annotations

import collections.abc
import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from twinkle_backend_hf.strategies import _dist
from twinkle_backend_hf.strategies.deepspeed_config import build_config
from twinkle_core import distributed
from twinkle_core.capabilities import check_mesh
from twinkle_core.errors import ConfigError
from twinkle_core.mesh import DeviceMesh
from twinkle_core.strategy import OptimizerHandle, Strategy

if TYPE_CHECKING:
    from twinkle_core.accelerator import Accelerator
    from twinkle_core.precision import Precision

_MISSING = object()
_CHECKPOINT_SUBDIR = "deepspeed"
_CHECKPOINT_TAG = "twinkle"
_LAYOUT_FILE = "twinkle_layout.json"
_FP16_UNSUPPORTED = ("precision 'fp16' is not supported with strategy 'deepspeed' (its torch GradScaler cannot see "
                     "DeepSpeed's partitioned gradients); use precision 'bf16' or 'no'")
_INSTALL_HINT = "pip install 'twinkle-backend-hf[deepspeed]' (deepspeed>=0.16 and ninja)"


def _import_deepspeed(accelerator_name: str | None = None) -> Any:
    if accelerator_name == "cpu":
        # DeepSpeed picks its accelerator once, at import; on a CPU-only job make that the CPU one.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(f"strategy 'deepspeed' needs DeepSpeed, which is not installed: {_INSTALL_HINT}") from exc
    if not os.environ.get("TWINKLE_DEEPSPEED_VERBOSE"):
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
    return deepspeed


def _skip_cpu_inference_comm_op() -> None:
    """Do not JIT-compile DeepSpeed's CPU shared-memory all-reduce (``deepspeed_shm_comm``).

    DeepSpeed's torch comm backend builds it when it starts, but only ``inference_all_reduce`` (AutoTP
    inference) uses it; ZeRO training goes through gloo. Building it takes g++, ninja and a minute or
    two on a cold cache. ``deepspeed.ops.__compatible_ops__`` is DeepSpeed's editable per-process table
    of usable ops. ``TWINKLE_DEEPSPEED_SHM_COMM=1`` keeps the op.
    """
    if os.environ.get("TWINKLE_DEEPSPEED_SHM_COMM", "") not in ("", "0"):
        return
    try:
        import deepspeed.ops

        table = deepspeed.ops.__compatible_ops__
    except Exception:  # pragma: no cover - an older layout: leave DeepSpeed alone
        return
    if isinstance(table, dict) and "deepspeed_shm_comm" in table:
        table["deepspeed_shm_comm"] = False


# ====================================================================== optimizer multiplexing
class _RoutedState(collections.abc.MutableMapping):
    """``optimizer.state`` of an :class:`_OptimizerGroup`: each key lives in the state of the optimizer
    whose parameter groups hold it (DeepSpeed reads and writes ``optimizer.state[flat_partition]``)."""

    def __init__(self, group: _OptimizerGroup) -> None:
        self._group = group

    def _owner(self, key: Any) -> torch.optim.Optimizer:
        for optimizer in self._group.optimizers:
            if key in optimizer.state:
                return optimizer
        for optimizer in self._group.optimizers:
            for param_group in optimizer.param_groups:
                if any(p is key for p in param_group["params"]):
                    return optimizer
        return self._group.optimizers[0]

    def __getitem__(self, key: Any) -> Any:
        return self._owner(key).state[key]  # the owners' states are defaultdicts, like torch's

    def __setitem__(self, key: Any, value: Any) -> None:
        self._owner(key).state[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._owner(key).state[key]

    def __iter__(self) -> Iterator[Any]:
        for optimizer in self._group.optimizers:
            yield from optimizer.state

    def __len__(self) -> int:
        return sum(len(optimizer.state) for optimizer in self._group.optimizers)

    def __contains__(self, key: object) -> bool:
        return any(key in optimizer.state for optimizer in self._group.optimizers)


class _OptimizerGroup(torch.optim.Optimizer):
    """Several torch optimizers presented to one DeepSpeed engine as one.

    Its ``param_groups`` are the members' group dicts themselves (DeepSpeed rewrites
    ``group["params"]`` in place, and a member's scheduler changes ``group["lr"]`` in place). ``step``
    steps only the :attr:`active` member, and only the groups DeepSpeed is currently presenting.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        self.active: torch.optim.Optimizer | None = None
        super().__init__([g for o in self.optimizers for g in o.param_groups], {})
        self._refresh_groups()

    def _refresh_groups(self) -> None:
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]

    @property  # type: ignore[override]
    def state(self) -> _RoutedState:
        return _RoutedState(self)

    @state.setter
    def state(self, value: Any) -> None:
        for key, entry in dict(value).items():  # torch's __init__ assigns an empty defaultdict here
            _RoutedState(self)[key] = entry

    def step(self, closure: Any = None) -> Any:
        presented = self.param_groups  # DeepSpeed narrows this to the groups it is stepping
        members = self.optimizers if self.active is None else [self.active]
        for optimizer in members:
            own = [g for g in presented if any(g is mine for mine in optimizer.param_groups)]
            if not own:
                continue
            saved = optimizer.param_groups
            optimizer.param_groups = own
            try:
                optimizer.step()
            finally:
                optimizer.param_groups = saved
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"twinkle_optimizer_group": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        members = state_dict["twinkle_optimizer_group"]
        if len(members) != len(self.optimizers):
            raise ConfigError(f"the checkpoint holds {len(members)} optimizers, this engine has "
                              f"{len(self.optimizers)}")
        for optimizer, member in zip(self.optimizers, members, strict=True):
            optimizer.load_state_dict(member)
        self._refresh_groups()  # torch's load_state_dict replaces the group dicts


# ====================================================================== the wrapped module
@dataclass(eq=False)
class DeepSpeedHandle(OptimizerHandle):
    """One optimizer on the shared engine. ``parameters`` are its model parameters (DeepSpeed replaces the
    optimizer's own with flat fp32 partitions); ``gradients`` says where its gradients stand between two
    steps: ``None``, ``"accumulating"`` (non-boundary backwards only) or ``"reduced"`` (a boundary backward
    has reduced them into the partitions)."""

    gradients: str | None = None


class DeepSpeedModule(torch.nn.Module):
    """What the model runs: the network until an engine exists, the DeepSpeed engine afterwards."""

    def __init__(self, module: torch.nn.Module, strategy: DeepSpeedStrategy) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "engine", None)  # not a registered submodule
        #: every optimizer's handle, in set_optimizer order: the engine serves them all
        self.handles: list[DeepSpeedHandle] = []
        self.optimizer_group: _OptimizerGroup | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None and self.handles and self.training and torch.is_grad_enabled():
            self._strategy._create_engine(self)
        runner = self.engine if self.engine is not None else self.module
        return runner(*args, **kwargs)

    def owned_parameters(self) -> list[torch.nn.Parameter]:
        """The model parameters of every registered optimizer."""
        return [p for handle in self.handles for p in handle.parameters]


# ====================================================================== the strategy
class DeepSpeedStrategy(Strategy):
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

    # ------------------------------------------------------------------ gradients
    def backward(self, loss: torch.Tensor, module: torch.nn.Module, handle: OptimizerHandle | None) -> None:
        engine = self._engine(module)
        if engine is None:
            loss.backward()
            return
        if handle is None:
            raise ConfigError("strategy 'deepspeed' back-propagates into an optimizer's gradient partitions: call "
                              "set_optimizer for this adapter (or the model) before its backward")
        if any(other.gradients for other in self._wrapper(module).handles if other is not handle):
            raise ConfigError("strategy 'deepspeed' holds one set of partitioned gradients for all adapters: "
                              "finish one adapter's optimizer step (clip_grad_and_step) before back-propagating "
                              "another adapter's loss")
        reduced = handle.gradients == "reduced"
        # Once a boundary backward has reduced the gradients, any further backward before the step must
        # be a boundary too (its gradients have to reach the same partitions).
        boundary = reduced or not self._in_no_sync
        carried = None
        if reduced and self.stage < 3:
            # ZeRO-1/2 rebuild the partitioned gradients from this backward alone at a second boundary;
            # keep the first boundary's and add them back (ZeRO-3 accumulates by itself).
            carried = [(p, g.detach().clone())
                       for p, g in self._grad_pieces(engine, handle.parameters, tolerant=True)]
        engine.set_gradient_accumulation_boundary(boundary)
        # scale_wrt_gas=False: the loss is a token sum; Twinkle divides by the global token count.
        engine.backward(loss, scale_wrt_gas=False)
        if carried:
            now = {id(p): g for p, g in self._grad_pieces(engine, [p for p, _ in carried], tolerant=True)}
            for p, previous in carried:
                if id(p) in now:
                    now[id(p)].add_(previous.to(now[id(p)].device, now[id(p)].dtype))
        handle.gradients = "reduced" if boundary else "accumulating"

    def _grad_pieces(self, engine: Any, parameters: list[torch.nn.Parameter], *,
                     tolerant: bool = False) -> list[tuple[Any, torch.Tensor]]:
        """This rank's share of each parameter's gradient: ``(param, tensor)``, disjoint across ranks.
        ``tolerant``: leave out parameters DeepSpeed holds no reduced gradient for."""
        pieces: list[tuple[Any, torch.Tensor]] = []
        if self.stage == 3:
            from deepspeed.utils import safe_get_local_grad

            for p in parameters:
                if not hasattr(p, "ds_id"):
                    continue
                grad = safe_get_local_grad(p)
                if grad is not None:
                    pieces.append((p, grad))
            return pieces
        for p in parameters:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:  # no fragment of this parameter is owned by this rank
                continue
            try:
                grad = mapping.get_lp_grad_fragment(p._index_in_param_group)
            except ValueError:  # "Gradients are only available immediately after backward and before step"
                if tolerant:
                    continue
                raise
            address = mapping.lp_fragment_address
            if grad.numel() == p.numel() and address.numel != p.numel():
                # a full-size accumulation buffer (bf16 optimizer): this rank owns one fragment of it
                grad = grad.view(-1).narrow(0, address.start, address.numel)
            pieces.append((p, grad))
        return pieces

    def _multiply(self, pieces: list[tuple[Any, torch.Tensor]], factor: float) -> None:
        if factor == 1.0:
            return
        if self.stage == 3:
            from deepspeed.utils import safe_set_local_grad

            for p, grad in pieces:
                safe_set_local_grad(p, grad * factor)
            return
        for _, grad in pieces:
            grad.mul_(factor)

    @staticmethod
    def _has_reduced_gradients(handle: DeepSpeedHandle) -> bool:
        """Whether ``handle``'s optimizer has reduced gradients waiting in the partitions."""
        if handle.gradients == "accumulating":
            raise ConfigError("strategy 'deepspeed': the optimizer step came before the last micro-batch of the "
                              "gradient accumulation window (gradient_accumulation_steps), so DeepSpeed has not "
                              "reduced the gradients; step after the last micro-batch (clip_grad_and_step does)")
        return handle.gradients == "reduced"

    def scale_gradients(self, module: torch.nn.Module, handle: OptimizerHandle, factor: float) -> None:
        engine = self._engine(module, create=True)
        if engine is None:
            return super().scale_gradients(module, handle, factor)
        if self._has_reduced_gradients(handle):
            self._multiply(self._grad_pieces(engine, handle.parameters), factor)

    def clip_grad_norm(self, module: torch.nn.Module, handle: OptimizerHandle, max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        engine = self._engine(module, create=True)
        if engine is None:
            return super().clip_grad_norm(module, handle, max_norm, norm_type)
        if not self._has_reduced_gradients(handle):
            return torch.zeros((), dtype=torch.float64)  # no gradients, like torch's clip_grad_norm_
        device = self.accelerator.device() if self.accelerator is not None else torch.device("cpu")
        pieces = self._grad_pieces(engine, handle.parameters)
        norm_type = float(norm_type)
        if math.isinf(norm_type):
            local = max((float(g.detach().abs().max()) for _, g in pieces if g.numel()), default=0.0)
            total = torch.tensor(local, dtype=torch.float64, device=device)
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX, group=self.dp_group)
        else:
            local = torch.zeros((), dtype=torch.float64, device=device)
            for _, g in pieces:
                local += torch.linalg.vector_norm(g.detach().to(device), norm_type, dtype=torch.float64) ** norm_type
            total = distributed.all_reduce_sum(local, group=self.dp_group) ** (1.0 / norm_type)
        total = total.cpu()
        if math.isfinite(max_norm) and math.isfinite(float(total)):
            coefficient = max_norm / (float(total) + 1e-6)
            if coefficient < 1.0:
                self._multiply(pieces, coefficient)
        return total

    def optimizer_step(self, module: torch.nn.Module, handle: OptimizerHandle) -> bool:
        engine = self._engine(module, create=True)
        if engine is None:
            return super().optimizer_step(module, handle)
        if not self._has_reduced_gradients(handle):
            return True  # this optimizer has no gradients since its last step: like torch, a no-op
        group = self._wrapper(module).optimizer_group
        if group is not None:
            group.active = handle.optimizer
        try:
            engine.set_gradient_accumulation_boundary(True)
            engine.step()
        finally:
            if group is not None:
                group.active = None
            handle.gradients = None
        return bool(engine.was_step_applied())

    def zero_grad(self, module: torch.nn.Module, handle: OptimizerHandle) -> None:
        engine = self._engine(module)
        if engine is not None and handle.gradients is not None:
            self._discard_gradients(self._wrapper(module), engine, handle)
        super().zero_grad(module, handle)

    def _discard_gradients(self, wrapped: DeepSpeedModule, engine: Any, handle: DeepSpeedHandle) -> None:
        """Drop gradients that will not be stepped (a skipped non-finite step, ``zero_grad`` without ``step``)."""
        try:
            if handle.gradients == "reduced":
                # Let DeepSpeed's step bookkeeping release the reduced gradients, with the torch optimizer's
                # update switched off, so no weight and no optimizer state moves.
                target = wrapped.optimizer_group if wrapped.optimizer_group is not None else handle.optimizer
                previous = target.__dict__.get("step", _MISSING)
                target.step = lambda *args, **kwargs: None  # an instance attribute shadows the method
                try:
                    engine.set_gradient_accumulation_boundary(True)
                    engine.step()
                finally:
                    if previous is _MISSING:
                        del target.step
                    else:
                        target.step = previous
            elif self.stage == 3:
                # Mid-accumulation: ZeRO-3's zero_grad restarts its micro-step count, so the next backward
                # overwrites the partially accumulated partitions instead of adding to them.
                engine.optimizer.zero_grad(set_to_none=True)
            else:
                # Mid-accumulation: ZeRO-1/2 keep the micro-steps' gradients in their accumulation buffers;
                # clear them the way DeepSpeed's own overflow handling in step() does.
                zero = engine.optimizer
                zero.zero_grad(set_to_none=True)
                for buffers in (getattr(zero, "averaged_gradients", {}), getattr(zero, "all_grad_tensors", {})):
                    for key in list(buffers):
                        buffers[key] = None
                if hasattr(zero, "micro_step_id"):
                    zero.micro_step_id = -1  # DeepSpeed's INITIAL_MICRO_STEP_ID: the next backward starts afresh
        finally:
            handle.gradients = None

    # ------------------------------------------------------------------ checkpoints
    def _gathered(self, params: list[torch.nn.Parameter], modifier_rank: int | None = None) -> Any:
        partitioned = [p for p in params if hasattr(p, "ds_id")]
        if not partitioned:
            return contextlib.nullcontext()
        return self.deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank)

    def _full_parameters(self, module: torch.nn.Module,
                         only: set[int] | None = None) -> dict[int, torch.Tensor]:
        """Complete copies (on CPU) of the engine's parameters, by ``id``: gathered under ZeRO-3, and the fp32
        master weights of the optimized parameters when the engine trains in bf16. ``only`` limits the ids.
        Every rank must call it (ZeRO-3 gathers)."""
        raw = self.unwrap_module(module)
        full: dict[int, torch.Tensor] = {}
        if self.stage == 3:
            for submodule in raw.modules():
                params = [p for p in submodule.parameters(recurse=False) if only is None or id(p) in only]
                if not params:
                    continue
                with self._gathered(params):
                    for p in params:
                        full[id(p)] = p.detach().to("cpu", copy=True)
        if self.bf16:
            from deepspeed.utils import safe_get_full_fp32_param

            owned = [p for p in self._wrapper(module).owned_parameters() if only is None or id(p) in only]
            with _dist.requiring_grad(owned):
                for p in owned:
                    master = safe_get_full_fp32_param(p)
                    if master is not None:
                        shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
                        full[id(p)] = master.detach().to("cpu", copy=True).view(shape)
        return full

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The complete weights, on every rank (ZeRO-3 gathers one submodule at a time)."""
        raw = self.unwrap_module(module)
        if self._engine(module) is None:
            return raw.state_dict()
        full = self._full_parameters(module)
        return {key: full.get(id(value), value.detach()) for key, value in raw.state_dict(keep_vars=True).items()}

    def load_state_dict(self, module: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                        strict: bool = True) -> None:
        """Write complete weights into the module (ZeRO-3: into its partitions) and into the fp32 master
        weights the optimizer keeps, so the next step continues from them."""
        raw = self.unwrap_module(module)
        engine = self._engine(module)
        if engine is None:
            return super().load_state_dict(module, state_dict, strict)
        expected = set(raw.state_dict(keep_vars=True))
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise KeyError(f"state dict does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
        pairs_by_module: list[list[tuple[torch.nn.Parameter, torch.Tensor]]] = []
        parameter_keys = set()
        seen: set[int] = set()
        for prefix, submodule in raw.named_modules(remove_duplicate=False):
            pairs = []
            for name, p in submodule.named_parameters(recurse=False):
                key = f"{prefix}.{name}" if prefix else name
                parameter_keys.add(key)
                if key in state_dict and id(p) not in seen:
                    seen.add(id(p))
                    pairs.append((p, state_dict[key]))
            if pairs:
                pairs_by_module.append(pairs)
        buffers = {k: v for k, v in state_dict.items() if k in expected and k not in parameter_keys}
        if buffers:
            raw.load_state_dict(buffers, strict=False)
        with torch.no_grad():
            for pairs in pairs_by_module:
                with self._gathered([p for p, _ in pairs], modifier_rank=0):
                    for p, value in pairs:
                        p.data.copy_(value.to(p.device, p.dtype).view_as(p.data))
        # The fp32 master weights are a separate copy: update them too, or the next step would write the
        # old weights back.
        from deepspeed.utils import safe_set_full_fp32_param

        owned = {id(p) for p in self._wrapper(module).owned_parameters()}
        device = self.accelerator.device() if self.accelerator is not None else torch.device("cpu")
        targets = [(p, value) for pairs in pairs_by_module for p, value in pairs if id(p) in owned]
        with _dist.requiring_grad([p for p, _ in targets]):
            for p, value in targets:
                safe_set_full_fp32_param(p, value.to(device, torch.float32))

    def _checkpoint_layout(self, module: torch.nn.Module) -> dict[str, Any]:
        wrapped = self._wrapper(module)
        return {"stage": self.stage, "dp_size": self.dp_size, "bf16": self.bf16,
                "optimizers": len(wrapped.handles), "parameters": [len(h.parameters) for h in wrapped.handles]}

    def save_optimizer_state(self, directory: str, module: torch.nn.Module, handle: OptimizerHandle) -> None:
        """``engine.save_checkpoint`` into ``directory/deepspeed`` (each rank writes its partitions)."""
        engine = self._engine(module, create=True)
        if engine is None:
            return super().save_optimizer_state(directory, module, handle)
        path = os.path.join(directory, _CHECKPOINT_SUBDIR)
        # Twinkle exports the weights itself, so DeepSpeed's module copy holds only what trains.
        engine.save_checkpoint(path, tag=_CHECKPOINT_TAG, client_state={}, save_latest=False,
                               exclude_frozen_parameters=True)
        if self.is_main_process:
            with open(os.path.join(path, _LAYOUT_FILE), "w") as fh:
                json.dump(self._checkpoint_layout(module), fh, indent=2)
        self.barrier()

    def load_optimizer_state(self, directory: str, module: torch.nn.Module, handle: OptimizerHandle) -> None:
        """``engine.load_checkpoint``: the optimizer state and fp32 master weights of this optimizer's partitions.

        The weights themselves were loaded already (``load``). When several optimizers (adapters) share the
        engine, only ``handle``'s is restored: the others' weights and optimizer states are kept as they are.
        """
        if not isinstance(module, DeepSpeedModule):
            return super().load_optimizer_state(directory, module, handle)
        path = os.path.join(directory, _CHECKPOINT_SUBDIR)
        if not os.path.isdir(os.path.join(path, _CHECKPOINT_TAG)):
            raise FileNotFoundError(f"{directory} holds no DeepSpeed optimizer state ({path}/{_CHECKPOINT_TAG}); "
                                    f"was it saved with strategy 'deepspeed'?")
        layout = None
        if os.path.isfile(os.path.join(path, _LAYOUT_FILE)):
            with open(os.path.join(path, _LAYOUT_FILE)) as fh:
                layout = json.load(fh)
        if layout is not None and layout != self._checkpoint_layout(module):
            raise ConfigError(f"the DeepSpeed optimizer state in {path} was saved with {layout}, but this model has "
                              f"{self._checkpoint_layout(module)}; resume with the same ZeRO stage, precision, "
                              f"number of ranks and optimizers (set_optimizer for the same adapters, in the same "
                              f"order)")
        engine = self._create_engine(module)
        kept = self._snapshot_others(module, engine, handle) if module.optimizer_group is not None else None
        loaded, _ = engine.load_checkpoint(path, tag=_CHECKPOINT_TAG, load_module_strict=False,
                                           load_optimizer_states=True, load_lr_scheduler_states=False,
                                           custom_load_fn=_keep_module_weights)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the optimizer state from {path}")
        if kept is not None:
            self._restore_others(module, engine, kept)

    @contextlib.contextmanager
    def _groups_populated(self, engine: Any, wrapped: DeepSpeedModule) -> Iterator[None]:
        """ZeRO-3 empties the torch optimizer's groups between steps; fill them with the fp32 partitions
        (as ZeRO-3 does around its own state_dict / load_state_dict) while a member's state is read or set."""
        zero = engine.optimizer
        if self.stage != 3:
            yield
            return
        zero._set_fp32_optimizer_param_groups()
        try:
            yield
        finally:
            if wrapped.optimizer_group is not None:
                wrapped.optimizer_group._refresh_groups()
            zero._clear_fp32_optimizer_param_groups()

    def _snapshot_others(self, module: torch.nn.Module, engine: Any, handle: OptimizerHandle) -> Any:
        import copy

        wrapped = self._wrapper(module)
        others = [other for other in wrapped.handles if other is not handle]
        params = [p for other in others for p in other.parameters]
        names = {id(p): name for name, p in self.unwrap_module(module).named_parameters()}
        full = self._full_parameters(module, only={id(p) for p in params})
        weights = {names[id(p)]: full[id(p)] if id(p) in full else p.detach().to("cpu", copy=True)
                   for p in params if id(p) in names}
        with self._groups_populated(engine, wrapped):
            states = [(o.optimizer, copy.deepcopy(o.optimizer.state_dict())) for o in others]
        return weights, states

    def _restore_others(self, module: torch.nn.Module, engine: Any, kept: Any) -> None:
        weights, states = kept
        wrapped = self._wrapper(module)
        with self._groups_populated(engine, wrapped):
            for o, state in states:
                o.load_state_dict(state)
            wrapped.optimizer_group._refresh_groups()
        self.load_state_dict(module, weights, strict=False)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "bf16": self.bf16,
                "deepspeed_version": getattr(getattr(self, "deepspeed", None), "__version__", None)}


def _keep_module_weights(src: Any = None, dst: Any = None) -> None:
    """``custom_load_fn`` for ``engine.load_checkpoint``: Twinkle has loaded the weights already."""
