"""``save_weights_for_sampler``: with a name, a sampler checkpoint (a PEFT adapter directory,
``tinker://<run>/sampler_weights/<name>``); without one (the SDK's ``save_weights_and_get_sampling_client``), an
ephemeral export and a sampling session on it: a ``snapshot`` keeps the weights of the moment, ``inflight`` follows
the run's latest inflight export."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from tinker import types as ttypes

from twinkle_server import tinker_wire as wire
from twinkle_server.errors import BadRequest
from twinkle_server.tinker_common import future_response, is_registered, service_of, tenant_of
from twinkle_server.tinker_futures import tenant_queue
from twinkle_server.tinker_samplers import MAX_EPHEMERAL_SNAPSHOTS, HostSamplers, host_samplers_of
from twinkle_server.tinker_sampling_sessions import SamplingSession, SamplingSessions, sampling_sessions_of

router = APIRouter()


@router.post("/api/v1/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    registry = service_of(request).registry
    queue = tenant_queue(request, tenant)
    samplers = host_samplers_of(request)
    body = await request.body()
    req = wire.parse_model(ttypes.SaveWeightsForSamplerRequest, body)
    if (known := queue.earlier("save_sampler", req.model_id, req.seq_id, body)) is not None:
        return future_response(known, model_id=req.model_id)
    run = registry.run(tenant.name, req.model_id)
    host = queue.service.host(run.base_model)
    if req.path is not None:
        work = save_sampler_checkpoint(registry, samplers, host, run, req.path, req.user_metadata)
    else:
        root = registry.state_dir / "tenants" / run.tenant / run.model_id / "tinker_ephemeral"
        work = save_ephemeral(sampling_sessions_of(request), samplers, host, run, req.kind, root)
    return future_response(queue.submit("save_sampler", run.base_model, work, scope=req.model_id, seq_id=req.seq_id,
                                        body=body), model_id=req.model_id)


def save_sampler_checkpoint(registry: Any, samplers: HostSamplers, host: Any, run: Any, name: str,
                            user_metadata: dict[str, Any] | None) -> Any:
    """The work that writes the named sampler checkpoint (refused now, and again when it runs, if it exists)."""
    final = registry.checkpoint_dir(run, "sampler", name)
    meta = {"user_metadata": user_metadata} if user_metadata is not None else {}

    def exists() -> None:
        if is_registered(registry, run, "sampler", name):
            raise BadRequest(f"sampler checkpoint {name!r} of {run.model_id} already exists; choose another "
                             f"name or delete it first")

    exists()

    def work() -> wire.WireResult:
        exists()
        samplers.unload(host, final)  # a sampler loaded from a deleted checkpoint of this name must not linger
        host.export_adapter(run.adapter_id, final)  # atomic
        record = registry.add_checkpoint(run, kind="sampler", name=name, optimizer=False, meta=meta)
        return wire.WireResult.json(wire.validated(ttypes.SaveWeightsForSamplerResponseInternal, {
            "path": record.tinker_path, "type": "save_weights_for_sampler"}))

    return work


def save_ephemeral(sessions: SamplingSessions, samplers: HostSamplers, host: Any, run: Any, kind: str,
                   root: Path) -> Any:
    """The work that exports the run's adapter under ``root`` and opens a sampling session on it; the exports it
    makes stale (the previous inflight one, snapshots beyond the last few) are unloaded and removed."""

    def work() -> wire.WireResult:
        directory = root / kind / uuid.uuid4().hex[:16]
        host.export_adapter(run.adapter_id, directory)
        session = SamplingSession(sampling_session_id=f"sampler-{uuid.uuid4().hex}", tenant=run.tenant,
                                  base_model=run.base_model, session_id=run.session_id, source=kind,
                                  directory=directory if kind == "snapshot" else None, model_id=run.model_id)
        sessions.add(session)
        stale: list[Path] = []
        if kind == "inflight":
            previous = samplers.publish_inflight(run.tenant, run.model_id, directory)
            if previous is not None:
                stale.append(previous)
        else:
            evicted = samplers.keep_snapshot(run.tenant, run.model_id, session.sampling_session_id, directory)
            for old_session, old_dir in evicted:
                stale.append(old_dir)
                sessions.expire(old_session, f"sampling session {old_session} expired: only the last "
                                             f"{MAX_EPHEMERAL_SNAPSHOTS} ephemeral snapshots of a training run are "
                                             f"kept; save again")
        for old in stale:
            samplers.unload(host, old)
            shutil.rmtree(old, ignore_errors=True)
        return wire.WireResult.json(wire.validated(ttypes.SaveWeightsForSamplerResponseInternal, {
            "sampling_session_id": session.sampling_session_id, "type": "save_weights_for_sampler"}))

    return work
