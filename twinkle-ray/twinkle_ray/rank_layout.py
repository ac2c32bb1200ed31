"""The environment each actor of a worker group gets: what ``torchrun`` would give the same process.

Pure functions of where Ray placed the actors, so they are tested without a cluster. On accelerators Ray shows
each actor only its own devices; torchrun shows every process all devices of its node and picks one by
``LOCAL_RANK``. The layout restores torchrun's view: every actor of the group on a node sees the union of the
group's devices there, and its ``LOCAL_RANK`` is the position of its own device in that list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

#: Ray's accelerator resource name → the variable that lists the visible devices
VISIBLE_DEVICES = {"GPU": "CUDA_VISIBLE_DEVICES", "NPU": "ASCEND_RT_VISIBLE_DEVICES"}


@dataclass(frozen=True)
class Placed:
    """Where one actor runs: its node, the node's address, and the accelerator ids Ray assigned it."""

    node_id: str
    address: str
    accelerator_ids: dict[str, list[str]] = field(default_factory=dict)


def rank_environments(placed: Sequence[Placed], master_port: int) -> list[dict[str, str]]:
    """``RANK`` ... ``MASTER_PORT`` (and visible devices) for each actor, in rank order.

    Ranks follow the given order; nodes are numbered in order of first appearance (rank 0's node is node 0, whose
    address is the rendezvous address), and local ranks in order of rank within a node.
    """
    if not placed:
        raise ValueError("a worker group needs at least one actor")
    nodes: list[str] = []
    for actor in placed:
        if actor.node_id not in nodes:
            nodes.append(actor.node_id)
    per_node = {node: [i for i, actor in enumerate(placed) if actor.node_id == node] for node in nodes}
    envs = []
    for rank, actor in enumerate(placed):
        peers = per_node[actor.node_id]
        env = {"RANK": str(rank), "WORLD_SIZE": str(len(placed)), "LOCAL_RANK": str(peers.index(rank)),
               "LOCAL_WORLD_SIZE": str(len(peers)), "GROUP_RANK": str(nodes.index(actor.node_id)),
               "NODE_RANK": str(nodes.index(actor.node_id)), "MASTER_ADDR": placed[0].address,
               "MASTER_PORT": str(master_port)}
        env.update(visible_devices(actor, [placed[i] for i in peers]))
        envs.append(env)
    return envs


def visible_devices(actor: Placed, node_peers: Sequence[Placed]) -> dict[str, str]:
    """The visible-devices variables for ``actor`` and its ``LOCAL_RANK`` when it holds accelerators."""
    env: dict[str, str] = {}
    for resource, variable in VISIBLE_DEVICES.items():
        own = actor.accelerator_ids.get(resource) or []
        if not own:
            continue
        union = sorted({d for peer in node_peers for d in peer.accelerator_ids.get(resource, [])}, key=device_order)
        env[variable] = ",".join(union)
        env["LOCAL_RANK"] = str(union.index(own[0]))
    return env


def device_order(device_id: str) -> tuple[int, str]:
    return (int(device_id), "") if device_id.isdigit() else (1 << 30, device_id)
