"""Tinker futures: queued work answered with ``{"request_id": ...}``, fetched with ``/api/v1/retrieve_future`` (which
long-polls the scheduler and answers ``try_again`` while the work is queued or running) or announced per sampling
session by ``/api/v1/retrieve_futures``; and the dedup that gives a retried POST (the SDK re-sends after a
connection error or a 5xx) the first submission's future instead of running it twice."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from tinker import types as ttypes

from twinkle_server import tinker_wire as wire
from twinkle_server.errors import BadRequest, NotFound
from twinkle_server.tinker_common import json_response, per_app, service_of, tenant_of
from twinkle_server.tinker_sampling_sessions import SamplingSession, SamplingSessions, sampling_sessions_of

#: how long one retrieve_future call waits for its request before answering try_again (the SDK's own HTTP timeout
#: for the poll is 45 s)
RETRIEVE_WAIT_S = 20.0
#: submitted requests remembered by (model or sampling session, seq_id, body) so that a retried POST gets the first
#: submission's future
MAX_REMEMBERED_SUBMISSIONS = 8192

router = APIRouter()


# ---------------------------------------------------------------------------------------------------------------
# idempotent submission
# ---------------------------------------------------------------------------------------------------------------
class Submissions:
    """Request ids of recent submissions by key (the least recently used are forgotten first)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.request_ids: OrderedDict[tuple[str, ...], str] = OrderedDict()

    def earlier(self, key: tuple[str, ...] | None) -> str | None:
        """The request id an earlier submission with ``key`` got, if any."""
        if key is None:
            return None
        with self.lock:
            return self.request_ids.get(key)

    def submit_once(self, key: tuple[str, ...] | None, submit: Callable[[], str]) -> str:
        """``submit()``'s request id, or the id a request with the same key got before (a retried POST)."""
        if key is None:
            return submit()
        with self.lock:
            known = self.request_ids.get(key)
            if known is not None:
                self.request_ids.move_to_end(key)
                return known
            request_id = submit()
            self.request_ids[key] = request_id
            while len(self.request_ids) > MAX_REMEMBERED_SUBMISSIONS:
                self.request_ids.popitem(last=False)
            return request_id


def submissions_of(request: Request) -> Submissions:
    """The remembered submissions of the app serving ``request``."""
    return per_app(request, "tinker_submissions", Submissions)


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


@dataclass
class TenantQueue:
    """Queues one tenant's work on the lane of a base model's host; a POST the SDK re-sends (same kind, model or
    session, seq_id and body) gets the first one's request id."""

    service: Any
    submissions: Submissions
    tenant: Any

    def key(self, kind: str, scope: str, seq_id: int | None, body: bytes) -> tuple[str, ...] | None:
        return None if seq_id is None else (self.tenant.name, scope, kind, str(seq_id), body_digest(body))

    def earlier(self, kind: str, scope: str, seq_id: int | None, body: bytes) -> str | None:
        """The request id of an earlier, identical submission: checked before anything the first submission's
        effects would now make fail (an existing checkpoint name, say)."""
        return self.submissions.earlier(self.key(kind, scope, seq_id, body))

    def submit(self, kind: str, base_model: str, work: Callable[[], Any], *, scope: str, seq_id: int | None,
               body: bytes) -> str:
        """Queue ``work``; ``scope`` is the model id (or, for model creation, the session id) ``seq_id`` counts in."""
        return self.submissions.submit_once(self.key(kind, scope, seq_id, body),
                                            lambda: self.service.submit(self.tenant, kind, base_model, work))


def tenant_queue(request: Request, tenant: Any) -> TenantQueue:
    return TenantQueue(service=service_of(request), submissions=submissions_of(request), tenant=tenant)


# ---------------------------------------------------------------------------------------------------------------
# retrieving futures
# ---------------------------------------------------------------------------------------------------------------
@router.post("/api/v1/retrieve_future")
async def retrieve_future(request: Request) -> Response:
    tenant = tenant_of(request)
    req = wire.parse_model(ttypes.FutureRetrieveRequest, await request.body())
    outcome = await service_of(request).scheduler.wait(tenant.name, req.request_id, RETRIEVE_WAIT_S)
    if not outcome.done:
        return json_response(wire.try_again(req.request_id), ttypes.TryAgainResponse)
    if outcome.error is not None:
        return json_response(wire.request_failed(outcome.error), ttypes.RequestFailedResponse)
    value = outcome.value
    if not isinstance(value, wire.WireResult):
        return json_response(wire.request_failed(BadRequest(
            f"request {req.request_id} was not submitted through the Tinker API; fetch it from the API that "
            f"submitted it")))
    return Response(content=value.body, media_type=value.media_type)


@router.post("/api/v1/retrieve_futures")
async def retrieve_futures(request: Request) -> JSONResponse:
    """The completions of a sampling session's requests since the client's cursor, waiting up to ``timeout`` for
    one when there are none yet."""
    tenant = tenant_of(request)
    scheduler = service_of(request).scheduler
    sessions = sampling_sessions_of(request)
    req = wire.parse_model(ttypes.FuturesRetrieveRequest, await request.body())
    session = sessions.get(tenant.name, req.target.sampling_session_id)
    clone = req.target.cloned_sampler_id
    timeout = RETRIEVE_WAIT_S if req.timeout is None else max(0.0, min(float(req.timeout), RETRIEVE_WAIT_S))

    def unseen() -> list[dict[str, Any]]:
        with sessions.lock:
            start = max(0, req.prev_cursor - session.events_base)
            return [e for e in session.events[start:] if e["_clone"] == clone]

    with sessions.lock:  # what the client has seen (at or before its cursor) is dropped
        drop = max(0, min(len(session.events), req.prev_cursor - session.events_base))
        del session.events[:drop]
        session.events_base += drop
    report_finished(scheduler, sessions, tenant.name, session)
    deadline = time.monotonic() + timeout
    while not unseen() and time.monotonic() < deadline:
        with sessions.lock:
            waiting = [rid for rid, _ in session.pending]
        if not waiting:
            break
        waits = [asyncio.ensure_future(scheduler.wait(tenant.name, rid, deadline - time.monotonic()))
                 for rid in waiting]
        _, rest = await asyncio.wait(waits, timeout=max(0.0, deadline - time.monotonic()),
                                     return_when=asyncio.FIRST_COMPLETED)
        for task in rest:
            task.cancel()
        report_finished(scheduler, sessions, tenant.name, session)
    completions = [{k: v for k, v in e.items() if not k.startswith("_")} for e in unseen()]
    with sessions.lock:
        cursor = session.events_base + len(session.events)
    return json_response({"completions": completions, "cursor": cursor}, ttypes.FuturesRetrieveResponse)


def report_finished(scheduler: Any, sessions: SamplingSessions, tenant_name: str, session: SamplingSession) -> None:
    """Move the session's pending requests that are done (or forgotten by the scheduler) to its events."""
    with sessions.lock:
        pending = list(session.pending)
    for rid, seq in pending:
        try:
            outcome = scheduler.peek(tenant_name, rid)
        except NotFound:
            outcome = None
        if outcome is not None and not outcome.done:
            continue
        failed = outcome is None or outcome.error is not None
        with sessions.lock:
            if (rid, seq) in session.pending:
                session.pending.remove((rid, seq))
                session.events.append({"state": "failed" if failed else "finished", "request_id": rid,
                                       "_clone": seq // 10**9})
