"""The Tinker REST client's views of training runs and checkpoints: listings, a run by id, a checkpoint's weights
info, deleting a checkpoint, and its TTL."""

from __future__ import annotations

import shutil
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from tinker import types as ttypes

from twinkle_server import tinker_wire as wire
from twinkle_server.errors import BadRequest
from twinkle_server.tinker_common import (
    CHECKPOINT_TYPE_OF_KIND,
    checkpoint_at,
    directory_size,
    find_checkpoint,
    json_response,
    parse_checkpoint_path,
    service_of,
    string_metadata,
    tenant_of,
)

router = APIRouter()


def checkpoint_json(record: Any) -> dict[str, Any]:
    """A registered checkpoint as the SDK's ``Checkpoint``."""
    return {"checkpoint_id": parse_checkpoint_path(record.tinker_path).checkpoint_id,
            "checkpoint_type": CHECKPOINT_TYPE_OF_KIND.get(record.kind, "training"),
            "time": wire.iso_time(record.created), "tinker_path": record.tinker_path,
            "size_bytes": directory_size(record.directory), "public": False,
            "user_metadata": record.meta.get("user_metadata"), "expires_at": None}


def training_run_json(registry: Any, run: Any) -> dict[str, Any]:
    """A registered run as the SDK's ``TrainingRun``."""
    checkpoints = registry.checkpoints(run.tenant, run.model_id)
    last = next((c for c in reversed(checkpoints) if c.kind == "state"), None)
    last_sampler = next((c for c in reversed(checkpoints) if c.kind == "sampler"), None)
    touched = max([run.created, *(c.created for c in checkpoints)])
    return {"training_run_id": run.model_id, "base_model": run.base_model, "model_owner": run.tenant,
            "is_lora": True, "corrupted": False, "lora_rank": run.lora_rank,
            "last_request_time": wire.iso_time(touched),
            "last_checkpoint": checkpoint_json(last) if last else None,
            "last_sampler_checkpoint": checkpoint_json(last_sampler) if last_sampler else None,
            "user_metadata": string_metadata(run.meta.get("user_metadata"))}


@router.get("/api/v1/training_runs")
async def list_training_runs(request: Request, limit: int = 20, offset: int = 0) -> JSONResponse:
    tenant = tenant_of(request)
    registry = service_of(request).registry
    runs = list(reversed(registry.tenant_runs(tenant.name)))
    page = runs[max(0, offset):max(0, offset) + max(0, limit)]
    return json_response({"training_runs": [training_run_json(registry, r) for r in page],
                          "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}},
                         ttypes.TrainingRunsResponse)


@router.get("/api/v1/training_runs/{model_id}")
async def get_training_run(model_id: str, request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    registry = service_of(request).registry
    return json_response(training_run_json(registry, registry.run(tenant.name, model_id)), ttypes.TrainingRun)


@router.get("/api/v1/training_runs/{model_id}/checkpoints")
async def list_checkpoints(model_id: str, request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    records = service_of(request).registry.checkpoints(tenant.name, model_id)
    return json_response({"checkpoints": [checkpoint_json(r) for r in records]}, ttypes.CheckpointsListResponse)


@router.get("/api/v1/checkpoints")
async def list_user_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> JSONResponse:
    tenant = tenant_of(request)
    records = list(reversed(service_of(request).registry.checkpoints(tenant.name)))
    page = records[max(0, offset):max(0, offset) + max(0, limit)]
    return json_response({"checkpoints": [checkpoint_json(r) for r in page],
                          "cursor": {"offset": offset, "limit": limit, "total_count": len(records)}},
                         ttypes.CheckpointsListResponse)


@router.post("/api/v1/weights_info")
async def weights_info(request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    registry = service_of(request).registry
    body = wire.parse_json(await request.body())
    tinker_path = body.get("tinker_path") if isinstance(body, dict) else None
    if not isinstance(tinker_path, str):
        raise BadRequest("weights_info takes {\"tinker_path\": \"tinker://...\"}")
    record = find_checkpoint(registry, tenant.name, tinker_path)
    run = registry.run(tenant.name, record.model_id)
    return json_response({"base_model": run.base_model, "optimizer_config": {"type": "adamw"}, "is_lora": True,
                          "lora_rank": run.lora_rank, "train_unembed": run.lora.get("train_unembed", True),
                          "train_mlp": run.lora.get("train_mlp", True),
                          "train_attn": run.lora.get("train_attn", True)}, ttypes.WeightsInfoResponse)


@router.delete("/api/v1/training_runs/{model_id}/checkpoints/{segment}/{name}")
async def delete_checkpoint(model_id: str, segment: str, name: str, request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    registry = service_of(request).registry
    record = checkpoint_at(registry, tenant.name, model_id, segment, name)
    registry.remove_checkpoint(tenant.name, record.tinker_path)
    shutil.rmtree(record.directory, ignore_errors=True)
    return json_response({})


@router.put("/api/v1/training_runs/{model_id}/checkpoints/{segment}/{name}/ttl")
async def set_checkpoint_ttl(model_id: str, segment: str, name: str, request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    checkpoint_at(service_of(request).registry, tenant.name, model_id, segment, name)
    body = wire.parse_json(await request.body())
    ttl = body.get("ttl_seconds") if isinstance(body, dict) else None
    if ttl is not None and (not isinstance(ttl, int) or ttl < 3600):
        raise BadRequest(f"ttl_seconds must be at least 3600 (1 hour) or null, got {ttl!r}")
    # accepted: checkpoints here are kept until deleted, which outlives any TTL the client asks for
    return json_response({})
