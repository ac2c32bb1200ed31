"""The data dimension of strategy ``ulysses``: DDP (the default) or FSDP2, composed into the strategy.

Every rank of a sequence group (``cp * sp`` ranks) holds the same parameters and back-propagates the token-*sum*
loss of its own chunk of the rows; the sequence groups hold other rows. The gradient of the global sum loss is
therefore the *sum* of every rank's gradient, over the sequence and the data-parallel ranks alike. Both wrappers
reduce over the whole world and average, so both yield ``sum / world`` and the strategy's
``gradient_scale(T) = world / T`` turns either into ``d(sum loss) / T``:

* ``ddp``: :class:`~twinkle_backend_hf.strategies.ddp.DDPStrategy` all-reduces over the world;
* ``fsdp``: :class:`~twinkle_backend_hf.strategies.fsdp.NativeFSDPStrategy` (FSDP2 ``fully_shard``, DCP optimizer
  checkpoints) shards every parameter over the world, the sequence ranks included: they hold identical
  parameters, so sharding over them saves memory by the group size, and the reduce-scatter that sums the
  sequence ranks' gradients is the one that sums the data-parallel ranks'. FSDP2 divides by the ranks it reduces
  over: ``sum / world``, as DDP. With both ``mesh.dp`` and ``mesh.fsdp`` > 1 it is HSDP, as under ``native_fsdp``:
  replicated over ``dp``, sharded over ``fsdp * cp * sp`` (blocks of consecutive ranks, whole sequence groups,
  since ranks are laid out ``dp``-major); the all-reduce over the replicas divides by ``dp``, again ``sum / world``.

Which one: ``strategy.options.data_parallel`` (``ddp`` or ``fsdp``); left out, ``fsdp`` when ``mesh.fsdp`` > 1,
else ``ddp``. The chosen strategy's own options pass through (``find_unused_parameters``, ``local_accumulation``
... for ``ddp``; ``reshard_after_forward``, ``mixed_precision``, ``full_state_dict_on_all_ranks`` for ``fsdp``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twinkle_backend_hf.strategies.ddp import DDPStrategy
from twinkle_backend_hf.strategies.fsdp import NativeFSDPStrategy
from twinkle_core.errors import ConfigError
from twinkle_core.mesh import DeviceMesh

if TYPE_CHECKING:
    from twinkle_core.precision import Precision
    from twinkle_core.strategy import Strategy

#: ``data_parallel`` value -> the strategy that synchronises the data dimension
STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDPStrategy, "fsdp": NativeFSDPStrategy}


def data_parallel_kind(data_parallel: str | None, mesh: DeviceMesh | None) -> str:
    """The ``data_parallel`` option's value, or its default for ``mesh`` (``fsdp`` when ``mesh.fsdp`` > 1)."""
    sharded_mesh = mesh is not None and mesh.fsdp > 1
    if data_parallel is None:
        return "fsdp" if sharded_mesh else "ddp"
    if data_parallel not in STRATEGIES:
        raise ConfigError(f"strategy 'ulysses': data_parallel must be one of {', '.join(STRATEGIES)}; "
                          f"got {data_parallel!r}")
    if sharded_mesh and data_parallel != "fsdp":
        raise ConfigError(f"strategy 'ulysses': mesh.fsdp={mesh.fsdp} shards the data dimension, but "
                          f"data_parallel is {data_parallel!r}; set data_parallel: fsdp, or move the ranks to "
                          f"mesh.dp")
    return data_parallel


def build(kind: str, precision: Precision | None, options: dict[str, Any]) -> Strategy:
    """The ``kind`` strategy with its own ``options``; its mesh is set by :func:`inner_mesh` at setup."""
    return STRATEGIES[kind](precision=precision, **options)


def inner_mesh(kind: str, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh the data-parallel strategy reduces (and, for ``fsdp``, shards) over: the whole world of ``mesh``,
    the sequence ranks included, replicated over ``dp`` only for HSDP (both ``dp`` and ``fsdp`` > 1)."""
    if kind == "ddp":
        return DeviceMesh(dp=mesh.world_size)
    if mesh.dp > 1 and mesh.fsdp > 1:
        return DeviceMesh(dp=mesh.dp, fsdp=mesh.world_size // mesh.dp)
    return DeviceMesh(fsdp=mesh.world_size)
