"""Connecting to Ray: an existing cluster when an address is given (or ``RAY_ADDRESS`` is set), else a local one.

A local cluster is started on the loopback address, so nothing listens on an outside interface, and it is shut
down again by whoever started it: :func:`connected` is a context manager that leaves a cluster it found running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from twinkle_core.errors import ConfigError

logger = logging.getLogger("twinkle.ray")

#: Ray binds a local cluster to the machine's outward address unless this is off (read when ray is imported)
LOCAL_ONLY_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def ray_module(*, local_only: bool = False) -> Any:
    """``ray``, or a ConfigError naming the install when it is missing.

    ``local_only``: when this call is the first import of ray, keep a cluster it starts on the loopback address
    (a job's private cluster has no reason to listen on the network; Ray's own switch for single-machine use).
    """
    if local_only and "ray" not in sys.modules:
        os.environ.setdefault(LOCAL_ONLY_VARIABLE, "0")
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("the Ray runtime needs the `ray` package: pip install twinkle-ray "
                          f"(or pip install 'ray>=2.40'); importing it failed: {exc}") from exc
    return ray


@contextlib.contextmanager
def connected(address: str | None = None, *, num_cpus: int | None = None, num_gpus: int | None = None,
              ) -> Iterator[Any]:
    """Yield ``ray`` connected to a cluster for the duration of the block.

    ``address``: ``"auto"`` or ``HOST:PORT`` of a running cluster (``ray start --head``), or ``None`` for
    ``RAY_ADDRESS`` when set and otherwise a new local cluster with ``num_cpus`` / ``num_gpus``. A cluster this
    call started is shut down on exit; one that was already connected (e.g. by the caller's ``ray.init``) is
    left as it was.
    """
    address = address or os.environ.get("RAY_ADDRESS") or None
    ray = ray_module(local_only=address is None)
    if ray.is_initialized():
        yield ray
        return
    options: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if address is None:
        # "local": a new cluster for this job even when `ray start` ran on this machine before (ray.init() would
        # join that one, or fail on what it left behind)
        options.update(num_cpus=num_cpus, num_gpus=num_gpus)
    try:
        ray.init(address=address or "local", **options)
    except ConnectionError as exc:
        raise ConfigError(f"cannot connect to the Ray cluster at {address!r}: {exc}. Start one with "
                          "`ray start --head` on the head machine, or leave --ray-address out to run a local "
                          "cluster") from exc
    try:
        yield ray
    finally:
        ray.shutdown()


def node_addresses() -> dict[str, str]:
    """``{node id: IP address}`` of the cluster's live nodes (the address other nodes reach it on)."""
    ray = ray_module()
    return {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")}
