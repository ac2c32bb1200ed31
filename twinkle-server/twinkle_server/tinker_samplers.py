"""Which adapter directories each host has loaded as samplers, and the ephemeral exports of training runs that
``save_weights_and_get_sampling_client`` makes: a run's latest ``inflight`` export (its inflight sampling clients all
read it) and its last :data:`MAX_EPHEMERAL_SNAPSHOTS` snapshots."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

from fastapi import Request

from twinkle_server.errors import NotFound
from twinkle_server.tinker_common import per_app
from twinkle_server.tinker_sampling_sessions import SamplingSession

#: ephemeral snapshots (save_weights_and_get_sampling_client) kept on disk per training run; older ones expire
MAX_EPHEMERAL_SNAPSHOTS = 8


class HostSamplers:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.loaded: dict[str, dict[str, str]] = {}                 # host name -> adapter dir -> sampler id
        self.inflight: dict[tuple[str, str], Path] = {}               # (tenant, model_id) -> latest inflight export
        self.snapshots: dict[tuple[str, str], list[tuple[str, Path]]] = {}  # -> (sampling session, dir), oldest first

    # ---- the samplers a host has loaded (called on the host's lane thread only)
    def sampler_for(self, host: Any, session: SamplingSession) -> str | None:
        """The host's sampler id for the weights ``session`` samples, loading them first if needed (``None``: the
        base model)."""
        if session.expired:
            raise NotFound(session.expired)
        if session.source == "base":
            return None
        if session.source == "inflight":
            with self.lock:
                directory = self.inflight.get((session.tenant, session.model_id or ""))
        else:
            directory = session.directory
        if directory is None or not directory.is_dir():
            raise NotFound(f"the weights of sampling session {session.sampling_session_id} "
                           f"({session.model_path or 'an ephemeral save'}) are gone (deleted); create a new sampling "
                           f"client")
        key = str(directory)
        with self.lock:
            registered = self.loaded.setdefault(host.name, {})
            sampler_id = registered.get(key)
            if sampler_id is None:
                # the host keeps the directory and at most max_loaded_samplers adapters in memory, reloading the
                # least recently used one from its directory when it is next used
                sampler_id = "tinker-sampler-" + hashlib.sha256(key.encode()).hexdigest()[:24]
                host.load_sampler(sampler_id, directory)
                registered[key] = sampler_id
            return sampler_id

    def unload(self, host: Any, directory: Path) -> None:
        """Forget the host's sampler of ``directory`` (before the directory is rewritten or removed)."""
        with self.lock:
            sampler_id = self.loaded.get(host.name, {}).pop(str(directory), None)
        if sampler_id is not None:
            host.unload_sampler(sampler_id)

    # ---- ephemeral exports
    def publish_inflight(self, tenant_name: str, model_id: str, directory: Path) -> Path | None:
        """Make ``directory`` the run's inflight weights; the previous inflight export (now stale), if any."""
        with self.lock:
            previous = self.inflight.get((tenant_name, model_id))
            self.inflight[(tenant_name, model_id)] = directory
            return previous

    def keep_snapshot(self, tenant_name: str, model_id: str, sampling_session_id: str,
                      directory: Path) -> list[tuple[str, Path]]:
        """Record the run's new snapshot; the (sampling session, directory) pairs that no longer fit, to expire."""
        with self.lock:
            kept = self.snapshots.setdefault((tenant_name, model_id), [])
            kept.append((sampling_session_id, directory))
            evicted = kept[:max(0, len(kept) - MAX_EPHEMERAL_SNAPSHOTS)]
            del kept[:len(evicted)]
            return evicted


def host_samplers_of(request: Request) -> HostSamplers:
    """The host samplers and ephemeral exports of the app serving ``request``."""
    return per_app(request, "tinker_host_samplers", HostSamplers)
