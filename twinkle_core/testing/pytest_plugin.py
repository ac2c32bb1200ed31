"""pytest plugin (entry point ``pytest11: twinkle``): runs the conformance suite against a backend.

``--twinkle-backend NAME`` picks a registered :class:`~twinkle_core.records.ConformanceTarget`;
a ``package.module:factory`` reference is accepted too (the core tests use the reference backend
that way). Without the option, conformance tests that need a factory are skipped with a reason,
unless a test module provides its own ``twinkle_factory`` fixture.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from typing import Any

import pytest


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("twinkle")
    group.addoption("--twinkle-backend", action="store", default=None, metavar="NAME",
                    help="run the Twinkle conformance suite against this conformance target "
                         "(a registered name, or package.module:factory)")


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers", "parity: compares two implementations within a tolerance derived from the arithmetic "
                   "(twinkle_core.testing.tolerance); CI runs these with TWINKLE_TEST_THREADS=1 and =2")
    threads = os.environ.get("TWINKLE_TEST_THREADS")
    if threads:
        import torch

        from twinkle_core.testing.torchrun import thread_env

        # the in-process tests get the same thread count as the subprocesses (thread_env validates it)
        torch.set_num_threads(int(thread_env()["OMP_NUM_THREADS"]))


def _target(name: str) -> tuple[Any, dict[str, Any], int]:
    from twinkle_core.lazy import import_object
    from twinkle_core.plugins import get_plugins

    if ":" in name:
        return import_object(name), {}, 1
    record = get_plugins().get("conformance", name)
    return record.load(), dict(record.options), record.world_size


@pytest.fixture
def twinkle_factory(request: Any) -> Any:
    name = request.config.getoption("--twinkle-backend")
    if not name:
        pytest.skip("no --twinkle-backend given")
    factory, options, world_size = _target(name)
    actual = int(os.environ.get("WORLD_SIZE", "1"))
    if actual != world_size:
        pytest.fail(f"conformance target {name!r} needs {world_size} ranks; run it under "
                    f"torchrun --nproc-per-node {world_size} (WORLD_SIZE is {actual})")
    return functools.partial(factory, **options)


@pytest.fixture
def twinkle_shared_dir(request: Any) -> Any:
    """A directory that is the same on every rank of a torchrun job (``tmp_path`` differs per rank)."""
    import pathlib

    # torchrun with --master-addr/--master-port sets TORCHELASTIC_RUN_ID=none: add the port to keep
    # concurrent jobs apart.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    job = f"{run_id}-{os.environ.get('MASTER_PORT', '')}"
    if job == "none-" or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return request.getfixturevalue("tmp_path")
    base = os.environ.get("TWINKLE_SHARED_TMP") or os.path.join(tempfile.gettempdir(), f"twinkle-shared-{job}")
    path = pathlib.Path(base) / re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid)
    path.mkdir(parents=True, exist_ok=True)
    return path
