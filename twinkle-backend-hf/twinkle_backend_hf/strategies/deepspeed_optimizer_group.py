"""Several torch optimizers (one per adapter) presented to one DeepSpeed engine as one optimizer.

DeepSpeed takes exactly one optimizer per engine; :class:`OptimizerGroup` lets adapters share the engine
while each optimizer step moves only the adapter whose step it is.
"""

from __future__ import annotations

import collections.abc
from collections.abc import Iterator
from typing import Any

import torch

from twinkle_core.errors import ConfigError


class _RoutedState(collections.abc.MutableMapping):
    """``optimizer.state`` of an :class:`OptimizerGroup`: each key lives in the state of the optimizer
    whose parameter groups hold it (DeepSpeed reads and writes ``optimizer.state[flat_partition]``)."""

    def __init__(self, group: OptimizerGroup) -> None:
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


class OptimizerGroup(torch.optim.Optimizer):
    """Several torch optimizers presented to one DeepSpeed engine as one.

    Its ``param_groups`` are the members' group dicts themselves (DeepSpeed rewrites
    ``group["params"]`` in place, and a member's scheduler changes ``group["lr"]`` in place). ``step``
    steps only the :attr:`active` member, and only the groups DeepSpeed is currently presenting.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        self.active: torch.optim.Optimizer | None = None
        super().__init__([g for o in self.optimizers for g in o.param_groups], {})
        self.refresh_groups()

    def refresh_groups(self) -> None:
        """Point ``param_groups`` at the members' group dicts again (after a load, or after ZeRO-3 emptied them)."""
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
        self.refresh_groups()  # torch's load_state_dict replaces the group dicts

