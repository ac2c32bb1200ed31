"""Requests run in order per tenant and fairly across tenants; results are kept as futures until retrieved.

A *lane* is one worker thread with the model it owns (one lane per hosted base model): model calls are never
concurrent. Within a lane each tenant has a FIFO queue, and the worker takes the next request round-robin over
the tenants that have work, so a tenant with 60 queued steps delays another tenant's single step by at most one
request. ``submit`` returns at once with a request id; ``wait`` (async, for the HTTP layer) or ``result`` (blocking)
collect the outcome.

A request's failure is its own: a :class:`ServiceError` is kept as the result's error; any other exception is
logged with its traceback and reported as a server error naming its type. The worker never dies of a request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twinkle_server.errors import NotFound, ServiceError, TooManyRequests, Unavailable

log = logging.getLogger("twinkle.server")


class ServerError(ServiceError):
    status = 500
    category = "server"


@dataclass
class Outcome:
    done: bool
    value: Any = None
    error: ServiceError | None = None


@dataclass
class _Request:
    request_id: str
    tenant: str
    kind: str
    lane: str
    work: Callable[[], Any]
    submitted: float
    started: float | None = None
    finished: float | None = None
    value: Any = None
    error: ServiceError | None = None
    event: threading.Event = field(default_factory=threading.Event)
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.event.is_set()


class _Lane:
    def __init__(self, name: str, scheduler: Scheduler) -> None:
        self.name = name
        self.queues: OrderedDict[str, deque[_Request]] = OrderedDict()
        self.turn = itertools.count()
        self.thread = threading.Thread(target=scheduler._run_lane, args=(self,), name=f"twinkle-lane-{name}",
                                       daemon=True)
        self.current: _Request | None = None

    def next_request(self) -> _Request | None:
        """Round-robin: the first tenant in the rotation with work, which then moves to the back."""
        for tenant in list(self.queues):
            queue = self.queues[tenant]
            if queue:
                request = queue.popleft()
                self.queues.move_to_end(tenant)
                return request
        return None

    def depth(self) -> int:
        return sum(len(q) for q in self.queues.values())


class Scheduler:
    def __init__(self, *, max_queued_per_tenant: int = 64, keep_results_s: float = 900.0,
                 max_kept_per_tenant: int = 1024, on_finish: Callable[[_Request], None] | None = None) -> None:
        self.max_queued_per_tenant = max_queued_per_tenant
        self.keep_results_s = keep_results_s
        self.max_kept_per_tenant = max_kept_per_tenant
        self.on_finish = on_finish
        self._lock = threading.Condition()
        self._lanes: dict[str, _Lane] = {}
        self._requests: dict[str, _Request] = {}
        #: per tenant: requests queued or running, and finished ones in the order they finished (kept for retrieval)
        self._pending: Counter[str] = Counter()
        self._finished: defaultdict[str, deque[_Request]] = defaultdict(deque)
        self._accepting = True
        self._stopping = False

    # ------------------------------------------------------------------ submitting
    def submit(self, tenant: str, kind: str, work: Callable[[], Any], *, lane: str = "default") -> str:
        with self._lock:
            if not self._accepting:
                raise Unavailable("the server is shutting down and accepts no new work; retry against the restarted "
                                  "server")
            pending = self._pending[tenant]
            if pending >= self.max_queued_per_tenant:
                raise TooManyRequests(f"tenant {tenant} has {pending} requests queued or running (limit "
                                      f"max_queued_per_tenant={self.max_queued_per_tenant}); wait for their results "
                                      f"before submitting more")
            request = _Request(request_id=f"req-{uuid.uuid4().hex}", tenant=tenant, kind=kind, lane=lane, work=work,
                               submitted=time.time())
            self._requests[request.request_id] = request
            self._pending[tenant] += 1
            self._lane(lane).queues.setdefault(tenant, deque()).append(request)
            self._forget_old(tenant)
            self._lock.notify_all()
            return request.request_id

    def _lane(self, name: str) -> _Lane:
        lane = self._lanes.get(name)
        if lane is None:
            lane = self._lanes[name] = _Lane(name, self)
            lane.thread.start()
        return lane

    def _forget_old(self, tenant: str) -> None:
        """Drop the tenant's oldest finished results beyond ``max_kept_per_tenant`` or ``keep_results_s``."""
        finished, now = self._finished[tenant], time.time()
        while finished and (len(finished) > self.max_kept_per_tenant
                            or now - finished[0].finished > self.keep_results_s):
            del self._requests[finished.popleft().request_id]

    # ------------------------------------------------------------------ results
    def _request(self, tenant: str, request_id: str) -> _Request:
        request = self._requests.get(request_id)
        if request is None or request.tenant != tenant:
            raise NotFound(f"request {request_id!r} not found (results are kept {self.keep_results_s:.0f} s after "
                           f"they finish)")
        return request

    def peek(self, tenant: str, request_id: str) -> Outcome:
        request = self._request(tenant, request_id)
        return Outcome(done=request.done, value=request.value, error=request.error)

    def result(self, tenant: str, request_id: str, timeout_s: float | None = None) -> Outcome:
        """Block until the request finishes or ``timeout_s`` passes."""
        request = self._request(tenant, request_id)
        request.event.wait(timeout_s)
        return self.peek(tenant, request_id)

    async def wait(self, tenant: str, request_id: str, timeout_s: float) -> Outcome:
        """Await the request's end for at most ``timeout_s`` (without holding a thread)."""
        request = self._request(tenant, request_id)
        if not request.done:
            loop = asyncio.get_running_loop()
            future: asyncio.Future = loop.create_future()
            with self._lock:
                if not request.done:
                    request.waiters.append((loop, future))
                else:
                    future.set_result(None)
            try:
                await asyncio.wait_for(asyncio.shield(future), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.peek(tenant, request_id)

    def queue_depths(self) -> dict[str, dict[str, int]]:
        """Per lane, per tenant: requests waiting (not counting the one running)."""
        with self._lock:
            return {name: {t: len(q) for t, q in lane.queues.items() if q} for name, lane in self._lanes.items()}

    def running(self) -> dict[str, tuple[str, str] | None]:
        with self._lock:
            return {name: (lane.current.tenant, lane.current.kind) if lane.current else None
                    for name, lane in self._lanes.items()}

    # ------------------------------------------------------------------ the worker
    def _run_lane(self, lane: _Lane) -> None:
        while True:
            with self._lock:
                request = lane.next_request()
                while request is None:
                    if self._stopping:
                        return
                    self._lock.wait()
                    request = lane.next_request()
                lane.current = request
            request.started = time.time()
            try:
                request.value = request.work()
            except ServiceError as exc:
                request.error = exc
            except Exception as exc:  # one request's failure is reported to its caller; the lane keeps serving
                log.exception("request %s (%s, tenant %s) failed", request.request_id, request.kind, request.tenant)
                request.error = ServerError(f"{request.kind} failed on the server: {type(exc).__name__}: {exc}")
            self._finish(lane, request)

    def _finish(self, lane: _Lane | None, request: _Request) -> None:
        request.finished = time.time()
        request.work = _done  # the closure holds the request's decoded batch: kept results must not keep it alive
        with self._lock:
            request.event.set()
            self._pending[request.tenant] -= 1
            self._finished[request.tenant].append(request)
            if lane is not None:
                lane.current = None
            waiters, request.waiters = request.waiters, []
            self._lock.notify_all()
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future)
        if self.on_finish is not None:
            self.on_finish(request)

    # ------------------------------------------------------------------ shutdown
    def stop(self, *, drain_s: float = 30.0) -> None:
        """Accept nothing new; let queued work finish for up to ``drain_s`` seconds, then reject what is left
        (never interrupting the request that is running: a checkpoint being written is finished)."""
        with self._lock:
            self._accepting = False
        deadline = time.time() + drain_s
        with self._lock:
            while any(lane.depth() for lane in self._lanes.values()) and time.time() < deadline:
                self._lock.wait(timeout=max(0.0, min(0.5, deadline - time.time())))
            left = [r for lane in self._lanes.values() for q in lane.queues.values() for r in q]
            for lane in self._lanes.values():
                lane.queues.clear()
            self._stopping = True
            self._lock.notify_all()
        for request in left:
            request.error = Unavailable(f"{request.kind} was not run: the server shut down before its turn; "
                                        f"submit it again after the restart")
            self._finish(None, request)
        for lane in self._lanes.values():  # the running request finishes (a torn checkpoint is worse than a wait)
            lane.thread.join()


def _done() -> None:
    """What a finished request's ``work`` becomes."""


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
