"""The native API's request plumbing, shared by its route modules: the service and tenant of a request, its JSON
body, how long it waits for its call, the answer (the outcome, or a future to poll), and which failures of a model
call are the caller's."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from twinkle_core.errors import ConfigError, DataFormatError, PluginNotFoundError
from twinkle_server.errors import BadRequest, ServiceError

DEFAULT_WAIT_S = 30.0
MAX_WAIT_S = 300.0


def service_of(request: Request) -> Any:
    """The :class:`~twinkle_server.app.Service` of the app serving ``request``."""
    return request.app.state.service


def authenticate(request: Request) -> Any:
    """The tenant whose API key the request carries, in ``X-API-Key`` or ``Authorization: Bearer`` (401 else)."""
    key = request.headers.get("x-api-key")
    if not key:
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            key = auth[7:].strip()
    return service_of(request).tenant(key)


async def json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:  # a batch of tensors can be megabytes of JSON: parsed off the event loop
        body = await run_in_threadpool(json.loads, raw or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def wait_seconds(value: Any) -> float:
    """The ``wait_s`` a request asks for (default :data:`DEFAULT_WAIT_S`), bounded so no handler waits forever."""
    if value is None:
        return DEFAULT_WAIT_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_WAIT_S:
        raise BadRequest(f"wait_s must be a number of seconds in [0, {MAX_WAIT_S:.0f}], got {value!r}")
    return float(value)


async def answer(service: Any, tenant: Any, request_id: str, wait_s: float) -> Any:
    """The outcome of ``request_id`` if it ends within ``wait_s``; else 202 with the future to poll."""
    outcome = await service.scheduler.wait(tenant.name, request_id, wait_s)
    if not outcome.done:
        return JSONResponse(status_code=202, content={"future": request_id, "status": "pending"})
    if outcome.error is not None:
        raise outcome.error
    body = await run_in_threadpool(json.dumps, {"future": request_id, "status": "done", "result": outcome.value})
    return Response(content=body, media_type="application/json")


def user_errors(what: str, fn: Callable[[], Any], rename: tuple[str, str] | None = None) -> Any:
    """Run a model call; a mistake of the caller's (a bad option, a batch the loss cannot use) is a 400 naming it,
    anything else stays the server's (500, logged by the scheduler). ``rename``: ``(adapter_id, name)``, so the
    message names the adapter by the tenant's name for it, never by its name inside the shared model."""
    try:
        return fn()
    except ServiceError:
        raise
    except (ConfigError, DataFormatError, PluginNotFoundError, ValueError, TypeError, KeyError, IndexError) as exc:
        message = str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
        if rename is not None:
            message = message.replace(*rename)
        raise BadRequest(f"{what}: {message}") from exc
