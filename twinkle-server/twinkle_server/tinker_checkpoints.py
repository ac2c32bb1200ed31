"""Tinker checkpoint writes and loads, each queued on the base model's lane and answered with a future:
``save_weights`` (a training checkpoint, ``tinker://<run>/weights/<name>``), ``save_weights_external`` (a PEFT adapter
to download, ``.../external_weights/<name>``) and ``load_weights`` (into an existing run, or a new run created from
the checkpoint). Sampler weights are in :mod:`twinkle_server.tinker_sampler_weights`."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from tinker import types as ttypes

from twinkle_server import tinker_wire as wire
from twinkle_server.errors import BadRequest, NotFound
from twinkle_server.tinker_common import (
    CHECKPOINT_TYPE_OF_KIND,
    check_session,
    directory_size,
    find_checkpoint,
    future_response,
    is_registered,
    require_adam,
    service_of,
    tenant_of,
    unsupported,
)
from twinkle_server.tinker_futures import TenantQueue, tenant_queue
from twinkle_server.tinker_samplers import host_samplers_of

router = APIRouter()


@router.post("/api/v1/save_weights")
async def save_weights(request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    registry = service_of(request).registry
    queue = tenant_queue(request, tenant)
    body = await request.body()
    req = wire.parse_model(ttypes.SaveWeightsRequest, body)
    if (known := queue.earlier("save_state", req.model_id, req.seq_id, body)) is not None:
        return future_response(known, model_id=req.model_id)
    run = registry.run(tenant.name, req.model_id)
    host = queue.service.host(run.base_model)
    name = req.path or f"state-{req.seq_id if req.seq_id is not None else uuid.uuid4().hex[:8]}"
    final = registry.checkpoint_dir(run, "state", name)  # validates the name

    def exists() -> None:
        if not req.overwrite and is_registered(registry, run, "state", name):
            raise BadRequest(f"checkpoint {name!r} of {req.model_id} already exists; pass overwrite=True or "
                             f"choose another name")

    exists()
    meta = {"user_metadata": req.user_metadata} if req.user_metadata is not None else {}

    def work() -> wire.WireResult:
        exists()
        host.save_state(run.adapter_id, final, optimizer=True)  # atomic; replaces an overwritten one
        record = registry.add_checkpoint(run, kind="state", name=name, optimizer=True, meta=meta)
        return wire.WireResult.json(wire.validated(ttypes.SaveWeightsResponse,
                                                   {"path": record.tinker_path, "type": "save_weights"}))

    return future_response(queue.submit("save_state", run.base_model, work, scope=req.model_id, seq_id=req.seq_id,
                                        body=body), model_id=req.model_id)


@router.post("/api/v1/save_weights_external")
async def save_weights_external(request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    registry = service_of(request).registry
    queue = tenant_queue(request, tenant)
    samplers = host_samplers_of(request)
    body = await request.body()
    req = wire.parse_model(ttypes.SaveWeightsExternalRequest, body)
    if (known := queue.earlier("save_external", req.model_id, req.seq_id, body)) is not None:
        return future_response(known, model_id=req.model_id)
    if req.age_encryption_recipients:
        raise unsupported("age_encryption_recipients (encrypted exports)", "export unencrypted")
    run = registry.run(tenant.name, req.model_id)
    host = queue.service.host(run.base_model)
    final = registry.checkpoint_dir(run, "external", req.path)

    def exists() -> None:
        if is_registered(registry, run, "external", req.path):
            raise BadRequest(f"external weights {req.path!r} of {req.model_id} already exist; choose another "
                             f"name or delete them first")

    exists()

    def work() -> wire.WireResult:
        exists()
        samplers.unload(host, final)
        host.export_adapter(run.adapter_id, final)  # atomic
        record = registry.add_checkpoint(run, kind="external", name=req.path, optimizer=False)
        return wire.WireResult.json(wire.validated(ttypes.SaveWeightsExternalResponseInternal, {
            "path": record.tinker_path, "size_bytes": directory_size(final), "type": "save_weights_external"}))

    return future_response(queue.submit("save_external", run.base_model, work, scope=req.model_id,
                                        seq_id=req.seq_id, body=body), model_id=req.model_id)


@router.post("/api/v1/load_weights")
async def load_weights(request: Request) -> JSONResponse:
    """Load a training checkpoint into the run ``model_id``, or (``session_id`` and ``model_seq_id``: the SDK's
    ``create_training_client_from_state``) into a new run with the id the SDK derives, ``<session_id>:train:<seq>``."""
    tenant = tenant_of(request)
    registry = service_of(request).registry
    queue = tenant_queue(request, tenant)
    body = await request.body()
    req = wire.parse_model(ttypes.LoadWeightsRequest, body)
    new_run = req.session_id is not None
    scope = req.session_id if new_run else req.model_id
    seq = req.model_seq_id if new_run else req.seq_id
    kind = "create_model" if new_run else "load_state"
    if (known := queue.earlier(kind, scope or "", seq, body)) is not None:
        return future_response(known, model_id=req.model_id or f"{req.session_id}:train:{req.model_seq_id}")
    if req.weights_access_token:
        raise unsupported("weights_access_token (loading another account's checkpoint)",
                          "load checkpoints of your own tenant")
    record = find_checkpoint(registry, tenant.name, req.path)
    if record.kind != "state":
        raise BadRequest(f"{req.path} is a {CHECKPOINT_TYPE_OF_KIND.get(record.kind, record.kind)} checkpoint; "
                         f"load_state takes a training checkpoint (save_state's path, tinker://<run>/weights/<name>)")
    if req.optimizer and not record.optimizer:
        raise BadRequest(f"{req.path} was saved without optimizer state; load it without the optimizer")
    try:
        source = registry.run(tenant.name, record.model_id)
    except NotFound:
        source = None
    if new_run or req.model_id is None:
        return load_into_new_run(queue, req, record, source, body)
    return load_into_run(queue, req, record, source, body)


def load_into_run(queue: TenantQueue, req: ttypes.LoadWeightsRequest, record: Any, source: Any,
                  body: bytes) -> JSONResponse:
    """``load_state``: the checkpoint's weights (and optimizer state, if asked) into the existing run."""
    run = queue.service.registry.run(queue.tenant.name, req.model_id)
    if source is not None and (source.base_model != run.base_model or source.lora_rank != run.lora_rank):
        raise BadRequest(f"{req.path} holds a rank-{source.lora_rank} adapter of {source.base_model}; "
                         f"{req.model_id} is a rank-{run.lora_rank} adapter of {run.base_model}")
    host = queue.service.host(run.base_model)
    directory, optimizer = record.directory, bool(req.optimizer)

    def work() -> wire.WireResult:
        host.load_state(run.adapter_id, directory, optimizer=optimizer)
        return wire.WireResult.json(wire.validated(ttypes.LoadWeightsResponse, {
            "path": req.path, "model_id": req.model_id, "type": "load_weights"}))

    return future_response(queue.submit("load_state", run.base_model, work, scope=req.model_id, seq_id=req.seq_id,
                                        body=body), model_id=req.model_id)


