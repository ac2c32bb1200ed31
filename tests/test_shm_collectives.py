"""The shared-memory all-reduce (``twinkle_core.shm_collectives``): a 2-rank job against gloo, and the cases
where a job must join plain gloo instead."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from twinkle_core import distributed, shm_collectives
from twinkle_core.testing.torchrun import run_torchrun

JOB = Path(__file__).with_name("shm_collectives_job.py")


@pytest.mark.distributed
def test_two_ranks_all_reduce_through_shared_memory_as_gloo_does():
    result = run_torchrun([str(JOB)], nproc=2, timeout=240, per_rank_output=True)
    assert result.returncode == 0, result.output
    for rank, text in enumerate(result.rank_stdout):
        assert f"rank {rank}: shared-memory checks passed" in text, result.output


def test_a_gloo_job_joins_the_shared_memory_group_unless_switched_off(monkeypatch):
    monkeypatch.delenv(shm_collectives.ENV_SWITCH, raising=False)
    assert distributed.process_group_backend("gloo") == shm_collectives.BACKEND
    assert distributed.process_group_backend("nccl") == "nccl"
    monkeypatch.setenv(shm_collectives.ENV_SWITCH, "0")
    assert distributed.process_group_backend("gloo") == "gloo"
    assert shm_collectives.supported() == (False, f"{shm_collectives.ENV_SWITCH} is off")


def test_other_architectures_keep_gloo(monkeypatch):
    monkeypatch.delenv(shm_collectives.ENV_SWITCH, raising=False)
    monkeypatch.setattr(shm_collectives.platform, "machine", lambda: "aarch64")
    usable, reason = shm_collectives.supported()
    assert not usable and "aarch64" in reason
    assert distributed.process_group_backend("gloo") == "gloo"


def _store_of_rank_zero(path: str, token: str):
    import torch.distributed as dist

    store = dist.HashStore()
    store.set("twinkle_shm/path", path)
    store.set("twinkle_shm/token", token)
    store.add("twinkle_shm/arrived", 1)  # rank 0 mapped it
    return store


def test_a_peer_that_reads_another_token_makes_the_group_keep_gloos_all_reduce(tmp_path):
    """Another host's (or container's) /dev/shm can hold a file of the same name: the token tells them apart."""
    path = os.path.join(shm_collectives.SHM_DIR, f"twinkle-shm-test-{os.getpid()}")
    with open(path, "wb") as handle:
        handle.truncate(shm_collectives.Segment.nbytes(2))  # the right size, but zeros where the token goes
    try:
        store = _store_of_rank_zero(path, "a" * 64)
        assert shm_collectives._open_segment(store, rank=1, size=2, timeout_s=60) is None
    finally:
        os.unlink(path)
    missing = _store_of_rank_zero(os.path.join(shm_collectives.SHM_DIR, "twinkle-shm-not-there"), "a" * 64)
    assert shm_collectives._open_segment(missing, rank=1, size=2, timeout_s=60) is None


def test_a_peer_that_never_maps_the_segment_is_an_error_within_the_timeout():
    token = "b" * 64
    size = 3
    path = os.path.join(shm_collectives.SHM_DIR, f"twinkle-shm-test-late-{os.getpid()}")
    with open(path, "wb") as handle:
        handle.truncate(shm_collectives.Segment.nbytes(size))
        handle.seek(shm_collectives.FLAG_STRIDE_BYTES * size)
        handle.write(token.encode())
    try:
        with pytest.raises(RuntimeError, match=r"1 rank\(s\) of this group did not map its segment within 1 s"):
            shm_collectives._open_segment(_store_of_rank_zero(path, token), rank=1, size=size, timeout_s=1)
    finally:
        os.unlink(path)
