"""What a model runs on, chosen and checked before its network is built: accelerator, precision, strategy.

:func:`build_runtime` is the first thing :class:`~twinkle_core.model.torch_model.TorchTwinkleModel`'s
constructor does. It folds the spec's size aliases (``tp_size=2``, ``sequence_parallel=2`` ...) into the
mesh, checks the declared capabilities (the task's model kind, the strategy and its mesh), and only then
builds the strategy and sets it up on the accelerator.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from twinkle_core.accelerator import Accelerator, current_accelerator
from twinkle_core.capabilities import check_compatible, check_model_kind
from twinkle_core.errors import ConfigError
from twinkle_core.mesh import DeviceMesh, default_strategy, merge_spec_sizes, pop_spec_sizes, suggest_spec_key
from twinkle_core.options import accepted_options
from twinkle_core.plugins import get_plugins
from twinkle_core.precision import Precision
from twinkle_core.strategy import Strategy


@dataclass(frozen=True)
class Runtime:
    accelerator: Accelerator
    precision: Precision
    strategy: Strategy


def _strategy_name(strategy: str | Strategy) -> str:
    return strategy if isinstance(strategy, str) else strategy.name


def _tensor_sequence_parallel(strategy_cls: type, strategy: str | Strategy, options: dict[str, Any] | None,
                              flag: bool) -> dict[str, Any] | None:
    """``sequence_parallel=True/False`` (not a size): the strategy's own ``sequence_parallel`` option where it
    declares one in ``spec_options`` (Megatron: sequence parallelism inside tensor-parallel regions)."""
    if "sequence_parallel" in strategy_cls.spec_options:
        if not isinstance(strategy, str):
            raise ConfigError("sequence_parallel= with a strategy instance: set it on the strategy itself")
        options = dict(options or {})
        if options.get("sequence_parallel", flag) != flag:
            raise ConfigError(f"sequence_parallel={flag} contradicts strategy_options['sequence_parallel']="
                              f"{options['sequence_parallel']}; give one")
        options["sequence_parallel"] = flag
        return options
    if flag:
        raise ConfigError(f"sequence_parallel=True: strategy {_strategy_name(strategy)!r} takes the sequence-parallel "
                          f"size, the number of ranks each sequence is split over (sequence_parallel=2 is mesh sp=2, "
                          f"run by the 'ulysses' strategy)")
    return options


def check_spec(model_cls: type, spec: Mapping[str, Any]) -> tuple[dict[str, int], bool | None]:
    """The spec's size aliases in ``spec`` (the constructor's remaining keyword options), as
    :func:`~twinkle_core.mesh.pop_spec_sizes` returns them; any other key is refused, with a suggestion.
    The model's constructor calls it (:func:`build_runtime`), and ``twinkle train`` / ``--dry-run`` through
    :meth:`TorchTwinkleModel.check_options`."""
    spec = dict(spec)
    sizes, tensor_sequence_parallel = pop_spec_sizes(spec)
    if spec:
        known = sorted(accepted_options(model_cls).names)
        hints = []
        for key in sorted(spec):
            close = suggest_spec_key(key) or next(iter(difflib.get_close_matches(str(key), known, n=1)), None)
            hints.append(f"{key} (did you mean {close}?)" if close else key)
        raise ConfigError(f"{model_cls.__name__} got unknown option(s) {', '.join(hints)}")
    return sizes, tensor_sequence_parallel


def build_runtime(model_cls: type, *, task: Any, strategy: str | Strategy | None,
                  strategy_options: dict[str, Any] | None, mesh: DeviceMesh | dict[str, int] | None,
                  precision: str | Precision, spec: dict[str, Any]) -> Runtime:
    """Check ``model_cls``'s capabilities against ``task`` and the strategy, then build and set up the strategy.

    ``spec`` holds the constructor's remaining keyword options: the spec's size aliases are taken from it,
    anything else is refused with a suggestion."""
    sizes, tensor_sequence_parallel = check_spec(model_cls, spec)
    check_model_kind(model_cls, task)
    mesh = merge_spec_sizes(mesh, sizes)
    plugins = get_plugins()
    if isinstance(mesh, dict):
        mesh = DeviceMesh(**mesh)
    if strategy is None:  # the one default rule: twinkle_core.mesh.default_strategy
        strategy = default_strategy(model_cls)
    strategy_cls = plugins.load("strategy", strategy) if isinstance(strategy, str) else type(strategy)
    if tensor_sequence_parallel is not None:
        strategy_options = _tensor_sequence_parallel(strategy_cls, strategy, strategy_options,
                                                     tensor_sequence_parallel)
    check_compatible(model_cls, strategy_cls, mesh if mesh is not None else getattr(strategy, "mesh", None),
                     strategy_name=_strategy_name(strategy))
    accelerator = current_accelerator()
    precision = plugins.load("precision", precision)() if isinstance(precision, str) else precision
    precision.check_supported(accelerator)
    if isinstance(strategy, str):
        strategy = strategy_cls(mesh=mesh, precision=precision, **(strategy_options or {}))
    else:
        strategy.bind_precision(precision)
    strategy.setup(accelerator)
    return Runtime(accelerator=accelerator, precision=precision, strategy=strategy)
