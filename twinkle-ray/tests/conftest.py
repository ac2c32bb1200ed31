"""A real local Ray cluster on the loopback address, shared by this folder's tests and always shut down."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def ray_cluster():
    """``ray``, connected to a local cluster with 4 logical CPUs (actors of 1 CPU each; the machine may have
    fewer cores: Ray's CPUs are a scheduling count, as torchrun's processes are)."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:  # not imported here: connected() imports it for a loopback cluster
        pytest.skip("ray is not installed")
    from twinkle_ray.cluster import connected

    with connected(num_cpus=4) as ray:
        yield ray


@pytest.fixture
def worker_env():
    from twinkle_core.testing.torchrun import thread_env

    return thread_env()
