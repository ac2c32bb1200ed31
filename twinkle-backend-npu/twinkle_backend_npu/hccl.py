"""HCCL job environment: per-job ports, the visible device of each rank, timeouts from the core's setting.

Called by :meth:`NPUAccelerator.configure_distributed_env` before the process group starts (HCCL
reads these variables when it creates a communicator). Every function only fills variables the user
left unset: an explicit ``HCCL_*`` setting always wins.

Ports. HCCL listens on host ports (``HCCL_IF_BASE_PORT``: 16 ports from the base, default 60000;
``HCCL_HOST_SOCKET_PORT_RANGE``, which takes precedence over it) and device ports
(``HCCL_NPU_SOCKET_PORT_RANGE``). Two jobs on one host that both use the defaults collide. Each job
gets its own block of :data:`BLOCK` ports, picked from ``MASTER_PORT`` (which torchrun already keeps
distinct per job on a host), so jobs whose master ports differ by less than the number of blocks
never share a port. Multi-node jobs go through torchrun as elsewhere: every node sees the same
``MASTER_PORT`` and so derives the same block.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from twinkle_core.errors import ConfigError

#: the port variables HCCL reads; when the user set any of them we set none (they interact)
PORT_VARIABLES = ("HCCL_IF_BASE_PORT", "HCCL_HOST_SOCKET_PORT_RANGE", "HCCL_NPU_SOCKET_PORT_RANGE")
#: ports handed to one job: 16 from HCCL_IF_BASE_PORT, 16 host socket ports, 16 device socket ports, 16 spare
BLOCK = 64
#: the region the blocks come from: above Linux's default ephemeral range (32768-60999), below 65536
REGION = (61000, 65472)
#: HCCL_CONNECT_TIMEOUT's accepted range in seconds (CANN documentation)
CONNECT_TIMEOUT_RANGE = (120, 7200)
#: HCCL_EXEC_TIMEOUT's accepted range in seconds (CANN documentation)
EXEC_TIMEOUT_RANGE = (1, 17340)


def port_block(master_port: int) -> int:
    """The first port of this job's block; the block never contains ``master_port`` itself."""
    slots = (REGION[1] - REGION[0]) // BLOCK
    slot = master_port % slots
    start = REGION[0] + slot * BLOCK
    if start <= master_port < start + BLOCK:
        start = REGION[0] + ((slot + 1) % slots) * BLOCK
    return start


def job_ports(master_port: int) -> dict[str, str]:
    start = port_block(master_port)
    return {
        "HCCL_IF_BASE_PORT": str(start),
        "HCCL_HOST_SOCKET_PORT_RANGE": f"{start + 16}-{start + 31}",
        "HCCL_NPU_SOCKET_PORT_RANGE": f"{start + 32}-{start + 47}",
    }


def _clamp(value: float, bounds: tuple[int, int]) -> int:
    return max(bounds[0], min(bounds[1], int(value)))


def job_timeouts(timeout_s: float) -> dict[str, str]:
    """HCCL's link-setup and execution timeouts, both the core's collective timeout (within HCCL's ranges)."""
    return {"HCCL_CONNECT_TIMEOUT": str(_clamp(timeout_s, CONNECT_TIMEOUT_RANGE)),
            "HCCL_EXEC_TIMEOUT": str(_clamp(timeout_s, EXEC_TIMEOUT_RANGE))}


def visible_device_index(local_rank: int, env: MutableMapping[str, str] | None = None) -> int:
    """The device index this rank binds to, after checking ``ASCEND_RT_VISIBLE_DEVICES`` leaves it one.

    With ``ASCEND_RT_VISIBLE_DEVICES=4,5`` the runtime shows physical NPUs 4 and 5 as devices 0 and 1,
    so local rank ``i`` binds to index ``i``, and a rank beyond the list is a launch error.
    """
    env = os.environ if env is None else env
    raw = env.get("ASCEND_RT_VISIBLE_DEVICES")
    if raw is None or not raw.strip():
        return local_rank
    visible = [item.strip() for item in raw.split(",") if item.strip()]
    if local_rank >= len(visible):
        raise ConfigError(f"local rank {local_rank} has no NPU: ASCEND_RT_VISIBLE_DEVICES={raw!r} makes "
                          f"{len(visible)} visible; launch at most {len(visible)} processes per node "
                          f"(--nproc-per-node {len(visible)}) or list more devices")
    return local_rank


def configure_job_env(timeout_s: float, env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Fill the HCCL variables this job needs into ``env`` (default ``os.environ``); return what was set."""
    env = os.environ if env is None else env
    wanted: dict[str, str] = dict(job_timeouts(timeout_s))
    master_port = env.get("MASTER_PORT")
    if master_port and not any(name in env for name in PORT_VARIABLES):
        if not master_port.isdigit():
            raise ConfigError(f"MASTER_PORT={master_port!r} is not a port number; torchrun sets it, or set "
                              f"HCCL_IF_BASE_PORT yourself")
        wanted.update(job_ports(int(master_port)))
    added = {name: value for name, value in wanted.items() if name not in env}
    env.update(added)
    return added
