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
    from twinkle_core.plugins import get_plugins

    plugins = get_plugins()
    found: dict[str, Any] = {}
    for name in plugins.names("strategy"):
        try:
            found[name] = plugins.load("strategy", name)
        except ImportError:  # a strategy whose backend cannot import is reported by `twinkle plugins`
            continue
    return found


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
