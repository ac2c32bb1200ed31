"""The native API: Twinkle's own ``TwinkleModel`` calls over HTTP, for :mod:`twinkle_server.client`. This module
assembles the :data:`router` that :mod:`twinkle_server.app` includes; each concern lives in its own module.

Every tenant trains LoRA adapters on a hosted base model (a ``MultiLoraTransformersModel`` held by the base model's
:class:`~twinkle_server.host.ModelHost`); a base model hosted for one tenant's full-parameter training
(:mod:`twinkle_server.full_host`) has no adapters: its owner calls the model itself at ``/full/...``
(:mod:`twinkle_server.native_full`), and nobody else sees it.

Routes (all under ``/twinkle/v1``; the API key in ``X-API-Key`` or ``Authorization: Bearer``)::

    GET    /models                                   the base models the tenant may use (``full_parameter``:
                                                     its own full-parameter one), the method whitelist, loss /
                                                     optimizer / scheduler / metric names
    GET    /adapters                                 the tenant's adapters           (native_adapters)
    POST   /adapters                                 {name, base_model, config, seed}: add_adapter_to_model
    DELETE /adapters/{name}                          remove_adapter
    POST   /adapters/{name}/call                     {method, args, wait_s}: one TwinkleModel call (native_calls)
    GET    /futures/{request_id}?wait_s=             the outcome of a call answered 202
    GET    /adapters/{name}/checkpoints              names saved by ``save``         (native_checkpoints)
    GET    /adapters/{name}/checkpoints/{ckpt}       its files (path, size, sha256, weights)
    GET    /adapters/{name}/checkpoints/{ckpt}/files/{path}   one file
    POST   /full/call, GET /full/checkpoints...      the same on a full-parameter base model (``base_model`` in
                                                     the body or the query)            (native_full)

Every model call (adapter creation and removal included) goes through ``service.submit``: ordered per tenant,
fair across tenants, never concurrent with another call on the same base model. The handler waits up to
``wait_s`` (default 30 s) for the outcome: ``200 {"result": ...}``, or ``202 {"future": id}`` which the
client polls at ``/futures/{id}`` (:mod:`twinkle_server.native_http`). Arguments and results are JSON with tensors
encoded by :mod:`twinkle_server.tensor_wire` (never pickled); batches are checked before they reach the shared
model (:mod:`twinkle_server.native_batch`).

Adapters survive a restart: they are recorded in the registry and re-created at startup
(:func:`twinkle_server.native_adapters.restore`); their trained state lives in their checkpoints.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from twinkle_server import native_adapters, native_calls, native_checkpoints, native_full
from twinkle_server.full_host import is_full_parameter
from twinkle_server.native_adapters import check_lora_config
from twinkle_server.native_batch import check_batch
from twinkle_server.native_calls import METHODS
from twinkle_server.native_http import answer, authenticate, service_of, wait_seconds
from twinkle_server.native_table import NativeAdapter, NativeAdapters

router = APIRouter(prefix="/twinkle/v1", tags=["native"])


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    from twinkle_core.plugins import get_plugins

    tenant = authenticate(request)
    service = service_of(request)
    plugins = get_plugins()
    return {
        "models": [{"name": name, "max_lora_rank": getattr(service.hosts[name], "max_lora_rank", None),
                    "vocab_size": getattr(service.hosts[name], "vocab_size", None),
                    "full_parameter": is_full_parameter(service.hosts[name])}
                   for name in service.hosted(tenant.name)],
        "methods": sorted(METHODS),
        "losses": plugins.names("loss"), "optimizers": plugins.names("optimizer"),
        "schedulers": plugins.names("scheduler"), "metrics": plugins.names("metric"),
    }


@router.get("/futures/{request_id}")
async def future(request_id: str, request: Request, wait_s: float | None = None) -> Any:
    tenant = authenticate(request)
    return await answer(service_of(request), tenant, request_id, wait_seconds(wait_s))


router.include_router(native_adapters.router)
router.include_router(native_calls.router)
router.include_router(native_checkpoints.router)
router.include_router(native_full.router)

__all__ = ["METHODS", "NativeAdapter", "NativeAdapters", "check_batch", "check_lora_config", "router"]