def load_into_new_run(queue: TenantQueue, req: ttypes.LoadWeightsRequest, record: Any, source: Any,
                      body: bytes) -> JSONResponse:
    """``create_training_client_from_state``: a new run with the source run's LoRA settings, loaded from the
    checkpoint. Its model id is the one the SDK derives and then uses, ``<session_id>:train:<model_seq_id>``."""
    service, tenant = queue.service, queue.tenant
    if req.session_id is None or req.model_seq_id is None:
        raise BadRequest("load_weights needs either model_id (an existing run) or session_id and "
                         "model_seq_id (a new run from the checkpoint)")
    check_session(service.registry, tenant.name, req.session_id)
    require_adam(req.optimizer_config)
    if source is None:
        raise NotFound(f"the training run of {req.path} no longer exists, so its LoRA settings are unknown")
    base_model = req.base_model or source.base_model
    if base_model != source.base_model:
        raise BadRequest(f"{req.path} was trained on {source.base_model}, not {base_model}")
    host = service.host(base_model)
    model_id = f"{req.session_id}:train:{req.model_seq_id}"
    try:
        service.registry.run(tenant.name, model_id)
        raise BadRequest(f"model {model_id} already exists in this session")
    except NotFound:
        pass
    meta = {"api": "tinker", "loaded_from": req.path}
    if req.user_metadata:
        meta["user_metadata"] = req.user_metadata
    directory, optimizer = record.directory, bool(req.optimizer)

    def work() -> wire.WireResult:
        run = service.registry.new_run(tenant.name, base_model=base_model, lora_rank=source.lora_rank,
                                       lora=dict(source.lora), session_id=req.session_id, meta=meta,
                                       model_id=model_id)
        try:
            host.create_adapter(run.adapter_id, rank=source.lora_rank, **source.lora)
            host.load_state(run.adapter_id, directory, optimizer=optimizer)
        except BaseException:
            try:
                host.remove_adapter(run.adapter_id)
            except Exception:  # noqa: BLE001 - the adapter may not exist; the run must go either way
                pass
            service.registry.remove_run(tenant.name, run.model_id)
            raise
        return wire.WireResult.json(wire.validated(ttypes.LoadWeightsResponse, {
            "path": req.path, "model_id": model_id, "type": "load_weights"}))

    return future_response(queue.submit("create_model", base_model, work, scope=req.session_id,
                                        seq_id=req.model_seq_id, body=body), model_id=model_id)
