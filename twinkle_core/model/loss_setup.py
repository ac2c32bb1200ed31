"""What ``set_loss`` accepts, turned into a :class:`~twinkle_core.loss.base.Loss` and the spec that describes it."""

from __future__ import annotations

import inspect
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import CallableLoss, Loss, accepts_context
from twinkle_core.plugins import get_plugins


def build_loss(loss: Any, **options: Any) -> tuple[Loss, dict[str, Any]]:
    """``(loss, spec)`` for a registered name, a ``Loss`` class (built with ``options``), an instance or a
    callable ``fn(outputs, inputs)``; ``spec`` (``name`` and ``options``) is what ``get_train_configs`` reports."""
    if isinstance(loss, str):
        spec = {"name": loss, **options}
        loss = get_plugins().load("loss", loss)
    else:
        spec = {"name": getattr(loss, "name", None) or repr(loss), **options}
    if inspect.isclass(loss) and issubclass(loss, Loss):
        loss = loss(**options)
    elif options:
        raise ConfigError(f"set_loss got options {sorted(options)} with an instance or callable; "
                          f"pass a loss name or class to configure it")
    if not isinstance(loss, Loss) or not accepts_context(loss):
        if not callable(loss):
            raise ConfigError(f"cannot use {loss!r} as a loss: pass a registered name, a Loss class, "
                              f"an instance or a callable")
        loss = CallableLoss(loss)  # also adapts losses written before ``context=`` existed
    return loss, spec
