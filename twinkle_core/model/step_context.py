"""What a backend whose schedule fuses forward and backward needs of one step, as one public value.

Megatron's pipeline runs megatron-core's schedule, which calls forward and backward itself: it cannot
go through :meth:`TorchTwinkleModel.forward` / ``backward``. It asks the model for a
:class:`StepContext` instead::

    step = model.step_context(adapter_name, disable_adapters=disable_adapters)
    inputs = step.to_device(model.strategy.prepare_inputs(dict(inputs)))
    step.state.open_window(local_tokens, model.strategy, step.device)
    with step.adapter_scope(), model.strategy.forward_context(step.device.type):
        ...  # the schedule: result = step.state.apply_loss(outputs, batch, model.loss_context) with step.loss
    step.state.record_backward(tokens)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle_core.loss.base import Loss
from twinkle_core.model.train_state import TrainState


@dataclass(frozen=True)
class StepContext:
    """One step of one adapter (or of the full model): its state, its loss, where its tensors go, its adapter."""

    #: the adapter's (or the full model's) training state: window, counters, metrics
    state: TrainState
    #: the model's device
    device: torch.device
    #: sets the task's default loss on ``state`` when none was set; called on first use of :attr:`loss`
    ensure_loss: Callable[[TrainState], None] = field(repr=False)
    #: the context manager that makes the step's adapter the active one (or switches every adapter off)
    enter_adapter: Callable[[], contextlib.AbstractContextManager[Any]] = field(repr=False)

    @property
    def loss(self) -> Loss:
        """The state's loss, built from the task's default when none was set.

        Built on first read, not with the context: an evaluation step never reads it, and must not set a
        loss on the state as a side effect (``get_train_configs()["loss"]`` stays ``None``)."""
        self.ensure_loss(self.state)
        return self.state.loss

    def to_device(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """``inputs`` with every tensor moved to the model's device (other values as they are)."""
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def adapter_scope(self) -> contextlib.AbstractContextManager[Any]:
        """The adapter active for the forward (none with ``disable_adapters=True``); a fresh context each call."""
        return self.enter_adapter()
