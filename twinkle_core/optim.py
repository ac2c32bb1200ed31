"""Optimizers and learning-rate schedulers by registered name, class or instance."""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any

from twinkle_core.errors import ConfigError

if TYPE_CHECKING:
    import torch


def build_optimizer(spec: Any, parameters: list[torch.nn.Parameter], **kwargs: Any) -> torch.optim.Optimizer:
    """``spec``: a registered name (``"AdamW"``), an ``Optimizer`` subclass, or an instance (returned as is)."""
    import torch

    if isinstance(spec, torch.optim.Optimizer):
        if kwargs:
            raise ConfigError(f"set_optimizer got an optimizer instance and also options {sorted(kwargs)}; "
                              f"pass one or the other")
        return spec
    if isinstance(spec, str):
        from twinkle_core.plugins import get_plugins

        spec = get_plugins().load("optimizer", spec)
    if inspect.isclass(spec) and issubclass(spec, torch.optim.Optimizer):
        if not parameters:
            raise ConfigError("the optimizer has no trainable parameters: add an adapter or unfreeze the model")
        return spec(parameters, **kwargs)
    raise ConfigError(f"cannot build an optimizer from {spec!r}; pass a registered name, an Optimizer class "
                      f"or an Optimizer instance")


def build_scheduler(spec: Any, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
    """``spec``: a registered name (``"cosine"``), an ``LRScheduler`` class, or an instance."""
    import torch

    base = torch.optim.lr_scheduler.LRScheduler
    if isinstance(spec, base):
        return spec
    if isinstance(spec, str):
        from twinkle_core.plugins import get_plugins

        spec = get_plugins().load("scheduler", spec)
    if inspect.isclass(spec) and issubclass(spec, base):
        return spec(optimizer, **kwargs)
    if callable(spec):
        return spec(optimizer, **kwargs)
    raise ConfigError(f"cannot build a learning-rate scheduler from {spec!r}")


# ---------------------------------------------------------------------- built-in schedules
def _lambda(optimizer: Any, fn: Any) -> Any:
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def constant(optimizer: Any, num_warmup_steps: int = 0, **_: Any) -> Any:
    """Linear warm-up, then constant."""
    return _lambda(optimizer, lambda step: min(1.0, (step + 1) / (num_warmup_steps + 1)) if num_warmup_steps else 1.0)


def linear(optimizer: Any, num_training_steps: int, num_warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> Any:
    """Linear warm-up, then linear decay to ``min_lr_ratio`` at ``num_training_steps``."""

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return (step + 1) / (num_warmup_steps + 1)
        progress = min(1.0, (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * (1 - progress)

    return _lambda(optimizer, factor)


def cosine(optimizer: Any, num_training_steps: int, num_warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> Any:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` at ``num_training_steps``."""

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return (step + 1) / (num_warmup_steps + 1)
        progress = min(1.0, (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return _lambda(optimizer, factor)
