"""Tinker sampling sessions, kept in memory per app: a restarted server answers 404 for them and the SDK creates new
ones. A tenant keeps its :data:`MAX_SAMPLING_SESSIONS` most recently used sessions; an expired one answers 404 with
the reason it expired."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request

from twinkle_server.errors import NotFound
from twinkle_server.tinker_common import per_app

#: sampling sessions kept per tenant (the least recently used beyond this expire: the client makes a new one)
MAX_SAMPLING_SESSIONS = 1024
#: unreported samples a sampling session tracks for retrieve_futures
MAX_TRACKED_SAMPLES = 4096


@dataclass
class SamplingSession:
    sampling_session_id: str
    tenant: str
    base_model: str
    session_id: str | None = None
    model_path: str | None = None       # the tinker:// path it samples (None: the base model or an ephemeral save)
    source: str = "base"                 # base | checkpoint | snapshot | inflight
    directory: Path | None = None        # the PEFT adapter directory (checkpoint / snapshot)
    model_id: str | None = None          # the training run of an ephemeral save
    clients: int = 0                     # join_sampling_session counter (the original client is 0)
    expired: str | None = None
    # retrieve_futures: requests not yet reported (request id, seq id), and the completions reported since the
    # client's last cursor (events[i] has the absolute index events_base + i)
    pending: deque[tuple[str, int]] = field(default_factory=lambda: deque(maxlen=MAX_TRACKED_SAMPLES))
    events: list[dict[str, Any]] = field(default_factory=list)
    events_base: int = 0


class SamplingSessions:
    """The live sampling sessions (least recently used first) and why recently expired ones went. ``lock`` also
    guards the fields of each session that requests change (``clients``, ``pending``, ``events``)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.live: OrderedDict[str, SamplingSession] = OrderedDict()
        self.expired: OrderedDict[tuple[str, str], str] = OrderedDict()   # (tenant, session id) -> why

    def add(self, session: SamplingSession) -> None:
        with self.lock:
            self.live[session.sampling_session_id] = session
            mine = [sid for sid, s in self.live.items() if s.tenant == session.tenant]
            for sid in mine[:max(0, len(mine) - MAX_SAMPLING_SESSIONS)]:
                self.expire(sid, f"sampling session {sid} expired: a tenant keeps its {MAX_SAMPLING_SESSIONS} most "
                                 f"recently used sampling sessions; create a new sampling client")

    def expire(self, sampling_session_id: str, why: str) -> None:
        with self.lock:
            session = self.live.pop(sampling_session_id, None)
            if session is not None:
                session.expired = why  # for its requests still queued
                self.expired[(session.tenant, sampling_session_id)] = why
                while len(self.expired) > 4 * MAX_SAMPLING_SESSIONS:
                    self.expired.popitem(last=False)

    def get(self, tenant_name: str, sampling_session_id: str) -> SamplingSession:
        """The tenant's live session, now the most recently used; 404 (saying why, if it expired) otherwise."""
        with self.lock:
            session = self.live.get(sampling_session_id)
            if session is not None and session.tenant == tenant_name:
                self.live.move_to_end(sampling_session_id)
                return session
            why = self.expired.get((tenant_name, sampling_session_id))
        if why is not None:
            raise NotFound(why)
        raise NotFound(f"sampling session {sampling_session_id!r} not found (sampling sessions do not survive a "
                       f"server restart: create a new sampling client)")

    def ids_in_session(self, tenant_name: str, session_id: str) -> list[str]:
        """The live sampling sessions the tenant's (SDK) session ``session_id`` created."""
        with self.lock:
            return [s.sampling_session_id for s in self.live.values()
                    if s.tenant == tenant_name and s.session_id == session_id]


def sampling_sessions_of(request: Request) -> SamplingSessions:
    """The sampling sessions of the app serving ``request``."""
    return per_app(request, "tinker_sampling_sessions", SamplingSessions)
