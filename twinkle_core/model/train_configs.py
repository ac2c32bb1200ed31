"""The schema of ``TwinkleModel.get_train_configs()``: the keys every model returns, and a checker.

The trainer, the logs and saved checkpoints read these keys without fallbacks, so a backend must return
each of them (more keys are welcome: ``model_type``, ``skipped_steps``, ``tenants`` ...):

==============================  ==================  ==========================================================
key                             type                meaning
==============================  ==================  ==========================================================
``class``                       str                 the model class name
``adapter_name``                str | None          the adapter these configs describe; ``None``: the model
``adapters``                    list[str]           every adapter added to the model
``strategy``                    dict                the strategy's description; ``name`` at least
``precision``                   str                 the precision name (``"no"``, ``"bf16"`` ...)
``optimizer``                   dict | None         ``name`` and the options it was set with; ``None`` before
                                                    ``set_optimizer``
``lr_scheduler``                dict | None         ``name`` and options; ``None`` before ``set_lr_scheduler``
``loss``                        dict | None         ``name`` and options; ``None`` before a loss is set
``lr``                          float | None        the current learning rate of the optimizer's first param
                                                    group (it follows the scheduler); ``None`` without an
                                                    optimizer
``gradient_accumulation_steps`` int                 ``clip_grad_and_step`` calls per optimizer step (>= 1)
``dp_rank``, ``dp_size``        int                 this process's data-parallel coordinates
``trainable_parameters``        int                 the number of elements the optimizer updates
``step``                        int                 optimizer steps taken
==============================  ==================  ==========================================================

A task reads them typed through :class:`TrainingSetup` (``TrainingSetup.of(model).loss.option("beta")``)
rather than as nested dicts.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

#: ``class`` is a keyword, hence the functional form
TrainConfigs = TypedDict("TrainConfigs", {
    "class": str,
    "adapter_name": str | None,
    "adapters": list[str],
    "strategy": dict[str, Any],
    "precision": str,
    "optimizer": dict[str, Any] | None,
    "lr_scheduler": dict[str, Any] | None,
    "loss": dict[str, Any] | None,
    "lr": float | None,
    "gradient_accumulation_steps": int,
    "dp_rank": int,
    "dp_size": int,
    "trainable_parameters": int,
    "step": int,
})

#: the keys whose dict must name what it describes
_NAMED = ("strategy", "optimizer", "lr_scheduler", "loss")


def _runtime_types(annotation: Any) -> tuple[type, ...]:
    """``Optional[dict[str, Any]]`` -> ``(dict, NoneType)``: what ``isinstance`` can check."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(annotation) for t in _runtime_types(arg))
    return (typing.get_origin(annotation) or annotation,)


_TYPES = {key: _runtime_types(annotation) for key, annotation in typing.get_type_hints(TrainConfigs).items()}


