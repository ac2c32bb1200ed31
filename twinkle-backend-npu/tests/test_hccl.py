"""HCCL job environment: per-job ports from MASTER_PORT, visible devices, timeouts, user values kept."""

from __future__ import annotations

import os

import pytest
from twinkle_backend_npu import hccl

from twinkle_core.accelerator import current_accelerator
from twinkle_core.distributed import DEFAULT_TIMEOUT_S
from twinkle_core.errors import ConfigError


def ports_of(env: dict[str, str]) -> set[int]:
    """Every port the HCCL variables in ``env`` hand out (HCCL_IF_BASE_PORT takes 16 from its base)."""
    base = int(env["HCCL_IF_BASE_PORT"])
    taken = set(range(base, base + 16))
    for name in ("HCCL_HOST_SOCKET_PORT_RANGE", "HCCL_NPU_SOCKET_PORT_RANGE"):
        low, high = map(int, env[name].split("-"))
        taken |= set(range(low, high + 1))
    return taken


def test_a_job_gets_ports_and_timeouts_from_master_port_and_the_core_timeout():
    env = {"MASTER_PORT": "29500"}
    added = hccl.configure_job_env(DEFAULT_TIMEOUT_S, env)
    assert set(added) == {*hccl.PORT_VARIABLES, "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT"}
    assert env["HCCL_CONNECT_TIMEOUT"] == env["HCCL_EXEC_TIMEOUT"] == str(int(DEFAULT_TIMEOUT_S))
    assert len(ports_of(env)) == 48 and all(61000 <= p < 65536 for p in ports_of(env))


def test_jobs_on_one_host_never_share_a_port():
    # torchrun jobs on one host have distinct master ports, typically close together (29500, 29501 ...)
    slots = (hccl.REGION[1] - hccl.REGION[0]) // hccl.BLOCK
    jobs = [hccl.job_ports(port) for port in range(29500, 29500 + slots)]
    for i, a in enumerate(jobs):
        for b in jobs[i + 1:]:
            assert not ports_of(a) & ports_of(b), (a, b)


@pytest.mark.parametrize("master_port", [61000, 61063, 65000, 65471])
def test_a_job_block_never_holds_its_own_master_port(master_port):
    assert master_port not in ports_of(hccl.job_ports(master_port))


def test_values_the_user_set_are_kept():
    env = {"MASTER_PORT": "29500", "HCCL_IF_BASE_PORT": "50000", "HCCL_EXEC_TIMEOUT": "3600"}
    added = hccl.configure_job_env(DEFAULT_TIMEOUT_S, env)
    # one port variable set by the user: none of ours (HCCL_HOST_SOCKET_PORT_RANGE would override theirs)
    assert added == {"HCCL_CONNECT_TIMEOUT": "600"}
    assert env["HCCL_IF_BASE_PORT"] == "50000" and env["HCCL_EXEC_TIMEOUT"] == "3600"


def test_timeouts_stay_within_hccl_ranges():
    assert hccl.job_timeouts(30) == {"HCCL_CONNECT_TIMEOUT": "120", "HCCL_EXEC_TIMEOUT": "30"}
    assert hccl.job_timeouts(10**6) == {"HCCL_CONNECT_TIMEOUT": "7200", "HCCL_EXEC_TIMEOUT": "17340"}


def test_without_master_port_only_timeouts_are_set():
    env: dict[str, str] = {}
    hccl.configure_job_env(DEFAULT_TIMEOUT_S, env)
    assert set(env) == {"HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT"}
    with pytest.raises(ConfigError, match="MASTER_PORT='abc' is not a port number"):
        hccl.configure_job_env(DEFAULT_TIMEOUT_S, {"MASTER_PORT": "abc"})


def test_visible_devices_bound_the_local_ranks():
    env = {"ASCEND_RT_VISIBLE_DEVICES": "4,5"}
    assert [hccl.visible_device_index(rank, env) for rank in (0, 1)] == [0, 1]
    with pytest.raises(ConfigError, match=r"local rank 2 has no NPU: ASCEND_RT_VISIBLE_DEVICES='4,5' makes 2 "
                                          r"visible; launch at most 2 processes per node \(--nproc-per-node 2\)"):
        hccl.visible_device_index(2, env)
    assert hccl.visible_device_index(5, {}) == 5


def test_the_accelerator_sets_the_job_env_before_the_process_group(fake_npu, monkeypatch):
    for name in (*hccl.PORT_VARIABLES, "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)  # conftest puts back what this test's accelerator adds
    monkeypatch.setenv("MASTER_PORT", "29511")
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "900")  # set by the user: kept
    assert current_accelerator().name == "npu"
    assert os.environ["HCCL_IF_BASE_PORT"] == hccl.job_ports(29511)["HCCL_IF_BASE_PORT"]
    assert os.environ["HCCL_CONNECT_TIMEOUT"] == "900" and os.environ["HCCL_EXEC_TIMEOUT"] == "600"


def test_a_rank_without_a_visible_npu_is_refused_when_binding(fake_npu, monkeypatch):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match="local rank 1 has no NPU"):
        current_accelerator().set_device()
    assert not fake_npu.called("set_device")
