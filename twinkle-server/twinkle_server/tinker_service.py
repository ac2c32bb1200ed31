"""The Tinker SDK's service calls: health, client configuration, server capabilities, sessions and their heartbeats,
and telemetry."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from tinker import types as ttypes

from twinkle_server import tinker_wire as wire
from twinkle_server.full_host import is_full_parameter
from twinkle_server.tinker_common import json_response, service_of, string_metadata, tenant_of
from twinkle_server.tinker_sampling_sessions import sampling_sessions_of

#: the client config this server hands the SDK (``/api/v1/client/config``): plain API-key auth, uncompressed protobuf
#: forward_backward bodies, per-request polling of retrieve_future, client-side custom losses
CLIENT_CONFIG: dict[str, Any] = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": True,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
    "sample_no_retries": False,
}
DYNAMIC_CLIENT_CONFIG: dict[str, Any] = {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

router = APIRouter()


@router.get("/api/v1/healthz")
async def healthz() -> JSONResponse:
    return json_response({"status": "ok"}, ttypes.HealthResponse)


@router.post("/api/v1/client/config")
async def client_config(request: Request) -> JSONResponse:
    tenant_of(request)
    wire.parse_model(ttypes.ClientConfigRequest, await request.body())
    return json_response(dict(CLIENT_CONFIG), ttypes.ClientConfigResponse)


@router.post("/api/v1/client/dynamic_config")
async def client_dynamic_config(request: Request) -> JSONResponse:
    tenant_of(request)
    wire.parse_model(ttypes.ClientConfigRequest, await request.body())
    return json_response(dict(DYNAMIC_CLIENT_CONFIG), ttypes.ClientDynamicConfigResponse)


@router.get("/api/v1/get_server_capabilities")
async def get_server_capabilities(request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    service = service_of(request)
    models = []
    for name in service.hosted(tenant.name):  # another tenant's full-parameter base is not disclosed
        host = service.hosts[name]
        lora = not is_full_parameter(host)  # its owner sees it, but the Tinker API neither trains nor samples it
        models.append({"model_name": name, "max_context_length": getattr(host, "max_positions", None),
                       "trainable": lora, "sampleable": lora})
    return json_response({"supported_models": models}, ttypes.GetServerCapabilitiesResponse)


@router.post("/api/v1/create_session")
async def create_session(request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    req = wire.parse_model(ttypes.CreateSessionRequest, await request.body())
    meta = {"tags": list(req.tags), "user_metadata": req.user_metadata or {}, "sdk_version": req.sdk_version,
            "project_id": req.project_id, "display_name": req.display_name, "api": "tinker"}
    session_id = service_of(request).registry.new_session(tenant.name, meta)
    return json_response({"type": "create_session", "session_id": session_id}, ttypes.CreateSessionResponse)


@router.post("/api/v1/session_heartbeat")
async def session_heartbeat(request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    req = wire.parse_model(ttypes.SessionHeartbeatRequest, await request.body())
    service_of(request).registry.touch_session(tenant.name, req.session_id)
    return json_response({"type": "session_heartbeat"}, ttypes.SessionHeartbeatResponse)


@router.post("/api/v1/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    service_of(request).registry.touch_session(tenant.name, session_id)
    return json_response({})


@router.get("/api/v1/sessions")
async def list_sessions(request: Request, limit: int = 20, offset: int = 0) -> JSONResponse:
    tenant = tenant_of(request)
    registry = service_of(request).registry
    mine = sorted((s for s in registry.sessions.values() if s.tenant == tenant.name),
                  key=lambda s: s.created, reverse=True)
    return json_response({"sessions": [s.session_id for s in mine[offset:offset + max(0, limit)]]},
                         ttypes.ListSessionsResponse)


@router.get("/api/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    registry = service_of(request).registry
    record = registry.session(tenant.name, session_id)
    runs = [r.model_id for r in registry.tenant_runs(tenant.name) if r.session_id == session_id]
    samplers = sampling_sessions_of(request).ids_in_session(tenant.name, session_id)
    return json_response({"training_run_ids": runs, "sampler_ids": samplers,
                          "user_metadata": string_metadata(record.meta.get("user_metadata")),
                          "display_name": record.meta.get("display_name")}, ttypes.GetSessionResponse)


@router.post("/api/v1/telemetry")
async def telemetry(request: Request) -> JSONResponse:
    tenant_of(request)
    await request.body()  # accepted and discarded: the SDK's own diagnostics, not ours to keep
    return json_response({"status": "accepted"}, ttypes.TelemetryResponse)