def _has_type(value: Any, expected: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # a bool is an int to isinstance, never a count or a rank here
        return bool in expected
    if float in expected and isinstance(value, int):  # an int is a valid float (PEP 484 numeric tower)
        return True
    return isinstance(value, expected)


def _type_name(expected: tuple[type, ...]) -> str:
    return " | ".join("None" if t is type(None) else t.__name__ for t in expected)


def check_train_configs(configs: Any) -> list[str]:
    """The ways ``configs`` breaks the schema above, one sentence each; empty when it conforms."""
    if not isinstance(configs, dict):
        return [f"get_train_configs() must return a dict, got {type(configs).__name__}"]
    problems = []
    for key, expected in _TYPES.items():
        if key not in configs:
            problems.append(f"missing key {key!r} ({_type_name(expected)})")
        elif not _has_type(configs[key], expected):
            problems.append(f"{key!r} must be {_type_name(expected)}, got {configs[key]!r}")
    if problems:
        return problems
    for key in _NAMED:
        if configs[key] is not None and not isinstance(configs[key].get("name"), str):
            problems.append(f"{key!r} must carry its 'name' (a str), got {configs[key]!r}")
    if (configs["lr"] is None) != (configs["optimizer"] is None):
        problems.append(f"'lr' is {configs['lr']!r} but 'optimizer' is {configs['optimizer']!r}: the learning rate "
                        f"is known exactly when an optimizer is set")
    if not all(isinstance(name, str) for name in configs["adapters"]):
        problems.append(f"'adapters' must list adapter names (str), got {configs['adapters']!r}")
    if configs["adapter_name"] is not None and configs["adapter_name"] not in configs["adapters"]:
        problems.append(f"'adapter_name' {configs['adapter_name']!r} is not among 'adapters' {configs['adapters']}")
    if not 0 <= configs["dp_rank"] < configs["dp_size"]:
        problems.append(f"'dp_rank' {configs['dp_rank']} is not in range(dp_size={configs['dp_size']})")
    if configs["gradient_accumulation_steps"] < 1:
        problems.append(f"'gradient_accumulation_steps' must be >= 1, got {configs['gradient_accumulation_steps']}")
    for key in ("trainable_parameters", "step"):
        if configs[key] < 0:
            problems.append(f"{key!r} must be >= 0, got {configs[key]}")
    return problems


def describe_training(model: Any, state: Any, *, adapters: Mapping[str, Any], trainable: list[Any]) -> dict[str, Any]:
    """The :data:`TrainConfigs` of a torch model's ``state`` (a :class:`~twinkle_core.model.train_state.TrainState`):
    ``model`` gives its ``describe()``, strategy, precision and accelerator; ``adapters`` maps each adapter to
    its config; ``trainable`` are the parameters the state's optimizer updates."""
    optimizer = state.optimizer
    return {
        **model.describe(),
        "adapter_name": state.name or None,
        "adapter_config": adapters.get(state.name),
        "adapters": sorted(adapters),
        "strategy": model.strategy.describe(),
        "precision": model.precision.name,
        "accelerator": model.accelerator.name,
        "optimizer": state.optimizer_spec or None,
        "lr_scheduler": state.scheduler_spec or None,
        "lr": float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None,
        "loss": state.loss_spec or None,
        "gradient_accumulation_steps": state.gradient_accumulation_steps,
        "metrics": [type(m).__name__ for m in state.metrics],
        "dp_rank": model.strategy.dp_rank,
        "dp_size": model.strategy.dp_size,
        # partitioned (ZeRO-3) parameters report their full size as ds_numel
        "trainable_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in trainable),
        **state.counters(),
    }


@dataclass(frozen=True)
class LossSpec:
    """The loss a model was set up with: its registered name (or class name) and the options it was built with."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def option(self, key: str, default: Any = None) -> Any:
        """An option the loss was built with (``beta``, ``reference_free`` ...), or ``default``."""
        value = self.options.get(key)
        return default if value is None else value

    @classmethod
    def of(cls, spec: Mapping[str, Any] | None) -> LossSpec | None:
        """From ``get_train_configs()["loss"]`` (``None`` before a loss is set)."""
        if not spec:
            return None
        return cls(name=str(spec.get("name")), options={k: v for k, v in spec.items() if k != "name"})


@dataclass(frozen=True)
class TrainingSetup:
    """A typed view of ``get_train_configs()`` for the values tasks decide by."""

    adapters: tuple[str, ...] = ()
    loss: LossSpec | None = None
    step: int = 0
    gradient_accumulation_steps: int = 1

    @classmethod
    def of(cls, model: Any, *, adapter_name: str | None = None) -> TrainingSetup:
        """``model``'s set-up now (``adapter_name``: that adapter's); a stand-in without ``get_train_configs``
        gives the defaults (no adapter, no loss, step 0)."""
        get = getattr(model, "get_train_configs", None)
        if not callable(get):
            return cls()
        configs = get(adapter_name=adapter_name) if adapter_name is not None else get()
        return cls(adapters=tuple(configs.get("adapters") or ()), loss=LossSpec.of(configs.get("loss")),
                   step=int(configs.get("step") or 0),
                   gradient_accumulation_steps=int(configs.get("gradient_accumulation_steps") or 1))
