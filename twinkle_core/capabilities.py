"""Capabilities declared as data, checked before anything is built.

A model class declares which strategies it runs on (``supported_strategies``, ``None`` = any), a
strategy declares the mesh dimensions it implements (``mesh_dimensions``) and, when it only drives
one family of networks, the model classes it drives (``supported_models``, matched against the
model's class hierarchy, ``None`` = any). :func:`check_compatible` compares them, so an impossible
combination (``MegatronModel`` on ``ddp``, ``tp=2`` on ``native_fsdp``) fails at once with a message
listing what would work, instead of after the process group is up and the weights are loaded::

    class MyStrategy(Strategy):
        name = "my_dp"
        mesh_dimensions = ("dp",)

    check_compatible(TransformersModel, MyStrategy, DeviceMesh(tp=2))   # ConfigError: ... tp=2 ...

A model class also declares the networks it builds (``supported_model_kinds``: the ``Task.model_kind``
values, ``None`` = any); :func:`check_model_kind` refuses a task whose kind it does not build (a PPO
critic's ``token_value`` head on a class that builds only ``causal_lm``), naming the installed classes that do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_core.mesh import DeviceMesh


def active_dimensions(mesh: DeviceMesh) -> dict[str, int]:
    """The mesh dimensions larger than one (``vpp`` included), in declaration order."""
    return {dim: size for dim, size in mesh.to_dict().items() if size > 1}


def check_mesh(strategy_name: str, mesh: DeviceMesh, supported: Iterable[str],
               notes: Mapping[str, str] | None = None) -> None:
    """Refuse mesh dimensions that a strategy does not implement (instead of silently ignoring them).

    ``notes`` maps a dimension to the strategy's own explanation (what to use instead); it is formatted
    with ``size=`` and replaces the generic message.
    """
    supported = tuple(supported)
    extra = {dim: size for dim, size in active_dimensions(mesh).items() if dim not in supported}
    for dim, size in extra.items():
        if notes and dim in notes:
            raise ConfigError(notes[dim].format(size=size))
    if extra:
        sizes = ", ".join(f"{dim}={size}" for dim, size in extra.items())
        implemented = ", ".join(sorted(supported)) or "none (one process)"
        raise ConfigError(f"strategy {strategy_name!r} implements only the mesh dimension(s) {implemented}; this "
                          f"mesh has {sizes}. {_who_implements(extra)}")


def _who_implements(dimensions: dict[str, int]) -> str:
    able = [name for name, cls in _registered_strategies().items()
            if set(dimensions) <= set(getattr(cls, "mesh_dimensions", ()))]
    if able:
        return f"Strategies that implement them: {', '.join(sorted(able))}; or drop them from the mesh"
    return "No installed strategy implements them (`twinkle plugins` lists what is installed); drop them from the mesh"


def _registered_strategies() -> dict[str, Any]:
    return _registered("strategy")


def _registered(kind: str) -> dict[str, Any]:
    """Every installed plugin of ``kind`` that imports, by name (one that cannot import is reported by
    ``twinkle plugins``, not here)."""
    from twinkle_core.plugins import get_plugins

    plugins = get_plugins()
    found: dict[str, Any] = {}
    for name in plugins.names(kind):
        try:
            found[name] = plugins.load(kind, name)
        except ImportError:
            continue
    return found


def model_kinds(model_cls: type) -> tuple[str, ...] | None:
    """The ``Task.model_kind`` values ``model_cls`` builds a network for; ``None``: any."""
    kinds = getattr(model_cls, "supported_model_kinds", None)
    return None if kinds is None else tuple(kinds)


def task_model_kind(task: Any) -> str:
    """The network kind ``task`` asks for (an instance may choose its own, e.g. the embedding task's option)."""
    return getattr(task, "model_kind", "causal_lm")


def check_model_kind(model_cls: type, task: Any) -> None:
    """Raise :class:`ConfigError` when ``model_cls`` does not build the network ``task`` asks for.

    The model constructor calls it before building anything; ``twinkle train --dry-run`` can call it with the
    recipe's model class and task. ``task=None`` (no task: a causal LM) is always accepted."""
    kinds = model_kinds(model_cls)
    if task is None or kinds is None:
        return
    kind = task_model_kind(task)
    if kind in kinds:
        return
    task_name = getattr(task, "name", None) or type(task).__name__
    able = sorted(name for name, cls in _registered("model").items()
                  if (model_kinds(cls) is None or kind in model_kinds(cls)))
    who = (f"Model classes that build it: {', '.join(able)}" if able
           else "No installed model class declares it (`twinkle plugins` lists what is installed)")
    raise ConfigError(f"task {task_name!r} needs a network of model_kind {kind!r}, which {model_cls.__name__} does "
                      f"not build (it builds {', '.join(kinds) or 'none'}); nothing was built. {who}")


def _class_names(cls: type) -> set[str]:
    return {klass.__name__ for klass in cls.__mro__}


def check_compatible(model_cls: type, strategy_cls: type, mesh: DeviceMesh | None = None, *,
                     strategy_name: str | None = None) -> None:
    """Raise :class:`ConfigError` when ``model_cls`` cannot run on ``strategy_cls`` with ``mesh``.

    ``strategy_name`` overrides the strategy class's ``name`` (an instance may carry its own).
    """
    name = strategy_name or getattr(strategy_cls, "name", "") or strategy_cls.__name__
    model = model_cls.__name__
    allowed = getattr(model_cls, "supported_strategies", None)
    if allowed is not None and name not in allowed:
        listed = " / ".join(repr(s) for s in allowed)
        fix = (f"use strategy {allowed[0]!r}" if len(allowed) == 1
               else f"use one of the strategies {', '.join(repr(s) for s in allowed)}")
        raise ConfigError(f"{model} runs on the {listed} strategy only; got strategy {name!r}: {fix}. "
                          f"{getattr(model_cls, 'strategy_note', '')}".rstrip())
    drives = getattr(strategy_cls, "supported_models", None)
    if drives is not None and not (_class_names(model_cls) & set(drives)):
        raise ConfigError(f"strategy {name!r} drives {', '.join(drives)} only; {model} cannot run on it. "
                          f"Choose the model class that matches the strategy, or another strategy")
    if mesh is not None:
        check_mesh(name, mesh, getattr(strategy_cls, "mesh_dimensions", ()), getattr(strategy_cls, "dimension_notes", {}))
