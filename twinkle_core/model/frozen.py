"""Frozen copies: a model's current base weights in a new model that only evaluates (DPO's reference model);
and siblings: a new trainable model of the same class, strategy and precision for another task (a PPO critic).

:meth:`TorchTwinkleModel.frozen_copy` builds a new model of the same class from the constructor arguments
the original was built with (recorded by ``TorchTwinkleModel.__new__``), with a fresh strategy of the same
class, options and mesh, and the same precision; it copies the weights through ``get_state_dict`` and the
strategy's ``load_state_dict``, so a sharded policy gives an equally sharded copy. The copy holds no
optimizer, no parameter requires a gradient, and every training method raises :func:`refusal`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from twinkle_core.errors import ConfigError

if TYPE_CHECKING:
    from twinkle_core.model.torch_model import TorchTwinkleModel

FROZEN = "a frozen copy does not train"
_Method = TypeVar("_Method", bound=Callable[..., Any])


def refusal(model: Any, action: str) -> ConfigError:
    return ConfigError(f"{FROZEN}: {type(model).__name__}.{action} is not available on a model made by "
                       f"frozen_copy() (it only evaluates: forward_only, get_state_dict, save(save_optimizer=False)); "
                       f"train the model it was copied from")


def trains(method: _Method) -> _Method:
    """Mark a training method: on a frozen copy it raises :func:`refusal` instead of running."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "frozen", False):
            raise refusal(self, method.__name__)
        return method(self, *args, **kwargs)

    return guarded  # type: ignore[return-value]


def rebuild_arguments(model: TorchTwinkleModel) -> dict[str, Any]:
    """The constructor arguments of a model like ``model``: its own, with a new strategy of the same class,
    options and mesh (a strategy instance holds per-model state: wrapped modules, engines, process groups)."""
    kwargs = dict(model.init_arguments)
    strategy = model.strategy
    try:
        fresh = type(strategy)(mesh=strategy.mesh, **dict(strategy.options))
    except TypeError as exc:  # a strategy whose options do not round-trip through its constructor
        raise ConfigError(f"frozen_copy cannot rebuild strategy {strategy.name!r} from its options "
                          f"{sorted(strategy.options)}: {exc}") from None
    kwargs.pop("strategy_options", None)
    kwargs.pop("mesh", None)
    # the precision instance is shared on purpose: the copy only autocasts and never scales a loss
    kwargs.update(strategy=fresh, precision=model.precision, task=model.task, tokenizer=model.tokenizer,
                  seed=model.seed)
    return kwargs


def sibling(model: TorchTwinkleModel, *, task: Any, **overrides: Any) -> TorchTwinkleModel:
    """A new, trainable model like ``model`` for ``task`` (see ``TwinkleModel.sibling``)."""
    kwargs = rebuild_arguments(model)
    # its own precision object: a trainable model scales its own loss (fp16)
    kwargs["precision"] = model.precision.name  # by name: a Precision instance may hold a loss scaler
    kwargs.update(task=task, **overrides)
    return type(model)(**kwargs)


def freeze(model: TorchTwinkleModel) -> None:
    model.frozen = True
    for p in model.module.parameters():
        p.requires_grad_(False)
    model._parameter_cache.clear()


def frozen_copy(model: TorchTwinkleModel) -> TorchTwinkleModel:
    if model.adapter_states.configs:
        raise ConfigError(f"frozen_copy copies the full model, but this one carries LoRA adapter(s) "
                          f"{sorted(model.adapter_states.configs)}: the reference of a LoRA policy is its base model, which "
                          f"forward_only(inputs=..., adapter_name=..., disable_adapters=True) runs without a copy")
    weights = model.get_state_dict()  # complete on every rank (a collective under sharded strategies)
    copy = type(model)(**rebuild_arguments(model))
    freeze(copy)  # before the strategy wraps it: DDP and ZeRO-3 decide by requires_grad how to place it
    copy.strategy.load_state_dict(copy.wrapped, copy.local_weights(weights), strict=True)
    freeze(copy)  # wrapping may have made new parameter objects (FSDP2's DTensor shards)
    return copy
