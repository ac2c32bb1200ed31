"""The web console (``GET /console``): tenants, runs, live loss curves, checkpoints and queue depth.

The page is one static file (no CDN, no build step) that polls ``/console/api/overview`` with the visitor's API key
(``X-API-Key``; typed into the page, kept in the tab's sessionStorage). A tenant sees its own runs; a tenant listed
in the config's ``admins`` sees every tenant's. Queue depth is shown per base model without other tenants' names
unless the visitor is an admin.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import HTMLResponse

router = APIRouter()


@router.get("/console", response_class=HTMLResponse, include_in_schema=False)
def page() -> str:
    return resources.files("twinkle_server").joinpath("console.html").read_text()


def _run_summary(service: Any, run: Any) -> dict[str, Any]:
    points = service.metrics.points(run.tenant, run.model_id)
    losses = [p for p in points if "loss" in p]
    checkpoints = service.registry.checkpoints(run.tenant, run.model_id)
    return {"model_id": run.model_id, "tenant": run.tenant, "base_model": run.base_model, "lora_rank": run.lora_rank,
            "created": run.created, "steps": sum(1 for p in points if p["kind"] == "optim_step"),
            "last_loss": losses[-1]["loss"] if losses else None,
            "checkpoints": [{"path": c.tinker_path, "kind": c.kind, "created": c.created} for c in checkpoints]}


@router.get("/console/api/overview")
def overview(request: Request, x_api_key: str | None = Header(default=None)) -> dict[str, Any]:
    service = request.app.state.service
    tenant = service.tenant(x_api_key)
    admin = tenant.name in service.config.admins
    visible = service.tenants.names if admin else (tenant.name,)
    runs = [_run_summary(service, r) for name in visible for r in service.registry.tenant_runs(name)]
    depths = service.scheduler.queue_depths()
    queue = {lane: (per_tenant if admin else {"yours": per_tenant.get(tenant.name, 0),
                                              "others": sum(v for t, v in per_tenant.items() if t != tenant.name)})
             for lane, per_tenant in depths.items()}
    running = {lane: (None if now is None else {"kind": now[1], "tenant": now[0] if admin or now[0] == tenant.name
                                                else "another tenant"})
               for lane, now in service.scheduler.running().items()}
    return {"tenant": tenant.name, "admin": admin, "tenants": list(visible), "base_models": sorted(service.hosts),
            "runs": runs, "queue": queue, "running": running, "uptime_s": time.time() - service.started}


@router.get("/console/api/runs/{model_id}/metrics")
def run_metrics(model_id: str, request: Request, since: int = -1,
                x_api_key: str | None = Header(default=None)) -> dict[str, Any]:
    service = request.app.state.service
    tenant = service.tenant(x_api_key)
    owner = tenant.name
    if tenant.name in service.config.admins:
        run = service.registry.runs.get(model_id)
        owner = run.tenant if run is not None else tenant.name
    run = service.registry.run(owner, model_id)
    return {"model_id": run.model_id, "points": service.metrics.points(run.tenant, run.model_id, since=since)}
