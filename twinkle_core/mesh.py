"""The shape of a parallel job: how the world's ranks split across parallel dimensions."""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import asdict, dataclass
from typing import Any

from twinkle_core.errors import ConfigError

#: dimensions whose sizes multiply to the world size (the one list of them: everything else derives from it)
RANK_DIMENSIONS = ("dp", "fsdp", "tp", "pp", "cp", "sp")
#: every parallel dimension; ``ep`` is carved out of the data-parallel ranks, ``vpp`` splits pipeline stages
DIMENSIONS = (*RANK_DIMENSIONS, "ep")
ALL_DIMENSIONS = (*DIMENSIONS, "vpp")

#: the sizes under the names the spec writes them: ``tp_size=2`` is ``mesh={"tp": 2}``, exactly;
#: ``sequence_parallel=2`` is ``mesh={"sp": 2}`` (Ulysses: each sequence split over 2 ranks)
SPEC_KEYS: dict[str, str] = {**{f"{dim}_size": dim for dim in ALL_DIMENSIONS}, "sequence_parallel": "sp"}


@dataclass(frozen=True)
class DeviceMesh:
    """Sizes of each parallel dimension.

    * ``dp`` — replicated data parallel; ``fsdp`` — sharded data parallel;
    * ``tp`` tensor, ``pp`` pipeline (``vpp`` virtual stages per pipeline rank), ``cp`` context,
      ``sp`` Ulysses sequence parallel, ``ep`` expert parallel (carved out of the data-parallel ranks).

    ``dp * fsdp * tp * pp * cp * sp`` must equal the world size; ``ep`` must divide the
    data-parallel size. ``DeviceMesh.infer(world_size, tp=2)`` fills ``dp`` from the rest.

    The spec's names for the sizes (:data:`SPEC_KEYS`: ``tp_size``, ``pp_size``, ``dp_size``, ``ep_size``,
    ``sequence_parallel`` for ``sp``, and ``<dim>_size`` for every other dimension) mean exactly these fields;
    model constructors, ``DeviceMesh.infer`` and recipes accept them.
    """

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    sp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"mesh.{key} must be a positive integer, got {value!r}")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError("mesh.vpp > 1 needs pipeline parallelism: set mesh.pp >= 2")
        if self.data_parallel_size % self.ep:
            raise ConfigError(
                f"mesh.ep={self.ep} must divide the data-parallel size dp*fsdp={self.data_parallel_size}"
            )

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, dim) for dim in RANK_DIMENSIONS)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data (replicated and sharded data parallel)."""
        return self.dp * self.fsdp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp * self.sp

    def validate(self, world_size: int) -> DeviceMesh:
        if self.world_size != world_size:
            sizes = " * ".join(f"{d}={getattr(self, d)}" for d in RANK_DIMENSIONS)
            raise ConfigError(
                f"device mesh {sizes} = {self.world_size} ranks, but the job has world size {world_size}; "
                f"change the mesh or launch with --nproc-per-node {self.world_size}"
            )
        return self

    @classmethod
    def infer(cls, world_size: int | None = None, **sizes: int) -> DeviceMesh:
        """Build a mesh whose unspecified data-parallel size absorbs the remaining ranks."""
        world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        spec, flag = pop_spec_sizes(sizes)  # the spec's names: infer(world, tp_size=2) is infer(world, tp=2)
        if flag is not None:
            raise ConfigError("sequence_parallel=True/False is not a mesh size; give sequence_parallel=N (mesh sp=N)")
        sizes = merge_spec_sizes(sizes, spec)
        unknown = set(sizes) - set(ALL_DIMENSIONS)
        if unknown:
            raise ConfigError(f"unknown mesh dimension(s) {sorted(unknown)}; known: {', '.join(ALL_DIMENSIONS)}")
        if "dp" not in sizes:
            others = math.prod(sizes.get(d, 1) for d in RANK_DIMENSIONS if d != "dp")
            if world % others:
                raise ConfigError(f"world size {world} is not divisible by the model-parallel sizes {sizes}")
            sizes["dp"] = world // others
        return cls(**sizes).validate(world)

    @classmethod
    def for_job(cls, sizes: dict[str, int], world_size: int | None = None) -> DeviceMesh:
        """A recipe's mesh for a job of ``world_size`` ranks (default ``WORLD_SIZE``): when it names neither ``dp``
        nor ``fsdp``, ``dp`` takes the remaining ranks (``mesh: {tp: 2}`` on 4 ranks is tp=2 x dp=2)."""
        if {"dp", "fsdp"} & set(sizes):
            mesh = cls(**sizes)
            return mesh if world_size is None else mesh.validate(world_size)
        return cls.infer(world_size, **sizes)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def default_strategy(model_cls: type | None = None, world_size: int | None = None) -> str:
    """The strategy used when none is given (the one place this is decided), for a job of ``world_size``
    processes (default: ``WORLD_SIZE``).

    The plugins choose, through ``twinkle_select_default_strategy``: a backend's plugin answers for its model
    classes (``twinkle-backend-hf``: ``accelerate``, Accelerate-managed FSDP, for more than one process;
    ``twinkle-backend-megatron``: ``megatron`` for ``MegatronModel``); the core answers last with the first of
    the class's declared ``supported_strategies``, else ``single`` for one process. A distributed job nobody
    answers for is a :class:`ConfigError` naming what to install.
    """
    from twinkle_core.plugins import get_plugins

    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    plugins = get_plugins()
    chosen = plugins.select_default_strategy(model_cls, world)
    if chosen is None:
        raise ConfigError(_no_default_strategy(model_cls, world, plugins.names("strategy")))
    return chosen


def _no_default_strategy(model_cls: type | None, world: int, installed: list[str]) -> str:
    from twinkle_core.catalog import PROVIDERS

    provided: dict[str, list[str]] = {}
    for (kind, name), dist in PROVIDERS.items():
        if kind == "strategy" and name not in installed:
            provided.setdefault(dist, []).append(name)
    model = f" of {model_cls.__name__}" if model_cls is not None else ""
    hint = "; ".join(f"pip install {dist} ({', '.join(sorted(names))})" for dist, names in sorted(provided.items()))
    return (f"no installed plugin chooses the strategy of a {world}-process job{model}: name one (strategy.name "
            f"in a recipe, strategy= in Python) among the installed strategies ({', '.join(installed) or 'none'})"
            + (f", or install a backend that provides one: {hint}" if hint else ""))


def suggest_spec_key(key: str) -> str | None:
    """``tp_sise`` -> ``tp_size``: the spec key a misspelt name was probably meant to be."""
    close = difflib.get_close_matches(str(key), list(SPEC_KEYS), n=1, cutoff=0.8)
    return close[0] if close else None


def pop_spec_sizes(values: MutableMapping[str, Any], where: str = "") -> tuple[dict[str, int], bool | None]:
    """Remove the spec's size keys (``tp_size``, ``pp_size``, ``dp_size``, ``ep_size``, ``sequence_parallel``, ...)
    from ``values``; return ``({spec key: size}, tensor_sequence_parallel)``.

    ``sequence_parallel`` given as ``True`` / ``False`` is not a size: it is returned separately (Megatron's
    sequence parallelism inside tensor-parallel regions, a strategy option). ``where`` prefixes messages.
    """
    sizes: dict[str, int] = {}
    given: dict[str, str] = {}
    flag: bool | None = None
    for key in [k for k in values if k in SPEC_KEYS]:
        value = values.pop(key)
        dim = SPEC_KEYS[key]
        if key == "sequence_parallel" and isinstance(value, bool):
            flag = value
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{where}{key} must be a positive integer (the {dim} size of the mesh), got {value!r}")
        if dim in sizes and sizes[dim] != value:
            raise ConfigError(f"{where}{given[dim]}={sizes[dim]} and {where}{key}={value} set the same mesh "
                              f"dimension ({dim}) differently; give one")
        sizes[dim], given[dim] = value, key
    return {given[dim]: size for dim, size in sizes.items()}, flag


def merge_spec_sizes(mesh: DeviceMesh | Mapping[str, int] | None, sizes: Mapping[str, int], *,
                     mesh_name: str = "mesh", where: str = "") -> dict[str, int] | DeviceMesh | None:
    """``mesh`` with the spec keys' ``sizes`` (``{"tp_size": 2}``) added as mesh dimensions (``{"tp": 2}``);
    a size that contradicts the mesh is a :class:`ConfigError`.

    Without ``sizes`` the mesh comes back as given. A :class:`DeviceMesh`'s sizes of 1 count as unset.
    """
    if not sizes:
        return mesh
    if isinstance(mesh, DeviceMesh):
        merged = {dim: size for dim, size in mesh.to_dict().items() if size != 1}
    else:
        merged = dict(mesh or {})
    for key, size in sizes.items():
        dim = SPEC_KEYS[key]
        if dim in merged and merged[dim] != size:
            raise ConfigError(f"{where}{key}={size} contradicts {mesh_name}.{dim}={merged[dim]}: they are "
                              f"the same setting (the {dim} size of the mesh); give one")
        merged[dim] = size
    return merged
