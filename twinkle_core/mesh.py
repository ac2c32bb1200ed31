"""The shape of a parallel job: how the world's ranks split across parallel dimensions."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from twinkle_core.errors import ConfigError

#: dimensions whose sizes multiply to the world size (the one list of them: everything else derives from it)
RANK_DIMENSIONS = ("dp", "fsdp", "tp", "pp", "cp", "sp")
#: every parallel dimension; ``ep`` is carved out of the data-parallel ranks, ``vpp`` splits pipeline stages
DIMENSIONS = (*RANK_DIMENSIONS, "ep")
ALL_DIMENSIONS = (*DIMENSIONS, "vpp")


@dataclass(frozen=True)
class DeviceMesh:
    """Sizes of each parallel dimension.

    * ``dp`` — replicated data parallel; ``fsdp`` — sharded data parallel;
    * ``tp`` tensor, ``pp`` pipeline (``vpp`` virtual stages per pipeline rank), ``cp`` context,
      ``sp`` Ulysses sequence parallel, ``ep`` expert parallel (carved out of the data-parallel ranks).

    ``dp * fsdp * tp * pp * cp * sp`` must equal the world size; ``ep`` must divide the
    data-parallel size. ``DeviceMesh.infer(world_size, tp=2)`` fills ``dp`` from the rest.
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
        unknown = set(sizes) - set(ALL_DIMENSIONS)
        if unknown:
            raise ConfigError(f"unknown mesh dimension(s) {sorted(unknown)}; known: {', '.join(ALL_DIMENSIONS)}")
        if "dp" not in sizes:
            others = math.prod(sizes.get(d, 1) for d in RANK_DIMENSIONS if d != "dp")
            if world % others:
                raise ConfigError(f"world size {world} is not divisible by the model-parallel sizes {sizes}")
            sizes["dp"] = world // others
        return cls(**sizes).validate(world)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)
