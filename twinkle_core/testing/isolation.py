"""Keep in-process tests independent of the process groups that earlier tests started.

Some strategies start a one-rank process group in the test process itself (megatron-core always needs one;
a one-rank Ulysses strategy wraps in DDP). ``torch.distributed`` keeps that group for the life of the
process, so a later test in another distribution silently inherits it: a model built there then reduces
over the earlier test's ``gloo`` group instead of starting its own. :func:`process_group_scope` ends what
a block of tests started, and is a no-op under torchrun, whose ranks own their job's group.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator


def _group_alive() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def under_torchrun() -> bool:
    """Whether this process is a rank of a torchrun job (its process group belongs to the job)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


@contextlib.contextmanager
def process_group_scope(before_destroy: Callable[[], None] | None = None) -> Iterator[None]:
    """Destroy, on exit, the default process group started inside the block (none started: nothing done).

    ``before_destroy`` releases state built on that group first (e.g. megatron-core's parallel groups).
    A group that was alive on entry is left alone: it is not this block's to end.
    """
    if under_torchrun() or _group_alive():
        yield
        return
    try:
        yield
    finally:
        if _group_alive():
            if before_destroy is not None:
                before_destroy()
            import torch.distributed as dist

            dist.destroy_process_group()


def describe_leaked_group() -> str | None:
    """A sentence naming the process group alive in this process outside torchrun, or None."""
    if under_torchrun() or not _group_alive():
        return None
    import torch.distributed as dist

    return (f"a {dist.get_backend()!r} process group of world size {dist.get_world_size()} is alive in this "
            f"test process, left by an earlier test; wrap that test's module in "
            f"twinkle_core.testing.isolation.process_group_scope")
