"""The module and optimizer handle that :class:`~twinkle_backend_hf.strategies.deepspeed.DeepSpeedStrategy`
hands out: :class:`DeepSpeedModule` runs the network until the engine exists and the engine afterwards;
:class:`DeepSpeedHandle` tracks one optimizer's gradients on that shared engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from twinkle_backend_hf.strategies.deepspeed_optimizer_group import OptimizerGroup
from twinkle_core.errors import ConfigError
from twinkle_core.strategy import OptimizerHandle


@dataclass(eq=False)
class DeepSpeedHandle(OptimizerHandle):
    """One optimizer on the shared engine. ``parameters`` are its model parameters (DeepSpeed replaces the
    optimizer's own with flat fp32 partitions); ``gradients`` says where its gradients stand between two
    steps: ``None``, ``"accumulating"`` (non-boundary backwards only) or ``"reduced"`` (a boundary backward
    has reduced them into the partitions)."""

    gradients: str | None = None


class DeepSpeedModule(torch.nn.Module):
    """What the model runs: the network until an engine exists, the DeepSpeed engine afterwards.

    ``create_engine(wrapped)`` builds the training engine of every registered optimizer and attaches it
    (:meth:`attach_engine`); the first training forward after ``set_optimizer`` calls it.
    """

    def __init__(self, module: torch.nn.Module, create_engine: Callable[[DeepSpeedModule], Any]) -> None:
        super().__init__()
        self.module = module
        # neither is a registered submodule
        object.__setattr__(self, "create_engine", create_engine)
        object.__setattr__(self, "engine", None)
        #: every optimizer's handle, in set_optimizer order: the engine serves them all
        self.handles: list[DeepSpeedHandle] = []
        self.optimizer_group: OptimizerGroup | None = None

    @staticmethod
    def of(module: torch.nn.Module) -> DeepSpeedModule:
        """``module`` itself, which must be one a DeepSpeed strategy wrapped."""
        if not isinstance(module, DeepSpeedModule):
            raise ConfigError("strategy 'deepspeed' was handed a module it did not wrap")
        return module

    def attach_engine(self, engine: Any, optimizer_group: OptimizerGroup | None = None) -> None:
        object.__setattr__(self, "engine", engine)
        self.optimizer_group = optimizer_group

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None and self.handles and self.training and torch.is_grad_enabled():
            self.create_engine(self)
        runner = self.engine if self.engine is not None else self.module
        return runner(*args, **kwargs)

    def owned_parameters(self) -> list[torch.nn.Parameter]:
        """The model parameters of every registered optimizer."""
        return [p for handle in self.handles for p in handle.parameters]
