"""twinkle_core.testing.isolation: a block ends the process group it started, and only that one."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from twinkle_core.testing.isolation import describe_leaked_group, process_group_scope


@pytest.fixture(autouse=True)
def _outside_torchrun(monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized(), describe_leaked_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _start_one_rank_group() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_a_group_started_inside_is_destroyed_after_the_state_built_on_it():
    order = []
    with process_group_scope(before_destroy=lambda: order.append(("release", dist.is_initialized()))):
        _start_one_rank_group()
        assert describe_leaked_group() is not None
    assert order == [("release", True)]
    assert not dist.is_initialized()
    assert describe_leaked_group() is None


def test_a_group_alive_on_entry_is_left_alone():
    _start_one_rank_group()
    with process_group_scope(before_destroy=lambda: pytest.fail("not this block's group")):
        pass
    assert dist.is_initialized()
    assert "'gloo' process group of world size 1" in describe_leaked_group()


def test_nothing_started_means_nothing_released():
    with process_group_scope(before_destroy=lambda: pytest.fail("no group was started")):
        pass
    assert not dist.is_initialized()


def test_torchrun_ranks_keep_their_job_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with process_group_scope():
        _start_one_rank_group()
    assert dist.is_initialized()
    assert describe_leaked_group() is None
