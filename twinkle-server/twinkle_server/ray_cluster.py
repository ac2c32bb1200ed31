"""The server process's one connection to a Ray cluster, shared by every base model hosted on Ray.

The first :func:`lease` connects (``twinkle_ray.cluster.connected``: the cluster at ``address``, else a local one
on the loopback address, which is stopped again); the connection ends when the last lease is released, so a
server whose start fails half-way leaves no cluster behind.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

from twinkle_core.errors import ConfigError

_lock = threading.Lock()
_stack: contextlib.ExitStack | None = None
_address: str | None = None
_holders = 0


def lease(address: str | None, *, local_cpus: int | None = None) -> Callable[[], None]:
    """Hold the connection to the cluster at ``address`` (``None``: ``RAY_ADDRESS``, else a local cluster of
    ``local_cpus`` CPUs); call the returned function once to let go of it."""
    global _stack, _address, _holders
    from twinkle_ray.cluster import connected

    with _lock:
        if _holders == 0:
            stack = contextlib.ExitStack()
            with _signal_handlers_kept():
                stack.enter_context(connected(address, num_cpus=local_cpus))
            _stack, _address = stack, address
        elif address != _address:
            raise ConfigError(f"this server is connected to the Ray cluster {_address!r}, not {address!r}: give "
                              f"every base model's ray section the same address")
        _holders += 1
    released = threading.Event()

    def release() -> None:
        global _stack, _holders
        with _lock:
            if released.is_set():
                return
            released.set()
            _holders -= 1
            if _holders == 0 and _stack is not None:
                stack, _stack = _stack, None
                stack.close()

    return release


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """Connecting a driver makes SIGTERM exit the process at once (``ray.init``'s handler); the server's own handler
    (uvicorn's graceful shutdown, which stops the worker groups) is put back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if handler is not None:
                signal.signal(sig, handler)
