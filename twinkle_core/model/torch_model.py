"""The ``TwinkleModel`` contract implemented once for any ``torch.nn.Module``.

Backends subclass :class:`TorchTwinkleModel` and supply only what differs between them: how the
network is built, run, given adapters, and written to / read from disk. Strategy (parallelism)
and precision are plugins chosen by name, so no backend repeats the training-state machinery.

Gradient normalisation: every loss returns a *sum* and the number of units it summed over. The
sums are back-propagated as they come, divided by one constant per accumulation window (the
first micro-batch's global token count per rank, so gradients keep mean-loss magnitude); before
clipping or stepping, the gradients are multiplied once by that constant times
``strategy.gradient_scale(global_tokens)``, where ``global_tokens`` is the token count of all
accumulated micro-batches summed over the data-parallel ranks. That is what makes 4
micro-batches of 2 give the same update as one batch of 8.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
from abc import abstractmethod
from collections.abc import Iterator
from typing import Any

import torch

from twinkle_core import checkpoint
from twinkle_core.accelerator import current_accelerator
from twinkle_core.capabilities import check_compatible
from twinkle_core.errors import ConfigError
from twinkle_core.kernels import KernelSwitch, apply_kernels
from twinkle_core.loss.base import CallableLoss, Loss, LossOutput, accepts_context
from twinkle_core.mesh import DeviceMesh, default_strategy, merge_spec_sizes, pop_spec_sizes, suggest_spec_key
from twinkle_core.metrics import LossMetric, Metric
from twinkle_core.model import frozen, lm_head
from twinkle_core.model.base import TwinkleModel
from twinkle_core.model.data_parallel import DataParallelView
from twinkle_core.model.frozen import trains
from twinkle_core.model.step_context import StepContext
from twinkle_core.model.train_state import TrainState
from twinkle_core.names import validate_name
from twinkle_core.optim import build_optimizer, build_scheduler
from twinkle_core.plugins import get_plugins
from twinkle_core.precision import Precision
from twinkle_core.sampling import GenerationModule
from twinkle_core.strategy import OptimizerHandle, Strategy
from twinkle_core.task import default_loss_name

FULL_MODEL = ""  # the TrainState key of full fine-tuning (no adapter)


def _tp_sequence_parallel(strategy_cls: type, strategy: Any, options: dict[str, Any] | None,
                          flag: bool) -> dict[str, Any] | None:
    """``sequence_parallel=True/False`` (not a size): the strategy's own ``sequence_parallel`` option where it has
    one (Megatron: sequence parallelism inside tensor-parallel regions); elsewhere a size is needed."""
    name = strategy if isinstance(strategy, str) else getattr(strategy, "name", type(strategy).__name__)
    if "sequence_parallel" in inspect.signature(strategy_cls.__init__).parameters:
        if not isinstance(strategy, str):
            raise ConfigError("sequence_parallel= with a strategy instance: set it on the strategy itself")
        options = dict(options or {})
        if options.get("sequence_parallel", flag) != flag:
            raise ConfigError(f"sequence_parallel={flag} contradicts strategy_options['sequence_parallel']="
                              f"{options['sequence_parallel']}; give one")
        options["sequence_parallel"] = flag
        return options
    if flag:
        raise ConfigError(f"sequence_parallel=True: strategy {name!r} takes the sequence-parallel size, the number "
                          f"of ranks each sequence is split over (sequence_parallel=2 is mesh sp=2, run by the "
                          f"'ulysses' strategy)")
    return options


class TorchTwinkleModel(TwinkleModel):
    """Generic torch implementation. Subclasses implement the ``_`` hooks at the bottom."""

    #: batch keys passed to the network; everything else (labels, advantages ...) is for the loss
    model_input_keys: tuple[str, ...] = ("input_ids", "attention_mask", "position_ids")

    def __new__(cls, *args: Any, **kwargs: Any) -> TorchTwinkleModel:
        self = super().__new__(cls)
        # what the caller built the model from, so that frozen_copy() can build it again (every backend's
        # constructor is keyword-only; a subclass's own options are included without it doing anything)
        self.init_arguments = dict(kwargs)
        return self

    def __init__(self, *, strategy: str | Strategy | None = None, strategy_options: dict[str, Any] | None = None,
                 mesh: DeviceMesh | dict[str, int] | None = None, precision: str | Precision = "no",
                 task: Any = None, tokenizer: Any = None, seed: int = 42, kernels: KernelSwitch = None,
                 **unused: Any) -> None:
        # the spec's names (tp_size=2, pp_size, dp_size, ep_size, sequence_parallel=N, ...) are the mesh's sizes
        sizes, tp_sequence_parallel = pop_spec_sizes(unused)
        if unused:
            hints = [f"{key} (did you mean {suggest_spec_key(key)}?)" if suggest_spec_key(key) else key
                     for key in sorted(unused)]
            raise ConfigError(f"{type(self).__name__} got unknown option(s) {', '.join(hints)}")
        mesh = merge_spec_sizes(mesh, sizes)
        plugins = get_plugins()
        if isinstance(mesh, dict):
            mesh = DeviceMesh(**mesh)
        if strategy is None:  # the one default rule: twinkle_core.mesh.default_strategy
            strategy = default_strategy(type(self))
        strategy_cls = plugins.load("strategy", strategy) if isinstance(strategy, str) else type(strategy)
        if tp_sequence_parallel is not None:
            strategy_options = _tp_sequence_parallel(strategy_cls, strategy, strategy_options, tp_sequence_parallel)
        check_compatible(type(self), strategy_cls, mesh if mesh is not None else getattr(strategy, "mesh", None),
                         strategy_name=strategy if isinstance(strategy, str) else strategy.name)
        self.accelerator = current_accelerator()
        self.precision = plugins.load("precision", precision)() if isinstance(precision, str) else precision
        self.precision.check_supported(self.accelerator)
        if isinstance(strategy, str):
            strategy = strategy_cls(mesh=mesh, precision=self.precision, **(strategy_options or {}))
        else:
            strategy.bind_precision(self.precision)
        self.strategy = strategy
        self.strategy.setup(self.accelerator)
        self.loss_context = self.strategy.loss_context()
        self.device = self.accelerator.device()
        self.task = task
        self.tokenizer = tokenizer
        self.seed = seed
        torch.manual_seed(seed)  # identical initial weights on every rank
        module = self.build_network()
        # fused kernels registered for this accelerator (twinkle_core.kernels); ``kernels`` turns them off
        self.kernels = kernels
        self.applied_kernels = apply_kernels(module, self.accelerator.name, kernels)
        self.module = self.precision.prepare_module(module).to(self.device)
        self._wrapped: torch.nn.Module | None = None
        self._parameter_cache: dict[str, list[torch.nn.Parameter]] = {}
        self._states: dict[str, TrainState] = {FULL_MODEL: self._new_state(FULL_MODEL)}
        self._adapters: dict[str, Any] = {}
        self._lm_head_of: tuple[Any, ...] | None = None  # what output_layer() was last asked about, and its answer
        self._lm_head_found: torch.nn.Linear | None = None
        #: True on a model made by frozen_copy(): it only evaluates
        self.frozen = False

    # ================================================================== backend hooks
    @abstractmethod
    def build_network(self) -> torch.nn.Module:
        """Build the network on CPU (weights initialised or loaded)."""

    def run_network(self, module: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """Run the network on the model's inputs; return at least ``logits``."""
        out = module(**{k: v for k, v in inputs.items() if k in self.model_input_keys})
        return dict(out) if not isinstance(out, dict) else out

    def attach_adapter(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        raise ConfigError(f"{type(self).__name__} does not support adapters")

    def detach_adapter(self, adapter_name: str) -> None:
        raise ConfigError(f"{type(self).__name__} does not support removing adapters")

    def activate_adapter(self, adapter_name: str | None) -> contextlib.AbstractContextManager[Any]:
        """Make ``adapter_name`` (``None``: no adapter) the active one for the next forward."""
        return contextlib.nullcontext()

    def deactivate_adapters(self) -> contextlib.AbstractContextManager[Any]:
        """Switch every adapter off for the next forward (the base model), and back on afterwards, also when
        the forward raises. Backends with adapters implement it; the default refuses rather than run an
        adapter while the caller asked for the base model."""
        raise ConfigError(f"{type(self).__name__} cannot switch its adapters off: forward_only(disable_adapters=True) "
                          f"is not supported by this model class")

    def local_weights(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``get_state_dict()``'s weights keyed (and cut) the way ``strategy.load_state_dict`` takes them."""
        return state_dict

    def adapter_parameter_names(self, adapter_name: str) -> list[str]:
        """Names (in ``self.module.named_parameters()``) of the adapter's trainable weights."""
        raise ConfigError(f"{type(self).__name__} does not support adapters")

    @abstractmethod
    def write_weights(self, directory: str, state_dict: dict[str, torch.Tensor], adapter_name: str | None) -> None:
        """Write ``state_dict`` (model or adapter weights, full names) in the backend's public format."""

    @abstractmethod
    def read_weights(self, directory: str, adapter_name: str | None) -> dict[str, torch.Tensor]:
        """Read weights written by ``write_weights`` back as a state dict keyed like ``self.module``."""

    def describe(self) -> dict[str, Any]:
        return {"class": type(self).__name__}

    # ================================================================== helpers
    def _new_state(self, name: str) -> TrainState:
        state = TrainState(name=name)
        state.metrics.append(LossMetric())
        return state

    def _resolve_name(self, adapter_name: str | None) -> str:
        if adapter_name is not None:
            if adapter_name not in self._adapters:
                raise ConfigError(f"no adapter named {adapter_name!r}; adapters: {sorted(self._adapters) or 'none'}"
                                  f" (add one with add_adapter_to_model)")
            return adapter_name
        if len(self._adapters) == 1:
            return next(iter(self._adapters))
        if len(self._adapters) > 1:
            raise ConfigError(f"the model has several adapters {sorted(self._adapters)}; pass adapter_name=")
        return FULL_MODEL

    def _state(self, adapter_name: str | None) -> TrainState:
        return self._states[self._resolve_name(adapter_name)]

    def train_state(self, adapter_name: str | None = None) -> TrainState:
        """The training state of ``adapter_name`` (``None``: the only adapter, or the full model)."""
        return self._states[self._resolve_name(adapter_name)]

    def step_context(self, adapter_name: str | None = None, *, disable_adapters: bool = False) -> StepContext:
        """What a backend whose schedule fuses forward and backward (Megatron's pipeline) needs of one step:
        the adapter's state, its loss (the task's default when none was set), the device and the adapter scope."""
        state = self.train_state(adapter_name)
        return StepContext(state=state, device=self.device, ensure_loss=self._ensure_loss,
                           enter_adapter=lambda: self._adapter_scope(adapter_name, disable_adapters))

    def trainable_parameters(self, *, adapter_name: str | None = None) -> list[torch.nn.Parameter]:
        _ = self.wrapped  # parameters are final only once the strategy has wrapped (sharded) the module
        return self._parameters(self._resolve_name(adapter_name))

    def _parameters(self, name: str) -> list[torch.nn.Parameter]:
        # cached: walking every parameter name costs milliseconds per call on PEFT models, three calls a
        # step; the cache is dropped whenever the parameter set can change (adapters, wrapping, optimizers)
        cached = self._parameter_cache.get(name)
        if cached is None:
            if name == FULL_MODEL:
                cached = [p for p in self.module.parameters() if p.requires_grad]
            else:
                wanted = set(self.adapter_parameter_names(name))
                cached = [p for n, p in self.module.named_parameters() if n in wanted]
            self._parameter_cache[name] = cached
        return cached

    @property
    def data_parallel(self) -> DataParallelView:
        return DataParallelView(self.strategy.dp_rank, self.strategy.dp_size, self.strategy.dp_group)

    @property
    def wrapped(self) -> torch.nn.Module:
        """The module as the strategy runs it (wrapped on first use, so adapters can be added first)."""
        if self._wrapped is None:
            self._wrapped = self.strategy.wrap_module(self.module)
            self._parameter_cache.clear()
        return self._wrapped

    def _to_device(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def _adapter_scope(self, adapter_name: str | None,
                       disable_adapters: bool = False) -> contextlib.AbstractContextManager[Any]:
        """The adapter context of a forward: ``adapter_name``'s adapter, or with ``disable_adapters`` none."""
        name = self._resolve_name(adapter_name)
        if disable_adapters and self._adapters:
            return self.deactivate_adapters()
        return self.activate_adapter(name or None)

    def _compute(self, inputs: dict[str, Any], adapter_name: str | None,
                 disable_adapters: bool = False, fused_head: torch.nn.Linear | None = None) -> dict[str, Any]:
        with self._adapter_scope(adapter_name, disable_adapters), self.strategy.forward_context(self.device.type):
            if fused_head is None:
                outputs = self.run_network(self.wrapped, inputs)
            else:
                with lm_head.deferred(fused_head) as head_inputs:
                    outputs = self.run_network(self.wrapped, inputs)
                outputs = {**{k: v for k, v in outputs.items() if k != "logits"}, **head_inputs}
            return self.task.process_outputs(outputs, inputs) if self.task is not None else outputs

    def output_layer(self) -> torch.nn.Linear | None:
        """The network's output layer, when the backend knows the logits are exactly this plain linear layer
        applied to the final hidden states (no soft-capping or scaling after it); ``None`` otherwise."""
        return None

    def _fused_lm_head(self, state: TrainState) -> torch.nn.Linear | None:
        """The LM head to hand to a loss that applies it itself (``Loss.fuses_lm_head``), or ``None``."""
        self._ensure_loss(state)
        asked = (id(self.module), tuple(self._adapters))  # adapters (PEFT's wrapper, a LoRA-targeted head) change it
        if asked != self._lm_head_of:
            self._lm_head_of, self._lm_head_found = asked, self.output_layer()
        head = self._lm_head_found
        fuses = getattr(state.loss, "fuses_lm_head", None)
        if head is None or fuses is None or not fuses(head.out_features):
            return None
        # a sharding strategy gathers the head's weight only inside its forward; a task or metric may read logits
        readers = [self.task, *state.metrics]
        if self.strategy.forward_is_collective or any(getattr(r, "reads_logits", True) for r in readers if r):
            return None
        return head

    # ================================================================== compute
    @trains
    def forward(self, *, inputs: dict[str, Any], adapter_name: str | None = None, **kwargs: Any) -> dict[str, Any]:
        return self._forward(inputs, adapter_name, fuse_lm_head=False)

    def _forward(self, inputs: dict[str, Any], adapter_name: str | None, *, fuse_lm_head: bool) -> dict[str, Any]:
        state = self._state(adapter_name)
        inputs = self._to_device(self.strategy.prepare_inputs(dict(inputs)))
        if not self.wrapped.training:
            self.wrapped.train()
        head = self._fused_lm_head(state) if fuse_lm_head else None
        with self._sync_context(state):  # DDP decides at forward time whether backward all-reduces
            outputs = self._compute(inputs, adapter_name, fused_head=head)
        state.last_inputs, state.last_outputs = inputs, outputs
        return outputs

    @contextlib.contextmanager
    def generation_module(self, *, adapter_name: str | None = None) -> Iterator[GenerationModule]:
        self._state(adapter_name)
        target = self._generation_target()
        was_training = target.training
        target.eval()
        try:
            with torch.no_grad(), self._adapter_scope(adapter_name), self.strategy.forward_context(self.device.type):
                yield GenerationModule(module=target, device=self.device, lockstep=self.strategy.forward_is_collective)
        finally:
            target.train(was_training)

    def _generation_target(self) -> torch.nn.Module:
        """The module a sampler calls: the strategy's unwrapped network (a DDP wrapper's forward would
        synchronise buffers on every decoding step; a fully sharded module gathers its own weights)."""
        return self.strategy.unwrap_module(self.wrapped)

    def _sync_context(self, state: TrainState) -> contextlib.AbstractContextManager[Any]:
        """Skip gradient synchronisation on all but the last micro-batch of an accumulation window."""
        last = (state.backward_calls + 1) % state.gradient_accumulation_steps == 0
        return contextlib.nullcontext() if last else self.strategy.no_sync(self.wrapped)

    def forward_only(self, *, inputs: dict[str, Any], adapter_name: str | None = None,
                     disable_adapters: bool = False, **kwargs: Any) -> dict[str, Any]:
        self._state(adapter_name)
        inputs = self._to_device(self.strategy.prepare_inputs(dict(inputs)))
        module = self.wrapped
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                return self._compute(inputs, adapter_name, disable_adapters)
        finally:
            module.train(was_training)

    def calculate_loss(self, *, inputs: dict[str, Any] | None = None, outputs: dict[str, Any] | None = None,
                       adapter_name: str | None = None, **kwargs: Any) -> LossOutput:
        state = self._state(adapter_name)
        inputs = state.last_inputs if inputs is None else self._to_device(inputs)
        outputs = state.last_outputs if outputs is None else outputs
        if inputs is None or outputs is None:
            raise ConfigError("calculate_loss needs outputs: call forward(inputs=...) first or pass outputs=")
        self._ensure_loss(state)
        result = state.apply_loss(outputs, inputs, self.loss_context)
        state.last_loss = result
        return result

    def _ensure_loss(self, state: TrainState) -> None:
        """Set the task's default loss when none was set (the one place that rule lives)."""
        if state.loss is None:
            self.set_loss(default_loss_name(self.task), adapter_name=state.name or None)

    @trains
    def backward(self, *, loss: Any = None, adapter_name: str | None = None, **kwargs: Any) -> None:
        state = self._state(adapter_name)
        loss = state.last_loss if loss is None else loss
        if loss is None:
            raise ConfigError("backward needs a loss: call calculate_loss first or pass loss=")
        if not isinstance(loss, LossOutput):
            loss = LossOutput(loss=loss, num_tokens=1)
        state.open_window(float(loss.num_tokens), self.strategy, self.device)
        with self._sync_context(state):
            self.strategy.backward(self.strategy.scale_loss(state.scale_for_backward(loss.loss)), self.wrapped,
                                   state.handle)
        state.record_backward(loss.num_tokens)

    @trains
    def forward_backward(self, *, inputs: dict[str, Any], adapter_name: str | None = None,
                         **kwargs: Any) -> dict[str, Any]:
        outputs = self._forward(inputs, adapter_name, fuse_lm_head=True)
        loss = self.calculate_loss(adapter_name=adapter_name)
        self.backward(loss=loss, adapter_name=adapter_name)
        return {**outputs, "loss": loss.mean.detach(), "num_tokens": loss.num_tokens, **loss.metrics}

    # ================================================================== optimisation
    def _require_optimizer(self, state: TrainState, action: str) -> OptimizerHandle:
        if state.handle is None:
            who = f"adapter_name={state.name!r}" if state.name else "the model"
            raise ConfigError(f"{action} needs an optimizer for {who}: call set_optimizer('AdamW', lr=...) first")
        return state.handle

    def _normalise_gradients(self, state: TrainState) -> None:
        if state.gradients_normalised:
            return
        handle = self._require_optimizer(state, "step")
        tokens = self.strategy.global_sum(torch.tensor(state.pending_tokens, dtype=torch.float64,
                                                       device=self.device))
        self.strategy.unscale_gradients(handle)
        self.strategy.scale_gradients(self.wrapped, handle,
                                      self.strategy.gradient_scale(float(tokens)) * state.loss_divisor)
        state.gradients_normalised = True

    @trains
    def clip_grad_norm(self, max_grad_norm: float = 1.0, norm_type: float = 2.0, *,
                       adapter_name: str | None = None) -> float:
        state = self._state(adapter_name)
        self._normalise_gradients(state)
        limit = math.inf if max_grad_norm is None else float(max_grad_norm)
        norm = self.strategy.clip_grad_norm(self.wrapped, state.handle, limit, norm_type)
        state.last_grad_norm = float(norm)
        return state.last_grad_norm

    @trains
    def step(self, *, adapter_name: str | None = None) -> None:
        state = self._state(adapter_name)
        handle = self._require_optimizer(state, "step")
        self._normalise_gradients(state)
        if state.last_grad_norm is not None and not math.isfinite(state.last_grad_norm):
            # A NaN/inf gradient would poison the weights: skip the update, keep training.
            state.skipped_steps += 1
        elif not self.strategy.optimizer_step(self.wrapped, handle):
            state.skipped_steps += 1
        state.step += 1

    @trains
    def zero_grad(self, *, adapter_name: str | None = None) -> None:
        state = self._state(adapter_name)
        if state.handle is not None:
            self.strategy.zero_grad(self.wrapped, state.handle)
        else:  # gradients back-propagated before any optimizer existed
            for p in self._parameters(state.name):
                p.grad = None
        state.reset_accumulation()

    @trains
    def lr_step(self, *, adapter_name: str | None = None) -> None:
        state = self._state(adapter_name)
        if state.scheduler is not None:
            state.scheduler.step()

    @trains
    def clip_grad_and_step(self, max_grad_norm: float | None = 1.0, norm_type: float = 2.0, *,
                           adapter_name: str | None = None) -> float | None:
        state = self._state(adapter_name)
        state.accumulated_calls += 1
        if state.accumulated_calls < state.gradient_accumulation_steps:
            return None
        state.accumulated_calls = 0
        norm = self.clip_grad_norm(max_grad_norm, norm_type, adapter_name=adapter_name)
        self.step(adapter_name=adapter_name)
        self.zero_grad(adapter_name=adapter_name)
        self.lr_step(adapter_name=adapter_name)
        return norm

    # ================================================================== configuration
    def set_loss(self, loss: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        state = self._state(adapter_name)
        if isinstance(loss, str):
            state.loss_spec = {"name": loss, **kwargs}
            loss = get_plugins().load("loss", loss)
        else:
            state.loss_spec = {"name": getattr(loss, "name", None) or repr(loss), **kwargs}
        if inspect.isclass(loss) and issubclass(loss, Loss):
            loss = loss(**kwargs)
        elif kwargs:
            raise ConfigError(f"set_loss got options {sorted(kwargs)} with an instance or callable; "
                              f"pass a loss name or class to configure it")
        if not isinstance(loss, Loss) or not accepts_context(loss):
            if not callable(loss):
                raise ConfigError(f"cannot use {loss!r} as a loss: pass a registered name, a Loss class, "
                                  f"an instance or a callable")
            loss = CallableLoss(loss)  # also adapts losses written before ``context=`` existed
        state.loss = loss

    @trains
    def set_optimizer(self, optimizer: Any, *, adapter_name: str | None = None,
                      gradient_accumulation_steps: int = 1, **kwargs: Any) -> None:
        state = self._state(adapter_name)
        if gradient_accumulation_steps < 1:
            raise ConfigError("gradient_accumulation_steps must be >= 1")
        module = self.wrapped
        parameters = self._parameters(state.name)
        built = build_optimizer(optimizer, parameters, accelerator=self.accelerator.name, kernels=self.kernels,
                                **kwargs)
        wrapped, handle = self.strategy.prepare_optimizer(
            module, built, parameters=parameters, gradient_accumulation_steps=gradient_accumulation_steps)
        self._wrapped = wrapped
        self._parameter_cache.clear()
        state.handle = handle
        state.gradient_accumulation_steps = gradient_accumulation_steps
        state.optimizer_spec = {"name": optimizer if isinstance(optimizer, str) else type(handle.optimizer).__name__,
                                **{k: v for k, v in kwargs.items() if isinstance(v, (int, float, str, bool))}}

    @trains
    def set_lr_scheduler(self, scheduler: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        state = self._state(adapter_name)
        handle = self._require_optimizer(state, "set_lr_scheduler")
        state.scheduler = build_scheduler(scheduler, handle.optimizer, **kwargs)
        state.scheduler_spec = {"name": scheduler if isinstance(scheduler, str) else type(state.scheduler).__name__,
                                **{k: v for k, v in kwargs.items() if isinstance(v, (int, float, str, bool))}}

    @trains
    def add_adapter_to_model(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        validate_name("adapter name", adapter_name)
        if adapter_name in self._adapters:
            raise ConfigError(f"adapter name {adapter_name!r} is already in use")
        if hasattr(torch.nn.Module, adapter_name):  # PEFT keeps each adapter as a module attribute of that name
            raise ConfigError(f"adapter name {adapter_name!r} is the name of a torch.nn.Module attribute, which "
                              f"PEFT cannot use for an adapter; choose another (e.g. 'tenant_{adapter_name}')")
        if self._wrapped is not None and self._wrapped is not self.module:
            raise ConfigError("add adapters before the first forward or set_optimizer: the strategy has already "
                              "wrapped the model")
        self._parameter_cache.clear()
        self.attach_adapter(adapter_name, config, **kwargs)
        if self._wrapped is not None and self._wrapped is not self.module:
            # the strategy's wrapping was the module itself (save() or get_state_dict() asked for it, nothing ran
            # yet): it is redone around the module with its new adapter on first use
            self._wrapped = None
        self._adapters[adapter_name] = config
        self._states[adapter_name] = self._new_state(adapter_name)

    def remove_adapter(self, adapter_name: str) -> None:
        self._resolve_name(adapter_name)
        self.detach_adapter(adapter_name)
        self._parameter_cache.clear()
        del self._adapters[adapter_name]
        del self._states[adapter_name]

    # ================================================================== metrics
    def add_metric(self, metric: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        state = self._state(adapter_name)
        if isinstance(metric, str):
            metric = get_plugins().load("metric", metric)
        if inspect.isclass(metric):
            metric = metric(**kwargs)
        if not isinstance(metric, Metric):
            raise ConfigError(f"cannot use {metric!r} as a metric: pass a registered name, a Metric class or instance")
        state.metrics.append(metric)

    def calculate_metric(self, *, adapter_name: str | None = None, reset: bool = True) -> dict[str, float]:
        state = self._state(adapter_name)
        keys, values = [], []
        for i, metric in enumerate(state.metrics):
            for key, value in metric.totals().items():
                keys.append((i, key))
                values.append(value)
        summed = self.strategy.global_sum(torch.tensor(values, dtype=torch.float64, device=self.device)).tolist()
        per_metric: list[dict[str, float]] = [{} for _ in state.metrics]
        for (i, key), value in zip(keys, summed):
            per_metric[i][key] = value
        result: dict[str, float] = {}
        for metric, totals in zip(state.metrics, per_metric):
            result.update(metric.compute(totals))
            if reset:
                metric.reset()
        if state.optimizer is not None:
            result["lr"] = self._current_lr(state)
        result["step"] = state.step
        return result

    @staticmethod
    def _current_lr(state: TrainState) -> float | None:
        return float(state.optimizer.param_groups[0]["lr"]) if state.optimizer is not None else None

    def get_train_configs(self, *, adapter_name: str | None = None) -> dict[str, Any]:
        several = adapter_name is None and len(self._adapters) > 1
        state = self._states[FULL_MODEL] if several else self._state(adapter_name)
        return {
            **self.describe(),
            "adapter_name": state.name or None,
            "adapter_config": self._adapters.get(state.name),
            "adapters": sorted(self._adapters),
            "strategy": self.strategy.describe(),
            "precision": self.precision.name,
            "accelerator": self.accelerator.name,
            "optimizer": state.optimizer_spec or None,
            "lr_scheduler": state.scheduler_spec or None,
            "lr": self._current_lr(state),
            "loss": state.loss_spec or None,
            "gradient_accumulation_steps": state.gradient_accumulation_steps,
            "metrics": [type(m).__name__ for m in state.metrics],
            "dp_rank": self.strategy.dp_rank,
            "dp_size": self.strategy.dp_size,
            # partitioned (ZeRO-3) parameters report their full size as ds_numel
            "trainable_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in self._parameters(state.name)),
            **state.counters(),
        }

    # ================================================================== state
    def frozen_copy(self) -> TorchTwinkleModel:
        return frozen.frozen_copy(self)

    def sibling(self, *, task: Any, **overrides: Any) -> TorchTwinkleModel:
        kwargs = frozen.rebuild_arguments(self)
        # its own precision object: a trainable model scales its own loss (fp16)
        kwargs["precision"] = self.precision.name  # by name: a Precision instance may hold a loss scaler
        kwargs.update(task=task, **overrides)
        return type(self)(**kwargs)

    def get_state_dict(self, *, adapter_name: str | None = None) -> dict[str, Any]:
        name = self._resolve_name(adapter_name)
        full = self.strategy.full_state_dict(self.wrapped)
        if name == FULL_MODEL:
            return full
        wanted = set(self.adapter_parameter_names(name))
        return {k: v for k, v in full.items() if k in wanted}

    def save(self, name: str, *, output_dir: str, adapter_name: str | None = None, save_optimizer: bool = True,
             extra_state: dict[str, Any] | None = None) -> str:
        if self.frozen and save_optimizer:
            raise frozen.refusal(self, "save(save_optimizer=True)")
        state = self._state(adapter_name)
        final = os.path.join(output_dir, validate_name("checkpoint name", name, allow_dots=True))
        weights = self.get_state_dict(adapter_name=adapter_name)
        is_main = self.strategy.is_main_process
        with checkpoint.atomic_directory(final, is_main=is_main,
                                         metadata={"adapter_name": state.name or None, "step": state.step}) as tmp:
            if is_main:
                self.write_weights(tmp, weights, state.name or None)
                if self.task is not None:
                    self.task.on_export(self, tmp, state.name or None)
            if save_optimizer and state.optimizer is not None:
                self._save_training_state(tmp, state, extra_state)
                if self.task is not None:
                    self.task.save_training_state(self, tmp)
        return final

    def _save_training_state(self, directory: str, state: TrainState, extra_state: dict[str, Any] | None) -> None:
        from twinkle_core import distributed

        state_dir = os.path.join(directory, checkpoint.STATE_DIR)
        rank = distributed.rank()
        if self.strategy.is_main_process:
            os.makedirs(state_dir, exist_ok=True)
        self.strategy.barrier()
        self.strategy.save_optimizer_state(state_dir, self.wrapped, state.handle)
        torch.save(checkpoint.capture_rng_state(), os.path.join(state_dir, f"rng-rank{rank}.pt"))
        if self.strategy.is_main_process:
            torch.save({
                "counters": state.counters(),
                "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
                "precision": self.precision.state_dict(),
                "extra_state": extra_state or {},
                # ranks 0 .. rng_ranks-1 wrote rng-rank{R}.pt: resume can tell a deleted file from one never written
                "rng_ranks": distributed.world_size(),
                # JSON-safe (an adapter config becomes its repr) so the file loads with weights_only=True
                "configs": json.loads(json.dumps(self.get_train_configs(adapter_name=state.name or None),
                                                 default=str)),
            }, os.path.join(state_dir, "trainer_state.pt"))

    def load(self, path: str, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        name = self._resolve_name(adapter_name)
        weights = self.read_weights(path, name or None)
        self.strategy.load_state_dict(self.wrapped, weights, strict=name == FULL_MODEL)

    @trains
    def resume_from_checkpoint(self, path: str, *, adapter_name: str | None = None) -> dict[str, Any]:
        from twinkle_core import distributed

        if not checkpoint.is_complete(path):
            raise FileNotFoundError(f"{path} is not a complete Twinkle checkpoint (no {checkpoint.MARKER})")
        checkpoint.verify_on_main(path, self.strategy.is_main_process)
        state = self._state(adapter_name)
        handle = self._require_optimizer(state, "resume_from_checkpoint")
        state_dir = os.path.join(path, checkpoint.STATE_DIR)
        trainer = checkpoint.load_state_file(os.path.join(state_dir, "trainer_state.pt"))
        rank = distributed.rank()
        rng_path = os.path.join(state_dir, f"rng-rank{rank}.pt")
        # older checkpoints lack rng_ranks: then any other rank's RNG file shows this one was written too
        saved_rng = trainer.get("rng_ranks")
        written = rank < saved_rng if saved_rng is not None else any(
            n.startswith("rng-rank") for n in os.listdir(state_dir))
        if written and not os.path.isfile(rng_path):
            raise checkpoint.CheckpointError(f"checkpoint file {rng_path} is missing (it was written at save time)")
        self.load(path, adapter_name=adapter_name)
        self.strategy.load_optimizer_state(state_dir, self.wrapped, handle)
        if trainer["scheduler"] is not None and state.scheduler is not None:
            state.scheduler.load_state_dict(trainer["scheduler"])
        self.precision.load_state_dict(trainer["precision"])
        state.load_counters(trainer["counters"])
        state.reset_accumulation()
        if self.task is not None:
            self.task.load_training_state(self, path)
        if written:  # last: loading the task's state must not move the RNG streams of the resumed run
            checkpoint.restore_rng_state(checkpoint.load_state_file(rng_path))
        return trainer["extra_state"]
