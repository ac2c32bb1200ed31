"""The server application: ``build_app(config)`` wires the tenants, the registry, the scheduler and one
:class:`~twinkle_server.host.ModelHost` per base model behind the HTTP routers (the Tinker API, the native API
and the console)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twinkle_server.config import ServerConfig
from twinkle_server.errors import NotFound, PayloadTooLarge, ServiceError
from twinkle_server.full_host import is_full_parameter, visible_to
from twinkle_server.metrics_log import MetricsLog
from twinkle_server.registry import Registry
from twinkle_server.scheduler import Scheduler
from twinkle_server.tenancy import Tenant, Tenants

log = logging.getLogger("twinkle.server")


@dataclass
class Service:
    """Everything a route needs, held on ``app.state.service``."""

    config: ServerConfig
    tenants: Tenants
    registry: Registry
    scheduler: Scheduler
    metrics: MetricsLog
    hosts: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    def host(self, base_model: str, tenant: str | None = None) -> Any:
        """The host of ``base_model``; a base model hosted for one tenant's full-parameter training exists only for
        its owner (the tenant named ``tenant``): for anyone else, and without ``tenant``, it is 404 exactly like an
        unknown one."""
        host = self.hosts.get(base_model)
        if host is None or not visible_to(host, tenant):
            raise NotFound(f"base model {base_model!r} is not hosted here; hosted: {self.hosted(tenant)}")
        return host

    def hosted(self, tenant: str | None) -> list[str]:
        """The base models ``tenant`` may know of (a full-parameter one only for its owner)."""
        return sorted(name for name, host in self.hosts.items() if visible_to(host, tenant))

    def tenant(self, api_key: str | None) -> Tenant:
        return self.tenants.authenticate(api_key)

    def record(self, tenant: Tenant, model_id: str, kind: str, values: dict[str, Any]) -> None:
        """Keep a run's metrics for the console (``kind``: ``forward_backward``, ``optim_step`` ...)."""
        self.metrics.record(tenant.name, model_id, kind, values)

    def submit(self, tenant: Tenant, kind: str, base_model: str, work: Callable[[], Any]) -> str:
        """Queue ``work`` on the lane of ``base_model``'s host (model calls on one host never overlap)."""
        self.host(base_model, tenant.name)
        return self.scheduler.submit(tenant.name, kind, work, lane=base_model)


def default_host_factory(config: ServerConfig) -> dict[str, Any]:
    from twinkle_server.full_host import FullParameterHost
    from twinkle_server.host import ModelHost

    def make(m: Any) -> Any:
        if m.ray is not None:  # the model in a worker group of Ray actors (twinkle-ray)
            from twinkle_server.ray_host import RayModelHost, local_cpus

            return RayModelHost(m.name, m.model, ray=m.ray, state_dir=config.state_dir, max_lora_rank=m.max_lora_rank,
                                max_adapters=m.max_adapters, local_cpus=local_cpus(config.base_models))
        return (FullParameterHost(m.name, m.model, owner=m.full_parameter.owner) if m.full_parameter is not None
                else ModelHost(m.name, m.model, state_dir=config.state_dir, max_lora_rank=m.max_lora_rank,
                               max_adapters=m.max_adapters))

    hosts: dict[str, Any] = {}
    try:
        for m in config.base_models:
            hosts[m.name] = make(m)
    except BaseException:
        close_hosts(hosts)  # a start that fails half-way leaves no worker group behind
        raise
    return hosts


def close_hosts(hosts: dict[str, Any]) -> None:
    """Stop what hosts run outside this process (a ``RayModelHost``'s worker group: ``close()``), last first."""
    for name, host in reversed(list(hosts.items())):
        close = getattr(host, "close", None)
        if close is None:
            continue
        try:
            close()
        except Exception:  # the other hosts are still closed; this one's failure is logged, not hidden
            log.exception("closing the host of %s failed", name)


def restore_adapters(service: Service, state: Any) -> None:
    """After a restart every registered adapter is back, freshly initialised from its recorded settings, each kind
    through its own API's path: a Tinker run through ``host.create_adapter`` (Tinker's LoRA settings), a native
    adapter through :func:`twinkle_server.native_adapters.restore` (its LoRA config and seed, listed again in the
    native API's table on the app's ``state``). The trained state comes back with ``load_state`` /
    ``resume_from_checkpoint`` on one of its checkpoints, as the client decides (Tinker's contract: state lives in
    checkpoints)."""
    for run in service.registry.runs.values():
        host = service.hosts.get(run.base_model)
        if host is None or is_full_parameter(host):
            log.warning("run %s of tenant %s: base model %s is no longer hosted for LoRA training; its checkpoints "
                        "stay on disk", run.model_id, run.tenant, run.base_model)
            continue
        host.create_adapter(run.adapter_id, rank=run.lora_rank, **run.lora)
    # imported here, as the routers are: this module stays importable without FastAPI
    from twinkle_server import native_adapters, native_table

    native_adapters.restore(service, native_table.adapters_of(state))


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413, by Content-Length and while streaming, before a route
    reads them into memory."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send, int(declared))
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise PayloadTooLarge(self._message(seen))
            return message

        try:
            await self.app(scope, limited_receive, send)
        except PayloadTooLarge:
            await self._refuse(send, seen)

    def _message(self, size: int) -> str:
        return (f"request body of {size} bytes is over the server's limit of {self.limit} bytes (limits.max_body_mb); "
                f"send fewer datums per request")

    async def _refuse(self, send: Callable, size: int) -> None:
        import json

        body = json.dumps({"error": self._message(size), "category": "user", "status": 413}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def error_response(exc: ServiceError) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=exc.status,
                        content={"error": exc.message, "category": exc.category, "status": exc.status,
                                 "detail": exc.message})


def build_app(config: ServerConfig, *, hosts: dict[str, Any] | None = None,
              host_factory: Callable[[ServerConfig], dict[str, Any]] = default_host_factory) -> Any:
    from fastapi import FastAPI, Request

    registry = Registry(config.state_dir)
    service = Service(config=config, tenants=Tenants(config.tenants), registry=registry,
                      metrics=MetricsLog(config.state_dir),
                      scheduler=Scheduler(max_queued_per_tenant=config.limits.max_queued_per_tenant))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        service.hosts = hosts if hosts is not None else host_factory(config)
        try:
            restore_adapters(service, app.state)
            log.info("twinkle serve: hosting %s for %d tenant(s); state in %s", sorted(service.hosts),
                     len(config.tenants), config.state_dir)
            yield
        finally:
            service.scheduler.stop()
            if hosts is None:  # the hosts this app made: their worker groups stop with it
                close_hosts(service.hosts)

    app = FastAPI(title="Twinkle training service", lifespan=lifespan)
    app.state.service = service

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):
        return error_response(exc)

    for router in _routers():
        app.include_router(router)
    app.add_middleware(BodyLimit, limit=config.limits.max_body_bytes)
    return app


def _routers() -> list[Any]:
    """The routers of the API surfaces: the Tinker API, the native API and the console."""
    from twinkle_server import console, native_api, tinker_api

    return [tinker_api.router, native_api.router, console.router]
