"""The reward contract for online RL: ``(prompts, completions, **row_fields) -> list[float]``.

A reward scores a batch of completions. ``prompts[i]`` and ``completions[i]`` are texts, and every
other column of the data row the prompt came from arrives as a keyword argument holding one value
per completion (``answer=[...]``), so a reward can compare against a reference field. It returns
one float per completion; ``nan`` means "no score" and is handled by the RL task (counted, scored as
the recipe says), never silently averaged.

Rewards are registered by name (``twinkle_register_rewards``) or given in a recipe as
``module:function``. A plain function is enough::

    def ends_politely(prompts, completions, **fields):
        return [1.0 if c.rstrip().endswith("please") else 0.0 for c in completions]

A configurable reward subclasses :class:`Reward` and takes its options in ``__init__``::

    class MaxLength(Reward):
        name = "max_length"

        def __init__(self, limit=100):
            self.limit = limit

        def __call__(self, prompts, completions, **fields):
            return [0.0 if len(c) > self.limit else 1.0 for c in completions]
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from twinkle_core.errors import ConfigError

RewardFn = Callable[..., Sequence[float]]


class Reward(ABC):
    """A named, configurable reward function."""

    name: ClassVar[str] = ""

    @abstractmethod
    def __call__(self, prompts: list[str], completions: list[str], **fields: list[Any]) -> list[float]:
        """One score per completion."""


def load_reward(spec: str, options: dict[str, Any] | None = None, *, plugins: Any = None) -> RewardFn:
    """The reward named ``spec``: a registered name, or ``"package.module:function"`` for a user's own.

    A :class:`Reward` class is constructed with ``options``; a plain function takes none (``options``
    must then be empty, so a misspelt option is not silently dropped).
    """
    options = dict(options or {})
    if ":" in spec:
        from twinkle_core.lazy import import_object

        try:
            target = import_object(spec)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"reward {spec!r}: cannot import it ({exc}); give 'package.module:function' of an "
                              f"importable module") from exc
    else:
        if plugins is None:
            from twinkle_core.plugins import get_plugins

            plugins = get_plugins()
        target = plugins.load("reward", spec)
    if inspect.isclass(target):
        if not issubclass(target, Reward):
            raise ConfigError(f"reward {spec!r} is a class but not a twinkle_core.rewards.Reward")
        try:
            return target(**options)
        except TypeError as exc:
            raise ConfigError(f"reward {spec!r}: bad options {sorted(options)}: {exc}") from exc
    if not callable(target):
        raise ConfigError(f"reward {spec!r} is not callable")
    if options:
        raise ConfigError(f"reward {spec!r} is a plain function and takes no options, got {sorted(options)}; "
                          f"write a twinkle_core.rewards.Reward subclass to make it configurable")
    return target
