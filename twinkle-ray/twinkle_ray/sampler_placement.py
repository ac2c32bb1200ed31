"""Where the ``ray`` sampler's actor runs: ``task_options.sampler.placement``.

``split`` (default)
    The actor reserves its own ``num_cpus`` / ``num_gpus`` wherever the cluster has room.
``colocated``
    The actor time-shares trainer rank 0's placement-group bundle: it is scheduled into that bundle requesting no
    resources of its own (``num_cpus=0``, ``num_gpus=0``) and is shown the accelerators Ray assigned rank 0, so
    its copy of the policy lives on rank 0's device. The bundle is found from inside rank 0's actor: its placement
    group from :func:`ray.util.get_current_placement_group`; its bundle index from the worker group's layout (rank
    ``r`` holds bundle ``r``, :class:`~twinkle_ray.worker_group.WorkerGroup`), since Ray 2.60 tells an actor
    neither its bundle index (``RuntimeContext.get_assigned_resources`` leaves it out) nor a public way to ask;
    that the bundle sits on rank 0's node is checked against :func:`ray.util.placement_group_table`.

Time-sharing: generation and training take turns. Every rank waits after each ``sample`` call until all ranks'
calls are done (no rank trains while the shared actor still generates for another), and the sampler's
``overlap_refusal`` (the core's seam the RL tasks consult before their first asynchronous rollout) refuses
one-step-off rollouts, which would sample while the policy trains.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from twinkle_core.errors import ConfigError, TwinkleError
from twinkle_ray.rank_layout import VISIBLE_DEVICES

logger = logging.getLogger("twinkle.ray")

PLACEMENTS = ("split", "colocated")
#: the sampler's answer to ``Sampler.overlap_refusal`` when colocated (the RL tasks refuse one-step-off with it)
COLOCATED_OVERLAP = ("the ray sampler's placement: colocated time-shares trainer rank 0's bundle, so generation and "
                     "training must take turns: set task_options.one_step_off: false, or "
                     "task_options.sampler.placement: split")
#: where a colocated sampler puts its copy of the policy, by the accelerator Ray assigned trainer rank 0
DEVICES = {"GPU": "cuda", "NPU": "npu"}


@dataclass(frozen=True)
class ActorPlacement:
    """How to start the sampler actor: Ray's actor ``options``, the ``env`` it sets before it builds anything
    (the visible devices), the ``device`` its copy of the policy goes to, and ``bundle`` (colocated only)."""

    options: dict[str, Any]
    device: str = "cpu"
    env: dict[str, str] = field(default_factory=dict)
    bundle: int | None = None


def check_placement(placement: Any, num_cpus: float | None, num_gpus: float | None) -> None:
    if placement not in PLACEMENTS:
        raise ConfigError(f"the ray sampler's placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if placement == "colocated" and (num_cpus is not None or num_gpus is not None):
        raise ConfigError("the ray sampler's num_cpus / num_gpus reserve a split actor's own resources; placement: "
                          "colocated shares trainer rank 0's bundle (sized by --cpus-per-worker / --gpus-per-worker): "
                          "remove them, or use placement: split")


def split(num_cpus: float | None, num_gpus: float | None) -> ActorPlacement:
    num_cpus, num_gpus = 1.0 if num_cpus is None else num_cpus, num_gpus or 0.0
    return ActorPlacement({"num_cpus": num_cpus, "num_gpus": num_gpus}, device="cuda" if num_gpus else "cpu")


def colocated(rank: int) -> ActorPlacement:
    """The placement in trainer rank ``rank``'s bundle (called in that rank's actor)."""
    import ray
    from ray.util.placement_group import get_current_placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = get_current_placement_group()
    if group is None:
        raise ConfigError("the ray sampler's placement: colocated shares trainer rank 0's placement-group bundle, but "
                          "rank 0 runs in no Ray placement group (a process that called ray.init() itself): train "
                          "with `twinkle train --runtime ray`, or use placement: split")
    context = ray.get_runtime_context()
    if placement_group_table(group).get("bundles_to_node_id", {}).get(rank) != context.get_node_id():
        raise ConfigError(f"the ray sampler's placement: colocated expects trainer rank {rank} in bundle {rank} of its "
                          f"placement group (the layout of `twinkle train --runtime ray`); this group is laid out "
                          f"otherwise: use placement: split")
    env, device = visible_devices(context.get_accelerator_ids())
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
    return ActorPlacement({"num_cpus": 0, "num_gpus": 0, "scheduling_strategy": strategy}, device=device, env=env,
                          bundle=rank)


def check_colocated(found: dict[str, Any], bundle: int) -> None:
    """Check, and log, where the colocated actor runs by its own account (``SamplerWorker.placement``): in this
    actor's (trainer rank 0's) placement group, on its node."""
    import ray

    context = ray.get_runtime_context()
    if (found["placement_group_id"], found["node_id"]) != (context.get_placement_group_id(), context.get_node_id()):
        raise TwinkleError(f"the colocated sampler actor runs in placement group {found['placement_group_id']} on node "
                           f"{found['node_id']}, not in trainer rank 0's {context.get_placement_group_id()} on "
                           f"{context.get_node_id()}")
    logger.info("ray sampler colocated with trainer rank 0: placement group %s bundle %d, node %s, pid %d, "
                "resources of its own %s, devices %s", found["placement_group_id"], bundle, found["node_id"],
                found["pid"], found["resources"] or "none", found["devices"] or "none")


def visible_devices(accelerator_ids: dict[str, list[str]]) -> tuple[dict[str, str], str]:
    """The visible-devices variables that show a process the accelerators ``accelerator_ids`` (Ray's ids of trainer
    rank 0's), and the device the sampler's copy goes to."""
    env, device = {}, "cpu"
    for resource, variable in VISIBLE_DEVICES.items():
        if accelerator_ids.get(resource):
            env[variable] = ",".join(accelerator_ids[resource])
            device = DEVICES[resource] if device == "cpu" else device
    return env, device
