"""Per-adapter training state: everything one tenant owns besides its weights, and the gradient
window's bookkeeping as one API that every backend's forward/backward path calls.

The window runs from one optimizer step to the next. Losses are sums; each is divided by one
constant per window (:meth:`TrainState.open_window`, the first micro-batch's global token count per
rank, so gradients keep mean-loss magnitude), back-propagated, and counted
(:meth:`TrainState.record_backward`). Before clipping, the model multiplies the gradients once by that
constant over the window's global token count. A backend whose schedule runs forward and backward
itself (Megatron's pipeline) calls the same three methods::

    state.open_window(local_tokens, strategy)           # once, before the window's first backward
    result = state.apply_loss(outputs, inputs, context)  # loss + type check + metrics
    backward(strategy.scale_loss(state.scale_for_backward(result.loss)))
    state.record_backward(result.num_tokens)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import LossContext, LossOutput, accepts_context


@dataclass
class TrainState:
    """What ``adapter_name`` scopes: loss, optimizer, scheduler, counters and metrics."""

    name: str
    loss: Any = None
    #: the strategy's :class:`~twinkle_core.strategy.OptimizerHandle` for this adapter's optimizer
    handle: Any = None
    scheduler: Any = None
    optimizer_spec: dict[str, Any] = field(default_factory=dict)
    scheduler_spec: dict[str, Any] = field(default_factory=dict)
    loss_spec: dict[str, Any] = field(default_factory=dict)
    gradient_accumulation_steps: int = 1
    #: ``clip_grad_and_step`` calls since the last optimizer step
    accumulated_calls: int = 0
    #: backward calls since the last optimizer step (decides DDP gradient sync)
    backward_calls: int = 0
    #: tokens back-propagated since the last optimizer step, on this rank
    pending_tokens: float = 0.0
    #: constant the window's sum losses are divided by before backward (undone at normalisation)
    loss_divisor: float = 1.0
    gradients_normalised: bool = False
    step: int = 0
    skipped_steps: int = 0
    last_grad_norm: float | None = None
    metrics: list[Any] = field(default_factory=list)
    last_inputs: Any = None
    last_outputs: Any = None
    last_loss: Any = None

    @property
    def optimizer(self) -> Any:
        """The optimizer the user configured (``None`` before ``set_optimizer``)."""
        return self.handle.optimizer if self.handle is not None else None

    # ------------------------------------------------------------------ the gradient window
    def open_window(self, local_tokens: float, strategy: Any, device: Any = None) -> None:
        """Fix the window's loss divisor on its first backward (collective over the data-parallel ranks).

        One divisor for the whole window, the same on every rank, keeps gradients at mean-loss magnitude
        (fp16 loss scaling and bf16 rounding need that); normalisation undoes it exactly.
        """
        if self.backward_calls:
            return
        import torch

        first = strategy.global_sum(torch.tensor(float(local_tokens), dtype=torch.float64, device=device))
        self.loss_divisor = max(1.0, float(first) / strategy.dp_size)

    def scale_for_backward(self, loss: Any) -> Any:
        """The window-constant share of a sum loss that is back-propagated."""
        return loss / self.loss_divisor

    def apply_loss(self, outputs: dict[str, Any], inputs: dict[str, Any],
                   context: LossContext | None = None) -> LossOutput:
        """Run the adapter's loss, check what it returned and feed the metrics."""
        if self.loss is None:
            raise ConfigError("no loss is set: call set_loss(...) first")
        result = self.loss(outputs, inputs, context=context)
        if not isinstance(result, LossOutput):
            raise TypeError(f"loss {self.loss!r} returned {type(result).__name__}; expected LossOutput")
        for metric in self.metrics:
            # a metric reading logits may need the context's vocabulary shard (TokenAccuracy under TP)
            if context is not None and accepts_context(metric.update):
                metric.update(inputs, outputs, result, context=context)
            else:
                metric.update(inputs, outputs, result)
        return result

    def record_backward(self, tokens: Any) -> None:
        """Count one back-propagated micro-batch of ``tokens`` units (local to this rank)."""
        self.backward_calls += 1
        self.pending_tokens += float(tokens)
        self.gradients_normalised = False
        self.last_inputs = self.last_outputs = None  # free the graph's inputs early

    def require_optimizer(self, action: str) -> Any:
        """The optimizer handle, or a ``ConfigError`` saying that ``action`` needs ``set_optimizer`` first."""
        if self.handle is None:
            who = f"adapter_name={self.name!r}" if self.name else "the model"
            raise ConfigError(f"{action} needs an optimizer for {who}: call set_optimizer('AdamW', lr=...) first")
        return self.handle

    def normalise_gradients(self, strategy: Any, module: Any, device: Any = None) -> None:
        """Once per window, before clipping or stepping: unscale (fp16) and bring the window's gradients to
        the mean over its global token count (collective over the data-parallel ranks)."""
        if self.gradients_normalised:
            return
        import torch

        handle = self.require_optimizer("step")
        tokens = strategy.global_sum(torch.tensor(self.pending_tokens, dtype=torch.float64, device=device))
        strategy.unscale_gradients(handle)
        strategy.scale_gradients(module, handle, strategy.gradient_scale(float(tokens)) * self.loss_divisor)
        self.gradients_normalised = True

    def clip_gradients(self, strategy: Any, module: Any, device: Any, max_norm: float | None,
                       norm_type: float) -> float:
        """Normalise the window's gradients and clip them to ``max_norm`` (``None``: no limit); return the norm
        before clipping (also kept as ``last_grad_norm``, which decides whether the step is skipped)."""
        import math

        self.normalise_gradients(strategy, module, device)
        limit = math.inf if max_norm is None else float(max_norm)
        self.last_grad_norm = float(strategy.clip_grad_norm(module, self.handle, limit, norm_type))
        return self.last_grad_norm

    def apply_optimizer(self, strategy: Any, module: Any, device: Any) -> None:
        """One optimizer step; a non-finite gradient norm (or a strategy's overflow) skips the update."""
        import math

        handle = self.require_optimizer("step")
        self.normalise_gradients(strategy, module, device)
        if self.last_grad_norm is not None and not math.isfinite(self.last_grad_norm):
            self.skipped_steps += 1  # a NaN/inf gradient would poison the weights: skip the update, keep training
        elif not strategy.optimizer_step(module, handle):
            self.skipped_steps += 1
        self.step += 1

    def reset_accumulation(self) -> None:
        self.backward_calls = 0
        self.pending_tokens = 0.0
        self.gradients_normalised = False
        self.last_grad_norm = None
        self.last_inputs = self.last_outputs = self.last_loss = None

    def counters(self) -> dict[str, Any]:
        return {"step": self.step, "skipped_steps": self.skipped_steps, "accumulated_calls": self.accumulated_calls,
                "gradient_accumulation_steps": self.gradient_accumulation_steps}

    def load_counters(self, counters: dict[str, Any]) -> None:
        self.step = counters["step"]
        self.skipped_steps = counters.get("skipped_steps", 0)
        self.accumulated_calls = counters.get("accumulated_calls", 0)
        self.gradient_accumulation_steps = counters.get("gradient_accumulation_steps",
                                                        self.gradient_accumulation_steps)
