"""What the Tinker SDK can call and this server refuses, each by name with a 400 (after authenticating the key),
never a silent substitute."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from twinkle_server.tinker_common import tenant_of, unsupported

#: (method, path) -> (the feature refused, a hint at what to do instead)
REFUSED: dict[tuple[str, str], tuple[str, str]] = {
    ("POST", "/api/v1/create_custom_loss"): ("server-side custom losses (create_custom_loss upload)",
                                              "this server's client config keeps custom losses client-side"),
    ("POST", "/api/v1/cancel_future"): ("cancelling a future", "requests run to completion"),
    ("POST", "/api/v1/copy_weights"): ("copy_weights", "load the checkpoint with create_training_client_from_state"),
    ("POST", "/api/v1/auth/token"): ("JWT auth exchange", "authenticate with the API key"),
    ("GET", "/api/v1/auth/apikey/me"): ("whoami", ""),
    ("POST", "/api/v1/sessions/search"): ("session search", "list sessions with RestClient.list_sessions"),
    ("GET", "/api/v1/audit"): ("the audit log", ""),
    ("GET", "/api/v1/billing/usage/events"): ("billing", ""),
    ("GET", "/api/v1/billing/usage/checkpoints/current"): ("billing", ""),
    ("POST", "/api/v1/training_runs/{model_id}/checkpoints/{segment}/{name}/publish"): ("publishing checkpoints", ""),
    ("DELETE", "/api/v1/training_runs/{model_id}/checkpoints/{segment}/{name}/publish"): ("publishing checkpoints",
                                                                                          ""),
    ("POST", "/api/v1/sessions/{session_id}/trace_export"): ("session trace export", ""),
    ("GET", "/api/v1/sessions/{session_id}/trace_export"): ("session trace export", ""),
    ("PUT", "/api/v1/sessions/{session_id}/project"): ("projects", ""),
}


def refusal(feature: str, hint: str) -> Callable[[Request], Awaitable[JSONResponse]]:
    """A route that authenticates the caller, then refuses ``feature``."""
    async def refuse(request: Request) -> JSONResponse:
        tenant_of(request)
        raise unsupported(feature, hint)

    return refuse


router = APIRouter()
for (method, path), (feature, hint) in REFUSED.items():
    router.add_api_route(path, refusal(feature, hint), methods=[method], include_in_schema=False)
