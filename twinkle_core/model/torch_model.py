"""The ``TwinkleModel`` contract implemented once for any ``torch.nn.Module``.

Backends subclass :class:`TorchTwinkleModel` and supply only what differs between them: the public
*backend extension* methods (build the network, run it, give it adapters, write / read its weights,
describe it), listed by phase below with who calls each and when. Strategy (parallelism) and precision
are plugins chosen by name, so no backend repeats the training-state machinery. A backend whose schedule
fuses forward and backward (Megatron's pipeline) takes one step's state, loss, device and adapter scope
from :meth:`TorchTwinkleModel.step_context`.

The backend extension, by phase (the generic model calls these; nothing else should)::

    build    build_network()             once, in the constructor, after capabilities are checked and the
                                         strategy is set up; kernels and precision are applied to its result
             describe()                  by get_train_configs() (logs, checkpoints' trainer_state.pt)
    run      run_network(module, inputs) on every forward (forward, forward_backward, forward_only), under
                                         the adapter scope and the strategy's forward context
             output_layer()              once per adapter set, when a loss may apply the LM head itself
    adapters adapter_config_for(config)  by add_adapter_to_model, before and after Task.adapter_config
             attach_adapter / detach_adapter   by add_adapter_to_model / remove_adapter
             activate_adapter(name) / deactivate_adapters()  around every forward (adapter scope)
             adapter_parameter_names(name)     when an adapter's parameters or weights are selected
    weights  write_weights / read_weights      by save() (main process) / load() and resume_from_checkpoint()
             local_weights(state_dict)         by frozen_copy(), before strategy.load_state_dict
    export   network (property)          the unwrapped network, for tasks (prepare_model, on_export)

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
from abc import abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from twinkle_core import checkpoint
from twinkle_core.errors import ConfigError
from twinkle_core.kernels import KernelSwitch, apply_kernels
from twinkle_core.loss.base import LossOutput
from twinkle_core.mesh import DeviceMesh
from twinkle_core.model import checkpoint_io, frozen, lm_head, metric_totals
from twinkle_core.model.adapter_states import FULL_MODEL, AdapterStates, parameters_of
from twinkle_core.model.base import TwinkleModel
from twinkle_core.model.data_parallel import DataParallelView
from twinkle_core.model.frozen import trains
from twinkle_core.model.loss_setup import build_loss
from twinkle_core.model.runtime import build_runtime, check_spec
from twinkle_core.model.step_context import StepContext
from twinkle_core.model.train_configs import describe_training
from twinkle_core.model.train_state import TrainState
from twinkle_core.optim import build_optimizer, build_scheduler
from twinkle_core.options import accepted_options
from twinkle_core.precision import Precision
from twinkle_core.sampling import GenerationModule
from twinkle_core.strategy import Strategy
from twinkle_core.task import default_loss_name


class TorchTwinkleModel(TwinkleModel):
    """Generic torch implementation; a backend overrides the *backend extension* methods below."""

    #: batch keys passed to the network (the task's ``model_inputs`` are added); the rest is for the loss
    model_input_keys: tuple[str, ...] = ("input_ids", "attention_mask", "position_ids")

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """What the constructor's ``**spec`` would receive (the options no ``__init__`` of the class names) is
        checked as the constructor checks it (:func:`~twinkle_core.model.runtime.check_spec`)."""
        named = accepted_options(cls).names
        check_spec(cls, {key: value for key, value in options.items() if key not in named})

    def __new__(cls, *args: Any, **kwargs: Any) -> TorchTwinkleModel:
        self = super().__new__(cls)
        # what the caller built the model from, so that frozen_copy() can build it again (every backend's
        # constructor is keyword-only; a subclass's own options are included without it doing anything)
        self.init_arguments = dict(kwargs)
        return self

    def __init__(self, *, strategy: str | Strategy | None = None, strategy_options: dict[str, Any] | None = None,
                 mesh: DeviceMesh | dict[str, int] | None = None, precision: str | Precision = "no",
                 task: Any = None, tokenizer: Any = None, seed: int = 42, kernels: KernelSwitch = None,
                 **spec: Any) -> None:
        # capabilities (task kind, strategy, mesh) are checked before the strategy or the network is built
        runtime = build_runtime(type(self), task=task, strategy=strategy, strategy_options=strategy_options,
                                mesh=mesh, precision=precision, spec=spec)
        self.accelerator, self.precision, self.strategy = runtime.accelerator, runtime.precision, runtime.strategy
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
        self.module = self.strategy.prepare_precision(module).to(self.device)
        self._wrapped: torch.nn.Module | None = None
        self._parameter_cache: dict[str, list[torch.nn.Parameter]] = {}
        self.adapter_states = AdapterStates()
        self._states, self._adapters = self.adapter_states.states, self.adapter_states.configs  # the same dicts
        self._head_asked: tuple[Any, ...] | None = None  # what output_layer() was last asked about, and its answer
        self._head_found: torch.nn.Linear | None = None
        #: True on a model made by frozen_copy(): it only evaluates
        self.frozen = False

    # ================================================================== backend extension
    @abstractmethod
    def build_network(self) -> torch.nn.Module:
        """Build the network on CPU (weights initialised or loaded); ``self.task`` tells which kind."""

    def run_network(self, module: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """Run ``module`` (the strategy's wrapped network) on ``inputs`` (only :attr:`network_input_keys`, on
        the device); return at least ``logits``. The task's ``process_outputs`` is applied by the caller."""
        out = module(**{k: v for k, v in inputs.items() if k in self.network_input_keys})
        return dict(out) if not isinstance(out, dict) else out

    def output_layer(self) -> torch.nn.Linear | None:
        """The network's output layer, when the backend knows the logits are exactly this plain linear layer
        applied to the final hidden states (no soft-capping or scaling after it); ``None`` otherwise."""
        return None

    def adapter_config_for(self, config: Any) -> Any:
        """The backend's own adapter config for ``config`` (a dict or the backend's config object): what
        ``Task.adapter_config`` receives and ``attach_adapter`` places. Default: ``config`` as it is."""
        return config

    def attach_adapter(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        """Add a trainable adapter to ``self.module`` (which it may replace, e.g. by PEFT's wrapper)."""
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

    def adapter_parameter_names(self, adapter_name: str) -> list[str]:
        """Names (in ``self.module.named_parameters()``) of the adapter's trainable weights."""
        raise ConfigError(f"{type(self).__name__} does not support adapters")

    def local_weights(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``get_state_dict()``'s weights keyed (and cut) the way ``strategy.load_state_dict`` takes them."""
        return state_dict

    @abstractmethod
    def write_weights(self, directory: str, state_dict: dict[str, torch.Tensor], adapter_name: str | None) -> None:
        """Write ``state_dict`` (model or adapter weights, full names) in the backend's public format."""

    @abstractmethod
    def read_weights(self, directory: str, adapter_name: str | None) -> dict[str, torch.Tensor]:
        """Read weights written by ``write_weights`` back as a state dict keyed like ``self.module``."""

    def describe(self) -> dict[str, Any]:
        """The model's part of ``get_train_configs()``: ``class`` at least (``model_type``, ``vocab_size`` ...)."""
        return {"class": type(self).__name__}

    @property
    def network(self) -> torch.nn.Module:
        return self.module

    # ================================================================== adapters and states
    def train_state(self, adapter_name: str | None = None) -> TrainState:
        """The training state of ``adapter_name`` (``None``: the only adapter, or the full model)."""
        return self.adapter_states.state(adapter_name)

    def step_context(self, adapter_name: str | None = None, *, disable_adapters: bool = False) -> StepContext:
        """What a backend whose schedule fuses forward and backward (Megatron's pipeline) needs of one step:
        the adapter's state, its loss (the task's default when none was set), the device and the adapter scope."""
        state = self.train_state(adapter_name)
        return StepContext(state=state, device=self.device, ensure_loss=self._ensure_loss,
                           enter_adapter=lambda: self._adapter_scope(adapter_name, disable_adapters))

    def trainable_parameters(self, *, adapter_name: str | None = None) -> list[torch.nn.Parameter]:
        _ = self.wrapped  # parameters are final only once the strategy has wrapped (sharded) the module
        return self._parameters(self.adapter_states.resolve(adapter_name))

    def _parameters(self, name: str) -> list[torch.nn.Parameter]:
        # cached: walking every parameter name costs milliseconds per call on PEFT models, three calls a
        # step; the cache is dropped whenever the parameter set can change (adapters, wrapping, optimizers)
        cached = self._parameter_cache.get(name)
        if cached is None:
            wanted = None if name == FULL_MODEL else set(self.adapter_parameter_names(name))
            cached = self._parameter_cache[name] = parameters_of(self.module, wanted)
        return cached

    @trains
    def add_adapter_to_model(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        self.adapter_states.check_new(adapter_name)
        if self._wrapped is not None and self._wrapped is not self.module:
            raise ConfigError("add adapters before the first forward or set_optimizer: the strategy has already "
                              "wrapped the model")
        placed = self.adapter_config_for(config)
        narrow = getattr(self.task, "adapter_config", None)  # Task.adapter_config: e.g. a VLM's LoRA on its LM only
        if narrow is not None:
            placed = self.adapter_config_for(narrow(self, placed))
        self._parameter_cache.clear()
        self.attach_adapter(adapter_name, placed, **kwargs)
        if self._wrapped is not None and self._wrapped is not self.module:
            # the strategy's wrapping was the module itself (save() or get_state_dict() asked for it, nothing ran
            # yet): it is redone around the module with its new adapter on first use
            self._wrapped = None
        self.adapter_states.add(adapter_name, config)

    def remove_adapter(self, adapter_name: str) -> None:
        self.adapter_states.resolve(adapter_name)
        self.detach_adapter(adapter_name)
        self._parameter_cache.clear()
        self.adapter_states.remove(adapter_name)

    @property
    def data_parallel(self) -> DataParallelView:
        return DataParallelView(self.strategy.dp_rank, self.strategy.dp_size, self.strategy.dp_group)

    @property
    def reshards_checkpoints(self) -> bool:
        return self.strategy.reshards_checkpoints

    @property
    def wrapped(self) -> torch.nn.Module:
        """The module as the strategy runs it (wrapped on first use, so adapters can be added first)."""
        if self._wrapped is None:
            self._wrapped = self.strategy.wrap_module(self.module)
            self._parameter_cache.clear()
        return self._wrapped

    # ================================================================== compute
    @property
    def network_input_keys(self) -> tuple[str, ...]:
        """The batch keys handed to :meth:`run_network`: the backend's text inputs and the task's ``model_inputs``."""
        return (*self.model_input_keys, *getattr(self.task, "model_inputs", ()))

    def _to_device(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def _adapter_scope(self, adapter_name: str | None,
                       disable_adapters: bool = False) -> contextlib.AbstractContextManager[Any]:
        """The adapter context of a forward: ``adapter_name``'s adapter, or with ``disable_adapters`` none."""
        name = self.adapter_states.resolve(adapter_name)
        if disable_adapters and self._adapters:
            return self.deactivate_adapters()
        return self.activate_adapter(name or None)

    def _compute(self, inputs: dict[str, Any], adapter_name: str | None,
                 disable_adapters: bool = False, fused_head: torch.nn.Linear | None = None) -> dict[str, Any]:
        keys = self.network_input_keys
        network_inputs = {k: v for k, v in inputs.items() if k in keys}
        with self._adapter_scope(adapter_name, disable_adapters), self.strategy.forward_context(self.device.type):
            if fused_head is None:
                outputs = self.run_network(self.wrapped, network_inputs)
            else:
                with lm_head.deferred(fused_head) as head_inputs:
                    outputs = self.run_network(self.wrapped, network_inputs)
                outputs = {**{k: v for k, v in outputs.items() if k != "logits"}, **head_inputs}
            return self.task.process_outputs(outputs, inputs) if self.task is not None else outputs

    def _fused_lm_head(self, state: TrainState) -> torch.nn.Linear | None:
        """The LM head to hand to a loss that applies it itself (``Loss.fuses_lm_head``), or ``None``."""
        self._ensure_loss(state)
        asked = (id(self.module), tuple(self._adapters))  # adapters (PEFT's wrapper, a LoRA-targeted head) change it
        if asked != self._head_asked:
            self._head_asked, self._head_found = asked, self.output_layer()
        return lm_head.fusable(self._head_found, state.loss, [self.task, *state.metrics],
                               forward_is_collective=self.strategy.forward_is_collective)

    @trains
    def forward(self, *, inputs: dict[str, Any], adapter_name: str | None = None, **kwargs: Any) -> dict[str, Any]:
        self.check_inputs(inputs, call="forward")
        return self._forward(inputs, adapter_name, fuse_lm_head=False)

    def _forward(self, inputs: dict[str, Any], adapter_name: str | None, *, fuse_lm_head: bool) -> dict[str, Any]:
        state = self.train_state(adapter_name)
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
        self.train_state(adapter_name)
        # the strategy's unwrapped network: a DDP wrapper's forward would synchronise buffers on every decoding
        # step; a fully sharded module gathers its own weights
        target = self.strategy.unwrap_module(self.wrapped)
        was_training = target.training
        target.eval()
        try:
            with torch.no_grad(), self._adapter_scope(adapter_name), self.strategy.forward_context(self.device.type):
                yield GenerationModule(module=target, device=self.device, lockstep=self.strategy.forward_is_collective)
        finally:
            target.train(was_training)

    def _sync_context(self, state: TrainState) -> contextlib.AbstractContextManager[Any]:
        """Skip gradient synchronisation on all but the last micro-batch of an accumulation window."""
        last = (state.backward_calls + 1) % state.gradient_accumulation_steps == 0
        return contextlib.nullcontext() if last else self.strategy.no_sync(self.wrapped)

    def forward_only(self, *, inputs: dict[str, Any], adapter_name: str | None = None,
                     disable_adapters: bool = False, **kwargs: Any) -> dict[str, Any]:
        self.check_inputs(inputs, call="forward_only")
        self.train_state(adapter_name)
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
        state = self.train_state(adapter_name)
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
        state = self.train_state(adapter_name)
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
        self.check_inputs(inputs, call="forward_backward")
        outputs = self._forward(inputs, adapter_name, fuse_lm_head=True)
        loss = self.calculate_loss(adapter_name=adapter_name)
        self.backward(loss=loss, adapter_name=adapter_name)
        return {**outputs, "loss": loss.mean.detach(), "num_tokens": loss.num_tokens, **loss.metrics}

    # ================================================================== optimisation
    @trains
    def clip_grad_norm(self, max_grad_norm: float = 1.0, norm_type: float = 2.0, *,
                       adapter_name: str | None = None) -> float:
        state = self.train_state(adapter_name)
        return state.clip_gradients(self.strategy, self.wrapped, self.device, max_grad_norm, norm_type)

    @trains
    def step(self, *, adapter_name: str | None = None) -> None:
        self.train_state(adapter_name).apply_optimizer(self.strategy, self.wrapped, self.device)

    @trains
    def zero_grad(self, *, adapter_name: str | None = None) -> None:
        state = self.train_state(adapter_name)
        if state.handle is not None:
            self.strategy.zero_grad(self.wrapped, state.handle)
        else:  # gradients back-propagated before any optimizer existed
            for p in self._parameters(state.name):
                p.grad = None
        state.reset_accumulation()

    @trains
    def lr_step(self, *, adapter_name: str | None = None) -> None:
        state = self.train_state(adapter_name)
        if state.scheduler is not None:
            state.scheduler.step()

    @trains
    def clip_grad_and_step(self, max_grad_norm: float | None = 1.0, norm_type: float = 2.0, *,
                           adapter_name: str | None = None) -> float | None:
        state = self.train_state(adapter_name)
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
        state = self.train_state(adapter_name)
        state.loss, state.loss_spec = build_loss(loss, **kwargs)

    @trains
    def set_optimizer(self, optimizer: Any, *, adapter_name: str | None = None,
                      gradient_accumulation_steps: int = 1, **kwargs: Any) -> None:
        state = self.train_state(adapter_name)
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
                                **_plain_options(kwargs)}

    @trains
    def set_lr_scheduler(self, scheduler: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        state = self.train_state(adapter_name)
        handle = state.require_optimizer("set_lr_scheduler")
        state.scheduler = build_scheduler(scheduler, handle.optimizer, **kwargs)
        state.scheduler_spec = {"name": scheduler if isinstance(scheduler, str) else type(state.scheduler).__name__,
                                **_plain_options(kwargs)}

    def add_metric(self, metric: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        self.train_state(adapter_name).metrics.append(metric_totals.build_metric(metric, **kwargs))

    def calculate_metric(self, *, adapter_name: str | None = None, reset: bool = True) -> dict[str, float]:
        state = self.train_state(adapter_name)
        result = metric_totals.aggregate(state.metrics, self.strategy.global_sum, self.device, reset=reset)
        if state.optimizer is not None:
            result["lr"] = float(state.optimizer.param_groups[0]["lr"])
        result["step"] = state.step
        return result

    def get_train_configs(self, *, adapter_name: str | None = None) -> dict[str, Any]:
        several = adapter_name is None and len(self._adapters) > 1
        state = self._states[FULL_MODEL] if several else self.train_state(adapter_name)
        return describe_training(self, state, adapters=self._adapters, trainable=self._parameters(state.name))

    # ================================================================== state
    def frozen_copy(self) -> TorchTwinkleModel:
        return frozen.frozen_copy(self)

    def sibling(self, *, task: Any, **overrides: Any) -> TorchTwinkleModel:
        return frozen.sibling(self, task=task, **overrides)

    def get_state_dict(self, *, adapter_name: str | None = None) -> dict[str, Any]:
        name = self.adapter_states.resolve(adapter_name)
        full = self.strategy.full_state_dict(self.wrapped)
        if name == FULL_MODEL:
            return full
        wanted = set(self.adapter_parameter_names(name))
        return {k: v for k, v in full.items() if k in wanted}

    def save(self, name: str, *, output_dir: str, adapter_name: str | None = None, save_optimizer: bool = True,
             extra_state: dict[str, Any] | None = None) -> str:
        if self.frozen and save_optimizer:
            raise frozen.refusal(self, "save(save_optimizer=True)")
        return checkpoint_io.save(self, self.train_state(adapter_name), name, output_dir=output_dir,
                                  save_optimizer=save_optimizer, extra_state=extra_state)

    def load(self, path: str, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        name = self.adapter_states.resolve(adapter_name)
        weights = self.read_weights(path, name or None)
        self.strategy.load_state_dict(self.wrapped, weights, strict=name == FULL_MODEL)

    @trains
    def resume_from_checkpoint(self, path: str, *, adapter_name: str | None = None) -> dict[str, Any]:
        # a missing directory or marker is one CheckpointError saying which and what to do, before anything loads
        checkpoint.check_marker(path)
        return checkpoint_io.resume(self, self.train_state(adapter_name), path)


def _plain_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options a spec records (JSON-safe scalars; objects such as parameter groups are left out)."""
    return {k: v for k, v in options.items() if isinstance(v, (int, float, str, bool))}
