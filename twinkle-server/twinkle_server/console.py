"""The web console (``GET /console``): tenants, runs, live loss curves, checkpoints and queue depth.

The page is one static file (no CDN, no build step) that polls ``/console/api/overview`` with the visitor's API key
(``X-API-Key``; typed into the page, kept in the tab's sessionStorage). A tenant sees its own runs; a tenant listed
in the config's ``admins`` sees every tenant's. Queue depth is shown per base model without other tenants' names
unless the visitor is an admin.

A run is a Tinker training run (its ``model_id``), a native-API adapter (``native:<its name inside the host>``,
shown by the tenant's name for it) or the owner's training of a full-parameter base (``full:<base model>``, listed
once it has recorded a step or a loss, and only to its owner and admins: nobody else learns that the base exists).
Their metrics come from :mod:`twinkle_server.metrics_log` under those keys.
"""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import HTMLResponse

from twinkle_server.errors import NotFound
from twinkle_server.full_host import is_full_parameter
from twinkle_server.metrics_log import adapter_key, full_key
from twinkle_server.native_checkpoints import MARKER, checkpoint_root, saved_names
from twinkle_server.native_full import full_checkpoint_root

router = APIRouter()


@router.get("/console", response_class=HTMLResponse, include_in_schema=False)
def page() -> str:
    return resources.files("twinkle_server").joinpath("console.html").read_text()


def _curve(service: Any, tenant: str, key: str) -> dict[str, Any]:
    """Steps (optimizer steps recorded) and the last loss of the run kept under ``key``."""
    points = service.metrics.points(tenant, key)
    losses = [p for p in points if "loss" in p]
    return {"steps": sum(1 for p in points if p["kind"] == "optim_step"),
            "last_loss": losses[-1]["loss"] if losses else None, "first": points[0]["time"] if points else None}


def _saved(root: Path, kind: str) -> list[dict[str, Any]]:
    """A native checkpoint directory's complete checkpoints, by the names ``load`` takes."""
    saved = []
    for name in saved_names(root):
        try:
            created = (root / name / MARKER).stat().st_mtime
        except FileNotFoundError:  # replaced or removed since it was listed: the next poll shows it as it is
            continue
        saved.append({"path": name, "kind": kind, "created": created})
    return saved


def _tinker_run(service: Any, run: Any) -> dict[str, Any]:
    curve = _curve(service, run.tenant, run.model_id)
    checkpoints = service.registry.checkpoints(run.tenant, run.model_id)
    return {"model_id": run.model_id, "name": run.model_id, "kind": "Tinker run", "tenant": run.tenant,
            "base_model": run.base_model, "lora_rank": run.lora_rank, "created": run.created,
            "steps": curve["steps"], "last_loss": curve["last_loss"],
            "checkpoints": [{"path": c.tinker_path, "kind": c.kind, "created": c.created} for c in checkpoints]}


def _native_adapter(service: Any, record: Any) -> dict[str, Any]:
    key = adapter_key(record.adapter_id)
    curve = _curve(service, record.tenant, key)
    return {"model_id": key, "name": record.name, "kind": "native adapter", "tenant": record.tenant,
            "base_model": record.base_model, "lora_rank": record.config.get("r"), "created": record.created,
            "steps": curve["steps"], "last_loss": curve["last_loss"],
            "checkpoints": _saved(checkpoint_root(service, record.tenant, record.name), "native")}


def _full_model(service: Any, host: Any) -> dict[str, Any] | None:
    """The owner's training of a full-parameter base, once it has recorded anything."""
    key = full_key(host.name)
    curve = _curve(service, host.owner, key)
    if curve["first"] is None:
        return None
    return {"model_id": key, "name": host.name, "kind": "full parameter", "tenant": host.owner,
            "base_model": host.name, "lora_rank": None, "created": curve["first"],
            "steps": curve["steps"], "last_loss": curve["last_loss"],
            "checkpoints": _saved(full_checkpoint_root(service, host.owner, host.name), "full")}


def _runs(service: Any, tenant: str) -> list[dict[str, Any]]:
    """``tenant``'s runs of every kind, oldest first: Tinker runs, native adapters and, for the owner of a
    full-parameter base, its training."""
    runs = [_tinker_run(service, r) for r in service.registry.tenant_runs(tenant)]
    runs += [_native_adapter(service, r) for r in list(service.registry.native_adapters.values())
             if r.tenant == tenant]
    fulls = (_full_model(service, h) for h in list(service.hosts.values())
             if is_full_parameter(h) and h.owner == tenant)
    runs += [r for r in fulls if r is not None]
    return sorted(runs, key=lambda r: r["created"])


def _run_owner(service: Any, model_id: str) -> str | None:
    """The tenant whose run ``model_id`` (a console run id) is; ``None``: no such run."""
    rest = model_id.partition(":")[2]
    if model_id == adapter_key(rest):
        record = service.registry.native_adapters.get(rest)
        return None if record is None else record.tenant
    if model_id == full_key(rest):
        host = service.hosts.get(rest)
        return host.owner if is_full_parameter(host) else None
    run = service.registry.runs.get(model_id)
    return None if run is None else run.tenant


@router.get("/console/api/overview")
def overview(request: Request, x_api_key: str | None = Header(default=None)) -> dict[str, Any]:
    service = request.app.state.service
    tenant = service.tenant(x_api_key)
    admin = tenant.name in service.config.admins
    visible = service.tenants.names if admin else (tenant.name,)
    runs = [run for name in visible for run in _runs(service, name)]
    # another tenant's full-parameter base model is not disclosed (admins see every base model)
    base_models = sorted(service.hosts) if admin else service.hosted(tenant.name)
    depths = {lane: d for lane, d in service.scheduler.queue_depths().items() if lane in base_models}
    queue = {lane: (per_tenant if admin else {"yours": per_tenant.get(tenant.name, 0),
                                              "others": sum(v for t, v in per_tenant.items() if t != tenant.name)})
             for lane, per_tenant in depths.items()}
    running = {lane: (None if now is None else {"kind": now[1], "tenant": now[0] if admin or now[0] == tenant.name
                                                else "another tenant"})
               for lane, now in service.scheduler.running().items() if lane in base_models}
    return {"tenant": tenant.name, "admin": admin, "tenants": list(visible), "base_models": base_models,
            "runs": runs, "queue": queue, "running": running, "uptime_s": time.time() - service.started}


@router.get("/console/api/runs/{model_id:path}/metrics")
def run_metrics(model_id: str, request: Request, since: int = -1,
                x_api_key: str | None = Header(default=None)) -> dict[str, Any]:
    """A run's points after index ``since``; another tenant's run (unless the visitor is an admin) is 404 exactly
    like one that does not exist."""
    service = request.app.state.service
    tenant = service.tenant(x_api_key)
    owner = _run_owner(service, model_id)
    if owner is None or (owner != tenant.name and tenant.name not in service.config.admins):
        raise NotFound(f"training run (model_id) {model_id!r} not found")
    return {"model_id": model_id, "points": service.metrics.points(owner, model_id, since=since)}
