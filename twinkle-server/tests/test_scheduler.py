"""The scheduler: FIFO per tenant, round-robin across tenants, bounded queues, failures kept per request."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from twinkle_server.errors import BadRequest, NotFound, TooManyRequests, Unavailable
from twinkle_server.scheduler import Scheduler

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def scheduler():
    s = Scheduler(max_queued_per_tenant=100)
    yield s
    s.stop(drain_s=5)


def gated(scheduler: Scheduler, tenant: str = "gate"):
    """Block the lane until the returned event is set, so a test can queue work deterministically."""
    gate = threading.Event()
    scheduler.submit(tenant, "gate", gate.wait)
    return gate


def test_each_tenant_in_order_and_tenants_take_turns(scheduler):
    ran: list[str] = []
    gate = gated(scheduler)
    ids = [scheduler.submit("a", "step", lambda i=i: ran.append(f"a{i}")) for i in range(6)]
    ids += [scheduler.submit("b", "step", lambda i=i: ran.append(f"b{i}")) for i in range(2)]
    gate.set()
    for request_id in ids:
        tenant = "a" if ids.index(request_id) < 6 else "b"
        assert scheduler.result(tenant, request_id, timeout_s=10).done
    assert [r for r in ran if r[0] == "a"] == [f"a{i}" for i in range(6)]
    assert [r for r in ran if r[0] == "b"] == ["b0", "b1"]
    # b's two requests do not wait behind a's six: the tenants alternate
    assert ran.index("b0") <= 1 and ran.index("b1") <= 3, ran


def test_queue_limit_is_per_tenant_and_named(scheduler):
    scheduler.max_queued_per_tenant = 3
    gate = gated(scheduler, tenant="other")
    for _ in range(3):
        scheduler.submit("a", "step", lambda: None)
    with pytest.raises(TooManyRequests, match="max_queued_per_tenant=3"):
        scheduler.submit("a", "step", lambda: None)
    scheduler.submit("b", "step", lambda: None)  # another tenant is not affected
    gate.set()


def test_a_failure_is_the_requests_own(scheduler):
    def bad():
        raise BadRequest("token 999 is outside the vocabulary")

    def crash():
        raise RuntimeError("boom")

    first = scheduler.submit("a", "forward_backward", bad)
    second = scheduler.submit("a", "forward_backward", crash)
    third = scheduler.submit("a", "optim_step", lambda: 42)
    assert "vocabulary" in scheduler.result("a", first, 10).error.message
    outcome = scheduler.result("a", second, 10)
    assert outcome.error.status == 500 and "RuntimeError: boom" in outcome.error.message
    assert scheduler.result("a", third, 10).value == 42


def test_another_tenants_request_is_not_found(scheduler):
    request_id = scheduler.submit("a", "step", lambda: 1)
    with pytest.raises(NotFound):
        scheduler.peek("b", request_id)
    with pytest.raises(NotFound):
        scheduler.peek("a", "req-does-not-exist")


def test_async_wait_returns_when_done_or_after_the_timeout(scheduler):
    gate = threading.Event()
    request_id = scheduler.submit("a", "slow", lambda: gate.wait() and "finished")

    async def scenario():
        start = time.monotonic()
        pending = await scheduler.wait("a", request_id, 0.2)
        waited = time.monotonic() - start
        threading.Timer(0.1, gate.set).start()
        finished = await scheduler.wait("a", request_id, 10)
        return pending, waited, finished

    pending, waited, finished = asyncio.run(scenario())
    assert not pending.done and 0.15 < waited < 2
    assert finished.done and finished.value == "finished"


def test_shutdown_finishes_the_running_request_and_rejects_the_queue():
    scheduler = Scheduler()
    started, release = threading.Event(), threading.Event()
    finished = []

    def running():
        started.set()
        release.wait()
        finished.append(True)
        return "saved"

    first = scheduler.submit("a", "save_state", running)
    queued = scheduler.submit("a", "optim_step", lambda: "never")
    started.wait(5)
    threading.Timer(0.3, release.set).start()
    scheduler.stop(drain_s=0.0)
    assert finished == [True] and scheduler.peek("a", first).value == "saved"
    assert isinstance(scheduler.peek("a", queued).error, Unavailable)
    with pytest.raises(Unavailable, match="shutting down"):
        scheduler.submit("a", "step", lambda: None)


def test_lanes_run_in_parallel(scheduler):
    gate = threading.Event()
    scheduler.submit("a", "slow", gate.wait, lane="model-1")
    quick = scheduler.submit("a", "quick", lambda: "ok", lane="model-2")
    assert scheduler.result("a", quick, 5).value == "ok"
    gate.set()


def test_finished_results_are_kept_within_the_bounds(scheduler):
    scheduler.max_kept_per_tenant = 2
    gate = threading.Event()  # nothing finishes before all four are submitted, so no submit forgets one of them
    ids = [scheduler.submit("a", "step", lambda i=i: (gate.wait(10), i)[1]) for i in range(4)]
    gate.set()
    for request_id in ids:
        scheduler.result("a", request_id, timeout_s=10)
    latest = scheduler.submit("a", "step", lambda: "last")  # submitting forgets what is beyond the bound
    scheduler.result("a", latest, timeout_s=10)
    with pytest.raises(NotFound):
        scheduler.peek("a", ids[0])
    assert scheduler.peek("a", ids[3]).value == 3
