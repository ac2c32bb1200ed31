"""The adapters a model carries, and one :class:`TrainState` for each (and for the full model).

Every ``TwinkleModel`` call takes ``adapter_name``; :meth:`AdapterStates.resolve` is the one rule that turns
it into a state's key: a name must be an adapter; ``None`` is the only adapter, or the full model
(:data:`FULL_MODEL`) when there is none, and is refused when there are several.
"""

from __future__ import annotations

from typing import Any

import torch

from twinkle_core.errors import ConfigError
from twinkle_core.metrics import LossMetric
from twinkle_core.model.train_state import TrainState
from twinkle_core.names import validate_name

FULL_MODEL = ""  # the TrainState key of full fine-tuning (no adapter)


def new_state(name: str) -> TrainState:
    """A fresh state for adapter ``name`` (:data:`FULL_MODEL`: the full model), reporting its loss."""
    state = TrainState(name=name)
    state.metrics.append(LossMetric())
    return state


def parameters_of(module: torch.nn.Module, names: set[str] | None) -> list[torch.nn.Parameter]:
    """The parameters of ``module`` named in ``names``; ``None``: every one that requires a gradient."""
    if names is None:
        return [p for p in module.parameters() if p.requires_grad]
    return [p for n, p in module.named_parameters() if n in names]


class AdapterStates:
    """``configs``: each adapter's config as the caller gave it; ``states``: the states by key."""

    def __init__(self) -> None:
        self.configs: dict[str, Any] = {}
        self.states: dict[str, TrainState] = {FULL_MODEL: new_state(FULL_MODEL)}

    def resolve(self, adapter_name: str | None) -> str:
        if adapter_name is not None:
            if adapter_name not in self.configs:
                raise ConfigError(f"no adapter named {adapter_name!r}; adapters: {sorted(self.configs) or 'none'}"
                                  f" (add one with add_adapter_to_model)")
            return adapter_name
        if len(self.configs) == 1:
            return next(iter(self.configs))
        if len(self.configs) > 1:
            raise ConfigError(f"the model has several adapters {sorted(self.configs)}; pass adapter_name=")
        return FULL_MODEL

    def state(self, adapter_name: str | None) -> TrainState:
        return self.states[self.resolve(adapter_name)]

    def check_new(self, adapter_name: str) -> None:
        """Refuse a name that is taken or that PEFT cannot use."""
        validate_name("adapter name", adapter_name)
        if adapter_name in self.configs:
            raise ConfigError(f"adapter name {adapter_name!r} is already in use")
        if hasattr(torch.nn.Module, adapter_name):  # PEFT keeps each adapter as a module attribute of that name
            raise ConfigError(f"adapter name {adapter_name!r} is the name of a torch.nn.Module attribute, which "
                              f"PEFT cannot use for an adapter; choose another (e.g. 'tenant_{adapter_name}')")

    def add(self, adapter_name: str, config: Any) -> None:
        self.configs[adapter_name] = config
        self.states[adapter_name] = new_state(adapter_name)

    def remove(self, adapter_name: str) -> None:
        del self.configs[adapter_name]
        del self.states[adapter_name]
