"""Worker groups on a real local Ray cluster: ranks form one torch.distributed group; a dead rank stops the group
within seconds with its role and rank named; nothing is left running afterwards."""

from __future__ import annotations

import os
import signal
import time

import pytest
from twinkle_ray.worker_group import WorkerFailedError, WorkerGroup

from twinkle_core.errors import ConfigError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def all_reduce_ranks(_: object = None) -> float:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value.item()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie left for Ray's raylet to reap counts as gone
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def wait_gone(pids: list[int], seconds: float = 20.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.2)
    return left


def test_ranks_get_torchruns_environment_and_form_one_group(ray_cluster, worker_env):
    with WorkerGroup(2, env=worker_env) as group:
        envs = group.run("environment", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "OMP_NUM_THREADS"])
        assert [e["RANK"] for e in envs] == ["0", "1"]
        assert {e["WORLD_SIZE"] for e in envs} == {"2"}
        assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}  # the local cluster stays on loopback
        assert {e["OMP_NUM_THREADS"] for e in envs} == {worker_env["OMP_NUM_THREADS"]}  # forwarded
        assert group.run("apply", all_reduce_ranks) == [3.0, 3.0]
        pids = list(group.pids)
    assert wait_gone(pids) == [], "actors outlived their group"


def test_a_killed_rank_stops_the_group_within_seconds_naming_it(ray_cluster, worker_env):
    group = WorkerGroup(2, role="trainer", env=worker_env)
    pids = list(group.pids)
    try:
        group.run("apply", all_reduce_ranks)
        futures = [actor.apply.remote(blocked_in_collective) for actor in group.actors]
        time.sleep(1.0)  # both ranks are now inside the collective; rank 1 dies there
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerFailedError) as failure:
            group.wait(futures)
        elapsed = time.monotonic() - start
    finally:
        group.shutdown()
    assert failure.value.role == "trainer" and failure.value.rank == 1, failure.value
    assert "trainer rank 1 failed" in str(failure.value) and "died" in str(failure.value)
    assert elapsed < 15, f"took {elapsed:.1f} s to notice"
    assert wait_gone(pids) == [], "rank 0, blocked in the collective, was left running"


def blocked_in_collective(_: object = None) -> float:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)  # killed here
    value = torch.ones(1)
    dist.all_reduce(value)  # rank 0 waits here for rank 1
    return value.item()


def test_an_error_in_a_rank_is_named_with_its_cause(ray_cluster, worker_env):
    with WorkerGroup(2, role="sampler", env=worker_env) as group:
        with pytest.raises(WorkerFailedError, match=r"sampler rank 0 failed: .*ConfigError: bad option"):
            group.run("apply", raise_config_error)


def raise_config_error(_: object = None) -> None:
    if os.environ["RANK"] == "1":
        time.sleep(600)  # rank 1 would wait forever for rank 0 in a real job; the group stops it
    raise ConfigError("bad option")


def test_a_group_larger_than_the_cluster_is_refused_with_the_resources(ray_cluster):
    with pytest.raises(ConfigError, match=r"no room for 3 trainer workers .* available"):
        WorkerGroup(3, cpus_per_worker=2.0, ready_timeout_s=3)
