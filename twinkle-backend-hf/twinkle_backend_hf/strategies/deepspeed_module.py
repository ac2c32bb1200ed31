"""The module and optimizer handle that :class:`~twinkle_backend_hf.strategies.deepspeed.DeepSpeedStrategy`
hands out: :class:`DeepSpeedModule` runs the network until the engine exists and the engine afterwards;
:class:`DeepSpeedHandle` tracks one optimizer's gradients on that shared engine. Re-exported by
:mod:`twinkle_backend_hf.strategies.deepspeed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from twinkle_backend_hf.strategies.deepspeed_optimizer_group import _OptimizerGroup
from twinkle_core.strategy import OptimizerHandle

if TYPE_CHECKING:
    from twinkle_backend_hf.strategies.deepspeed import DeepSpeedStrategy


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
