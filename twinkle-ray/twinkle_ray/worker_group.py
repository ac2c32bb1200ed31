"""A worker group: N Ray actors, placed by a placement group, that form one ``torch.distributed`` group.

::

    with connected():                                  # a local cluster, or connected(address="HOST:PORT")
        group = WorkerGroup(2, role="trainer")
        try:
            results = group.run("identity")            # one call on every rank, results in rank order
        finally:
            group.shutdown()

Every call the controller makes goes through :meth:`WorkerGroup.wait`, which watches all ranks at once: when an
actor dies or raises, the others are stopped within seconds (a peer blocked in a collective would otherwise wait
for the collective timeout) and one :class:`WorkerFailedError` names the role, the rank and the cause.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from twinkle_core.errors import ConfigError, TwinkleError
from twinkle_ray.cluster import node_addresses, ray_module
from twinkle_ray.rank_layout import Placed, rank_environments
from twinkle_ray.worker import TwinkleWorker

logger = logging.getLogger("twinkle.ray")

#: the environment a worker inherits from the controller (a remote node does not share the driver's environment)
FORWARDED_PREFIXES = ("TWINKLE_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "DS_", "OMP_", "MKL_", "TORCH_",
                      "NCCL_", "HCCL_", "GLOO_", "PYTHONHASHSEED", "CUBLAS_", "PYTORCH_")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: how long the other ranks get to fail after the first failure, so that the root cause is the one reported
ROOT_CAUSE_GRACE_S = 5.0


class WorkerFailedError(TwinkleError, RuntimeError):
    """A rank of a worker group died or raised; the group was stopped."""

    def __init__(self, role: str, rank: int, cause: str, *, died: bool = False) -> None:
        super().__init__(f"{role} rank {rank} failed: {cause}")
        self.role = role
        self.rank = rank
        self.cause = cause
        #: the rank's process died (rather than raising)
        self.died = died


def forwarded_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}
    env.update(extra or {})
    return env


class WorkerGroup:
    """``num_workers`` actors of role ``role``, one bundle each in a placement group.

    ``placement``: Ray's placement strategy (``PACK`` keeps the group on as few nodes as possible,
    ``STRICT_SPREAD`` puts every rank on its own node). ``cpus_per_worker`` / ``gpus_per_worker`` are each
    bundle's resources; ``resources`` adds custom ones (e.g. ``{"node:trainer": 1}``). ``env`` is added to the
    controller's forwarded environment. ``ready_timeout_s`` bounds the wait for the cluster to have room.
    """

    def __init__(self, num_workers: int, *, role: str = "trainer", cpus_per_worker: float = 1.0,
                 gpus_per_worker: float = 0.0, resources: dict[str, float] | None = None, placement: str = "PACK",
                 env: dict[str, str] | None = None, ready_timeout_s: float = 120.0) -> None:
        ray = ray_module()
        if not ray.is_initialized():
            raise ConfigError("no Ray cluster is connected: wrap the code in `with twinkle_ray.cluster.connected():` "
                              "or call ray.init() first")
        if num_workers < 1:
            raise ConfigError(f"a worker group needs at least 1 worker, got {num_workers}")
        if placement.upper() not in PLACEMENT_STRATEGIES:
            raise ConfigError(f"placement {placement!r} is not one of {', '.join(PLACEMENT_STRATEGIES)}")
        self.role = role
        self.num_workers = num_workers
        self.placement_group = self._reserve(num_workers, cpus_per_worker, gpus_per_worker, resources or {},
                                             placement.upper(), ready_timeout_s)
        self.actors: list[Any] = []
        try:
            self._start_actors(cpus_per_worker, gpus_per_worker, forwarded_environment(env))
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ start
    def _reserve(self, count: int, cpus: float, gpus: float, resources: dict[str, float], strategy: str,
                 timeout_s: float) -> Any:
        from ray.util.placement_group import placement_group, remove_placement_group

        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **resources}
        group = placement_group([dict(bundle) for _ in range(count)], strategy=strategy)
        ray = ray_module()
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(group)
            raise ConfigError(f"the Ray cluster has no room for {count} {self.role} workers of {bundle} with "
                              f"placement {strategy} within {timeout_s:.0f} s; available: "
                              f"{ray.available_resources()}. Lower --num-workers or the resources per worker, "
                              f"or add nodes")
        return group

    def _start_actors(self, cpus: float, gpus: float, env: dict[str, str]) -> None:
        ray = ray_module()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = ray.remote(TwinkleWorker)
        for index in range(self.num_workers):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=index)
            self.actors.append(actor_class.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=strategy,
                                                   max_restarts=0, max_concurrency=1).remote(env))
        identities = self.run("identity")
        addresses = node_addresses()
        placed = [Placed(i["node_id"], addresses[i["node_id"]], i["accelerator_ids"]) for i in identities]
        self.pids = [i["pid"] for i in identities]
        self.nodes = [p.node_id for p in placed]
        port = self.wait([self.actors[0].free_port.remote(placed[0].address)])[0]
        envs = rank_environments(placed, port)
        self.wait([actor.set_environment.remote(e) for actor, e in zip(self.actors, envs)])
        logger.info("%s group: %d workers on %d node(s), rendezvous %s:%d", self.role, self.num_workers,
                    len(set(self.nodes)), placed[0].address, port)

    # ------------------------------------------------------------------ calls
    def run(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on every rank; the results in rank order."""
        return self.wait([getattr(actor, method).remote(*args, **kwargs) for actor in self.actors], timeout_s)

    def run_each(self, method: str, per_rank_args: Sequence[tuple[Any, ...]], timeout_s: float | None = None,
                 ) -> list[Any]:
        """Call ``method(*per_rank_args[r])`` on rank ``r``; the results in rank order."""
        if len(per_rank_args) != self.num_workers:
            raise ValueError(f"{len(per_rank_args)} argument tuples for {self.num_workers} workers")
        return self.wait([getattr(a, method).remote(*args) for a, args in zip(self.actors, per_rank_args)],
                         timeout_s)

    def wait(self, futures: Sequence[Any], timeout_s: float | None = None) -> list[Any]:
        """The results of one future per rank. The first rank that fails stops the group (WorkerFailedError)."""
        ray = ray_module()
        pending = {future: rank for rank, future in enumerate(futures)}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results: dict[int, Any] = {}
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
            if not done:
                self.shutdown()
                raise WorkerFailedError(self.role, min(pending.values()), f"no answer within {timeout_s:.0f} s")
            for future in done:
                rank = pending.pop(future)
                outcome = self._outcome(future, rank)
                if isinstance(outcome, WorkerFailedError):
                    raise self._root_cause(outcome, pending)
                results[rank] = outcome
        return [results[rank] for rank in range(len(futures))]

    def _root_cause(self, first: WorkerFailedError, pending: dict[Any, int]) -> WorkerFailedError:
        """The failure to report once ``first`` happened: a peer of a dead rank fails in its collective at once
        ("connection closed by peer"), often before Ray reports the death, so the others get a moment to fail
        too, and a dead actor is named before a rank that merely lost it. Then the group is stopped."""
        ray = ray_module()
        failures = [first]
        if pending:
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=ROOT_CAUSE_GRACE_S)
            failures += [f for f in (self._outcome(future, pending[future]) for future in done)
                         if isinstance(f, WorkerFailedError)]
        self.shutdown()
        return min(failures, key=lambda f: (not f.died, f.rank))

    def _outcome(self, future: Any, rank: int) -> Any:
        """The rank's result, or the WorkerFailedError that describes its failure."""
        ray = ray_module()
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(future)
        except RayActorError as exc:
            return WorkerFailedError(self.role, rank, f"the actor died ({describe_death(exc)})", died=True)
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, TwinkleError):  # the rank's own clear error, e.g. a bad recipe value
                return WorkerFailedError(self.role, rank, f"{type(cause).__name__}: {cause}")
            return WorkerFailedError(self.role, rank, last_line(str(exc)))

    # ------------------------------------------------------------------ stop
    def shutdown(self) -> None:
        """Kill every actor and free the placement group (idempotent)."""
        ray = ray_module()
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def describe_death(exc: Exception) -> str:
    text = str(exc)
    for marker in ("killed", "SIGKILL", "exit", "OOM", "memory"):
        if marker.lower() in text.lower():
            return last_line(text)
    return type(exc).__name__


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"
