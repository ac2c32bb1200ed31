"""The native API's adapters: ``add_adapter_to_model`` / list / ``remove_adapter``, and what makes them durable.

An adapter has a name the tenant chose; inside the host it is ``native_<tenant>_<name>_<random>``, so tenants never
collide, and another tenant's adapter name answers 404 exactly like one that does not exist. The host counts it
against ``max_adapters`` with the Tinker runs' adapters (:meth:`~twinkle_server.host.ModelHost.add_lora_adapter`).

Durability: a created adapter is recorded in the registry (:class:`~twinkle_server.registry.NativeAdapterRecord`:
its LoRA config and seed) and forgotten when it is removed. After a restart :func:`restore` adds every recorded
adapter again, freshly initialised from its seed; its trained state comes back with ``resume_from_checkpoint`` /
``load`` on one of its checkpoints, as the client decides (as for Tinker runs: state lives in checkpoints).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request

from twinkle_server.errors import BadRequest, NotFound
from twinkle_server.full_host import adapter_refusal, is_full_parameter
from twinkle_server.native_args import integer
from twinkle_server.native_http import answer, authenticate, json_body, service_of, user_errors, wait_seconds
from twinkle_server.native_table import (
    ADAPTER_NAME,
    NativeAdapter,
    NativeAdapters,
    adapters_of,
    new_adapter_id,
)

log = logging.getLogger("twinkle.server")

router = APIRouter()

#: LoRA options a tenant may set: those that touch only the tenant's own adapter weights
LORA_OPTIONS = frozenset({"type", "r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "use_dora",
                          "rank_pattern", "alpha_pattern", "layers_to_transform", "init_lora_weights", "bias"})
#: why the others are refused
LORA_REFUSED = {
    "modules_to_save": "it trains a full copy of whole modules (embeddings, heads) per tenant",
    "bias": "bias other than 'none' trains the shared base model's biases",
    "init_lora_weights": "initialisations other than true / false / 'gaussian' (pissa, olora, loftq, eva ...) "
                         "rewrite the shared base weights",
}


def check_lora_config(config: Any) -> dict[str, Any]:
    """A tenant's LoRA config (a dict), with every option that would touch the shared base refused."""
    if not isinstance(config, dict):
        raise BadRequest(f"config must be a LoRA config mapping such as {{'r': 8, 'lora_alpha': 16, "
                         f"'target_modules': 'all-linear'}}, got {type(config).__name__}")
    for key, why in LORA_REFUSED.items():
        if key not in config:
            continue
        value = config[key]
        if key == "bias" and value == "none":
            continue
        if key == "init_lora_weights" and (value in (True, False, "gaussian")):
            continue
        raise BadRequest(f"LoRA option {key}={value!r} is not accepted by the server: {why}")
    unknown = sorted(set(config) - LORA_OPTIONS)
    if unknown:
        raise BadRequest(f"unknown LoRA option(s) {unknown}; the server accepts {sorted(LORA_OPTIONS)}")
    if config.get("type", "lora") != "lora":
        raise BadRequest(f"adapter type {config['type']!r}: the server trains LoRA adapters only")
    return {k: v for k, v in config.items() if k != "type"}


def restore(service: Any, table: NativeAdapters) -> None:
    """At startup: every adapter the registry records is added again (fresh weights from its seed, as at its
    creation) and listed in ``table``, in the order they were created."""
    for record in sorted(service.registry.native_adapters.values(), key=lambda r: r.created):
        host = service.hosts.get(record.base_model)
        if host is None or is_full_parameter(host):  # as for a Tinker run: the record stays, should it come back
            log.warning("native adapter %r of tenant %s: base model %s is no longer hosted for LoRA training; its "
                        "checkpoints stay on disk", record.name, record.tenant, record.base_model)
            continue
        entry = NativeAdapter.from_record(record)
        table.reserve(entry)
        try:
            host.add_lora_adapter(entry.adapter_id, entry.config, seed=entry.seed)
        except BaseException:
            table.drop(entry)
            raise
        entry.ready = True


# ============================================================================================ routes
@router.get("/adapters")
async def list_adapters(request: Request, base_model: str | None = None) -> dict[str, Any]:
    tenant = authenticate(request)
    return {"adapters": [e.describe() for e in adapters_of(request.app.state).of_tenant(tenant.name, base_model)]}


@router.post("/adapters")
async def create_adapter(request: Request) -> Any:
    tenant = authenticate(request)
    service, table = service_of(request), adapters_of(request.app.state)
    body = await json_body(request)
    unknown = sorted(set(body) - {"name", "base_model", "config", "seed", "wait_s"})
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; known: name, base_model, config, seed, wait_s")
    name, base_model = body.get("name"), body.get("base_model")
    if not isinstance(name, str) or not ADAPTER_NAME.match(name):
        raise BadRequest(f"adapter name {name!r} must be 1-64 letters, digits, '_' or '-'")
    if not isinstance(base_model, str):
        raise BadRequest(f"base_model must name a hosted base model; hosted: {service.hosted(tenant.name)}")
    host = service.host(base_model, tenant.name)
    if is_full_parameter(host):
        raise BadRequest(adapter_refusal(base_model))
    config = check_lora_config(body.get("config"))
    seed = integer(body.get("seed", 0), "seed")
    wait_s = wait_seconds(body.get("wait_s"))
    entry = NativeAdapter(tenant=tenant.name, name=name, adapter_id=new_adapter_id(tenant.name, name),
                          base_model=base_model, config=config, seed=seed)
    table.reserve(entry)  # the name is taken now: a second creation queued behind this one is refused at once

    def work() -> Any:
        try:
            user_errors("add_adapter_to_model",
                        lambda: host.add_lora_adapter(entry.adapter_id, config, seed=seed), entry.rename)
            try:  # recorded only once it exists: a restart never re-creates an adapter whose creation failed
                service.registry.add_native_adapter(entry.record())
            except BaseException:
                host.remove_lora_adapter(entry.adapter_id)
                raise
        except BaseException:
            table.drop(entry)
            raise
        entry.ready = True
        return entry.describe()

    try:
        request_id = service.submit(tenant, "native.add_adapter", base_model, work)
    except BaseException:
        table.drop(entry)
        raise
    return await answer(service, tenant, request_id, wait_s)


@router.delete("/adapters/{adapter}")
async def remove_adapter(adapter: str, request: Request, wait_s: float | None = None) -> Any:
    tenant = authenticate(request)
    service, table = service_of(request), adapters_of(request.app.state)
    entry = table.get(tenant.name, adapter)
    host = service.host(entry.base_model, tenant.name)

    def work() -> Any:
        if not table.current(entry):
            raise NotFound(f"adapter {adapter!r} not found")
        if entry.ready:
            host.remove_lora_adapter(entry.adapter_id)
        # forgotten only once it is gone: a crash in between restores it, and removing it again is harmless
        service.registry.remove_native_adapter(entry.adapter_id)
        table.drop(entry)
        return {"removed": adapter}

    request_id = service.submit(tenant, "native.remove_adapter", entry.base_model, work)
    return await answer(service, tenant, request_id, wait_seconds(wait_s))
