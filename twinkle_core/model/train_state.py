"""Per-adapter training state: everything one tenant owns besides its weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    """What ``adapter_name`` scopes: loss, optimizer, scheduler, counters and metrics."""

    name: str
    loss: Any = None
    optimizer: Any = None
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
