"""The native API on a full-parameter base model (:mod:`twinkle_server.full_host`): its owner's ``TwinkleModel``
calls on the model itself, and its checkpoints.

A call names the base model, not an adapter: a full-parameter base has no adapters, and every call runs with
``adapter_name=None`` on the whole model, exactly as on a local ``TransformersModel``. Routes (under
``/twinkle/v1``)::

    POST /full/call                                  {base_model, method, args, wait_s}: one TwinkleModel call
    GET  /full/checkpoints?base_model=               names saved by ``save``
    GET  /full/checkpoints/{ckpt}?base_model=        its files (path, size, sha256, weights)
    GET  /full/checkpoints/{ckpt}/files/{path}?base_model=   one file

The methods and their argument checks are the adapters' (:data:`twinkle_server.native_calls.METHODS`), except
``get_train_configs`` and ``get_state_dict``, which describe the whole model. Only the owner reaches these routes:
anyone else gets the 404 of a base model that is not hosted. A checkpoint lives under
``state_dir/tenants/<owner>/full/<base model, URL-quoted>/<name>``, by names only: it outlives a restart, and its
weights (``save``'s files outside ``twinkle_state/``) are a Hugging Face model directory (``config.json``,
``model.safetensors``, the tokenizer) that ``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from twinkle_server import tensor_wire
from twinkle_server.errors import BadRequest, NotFound, PayloadTooLarge
from twinkle_server.full_host import is_full_parameter
from twinkle_server.native_args import Call, call_request, take
from twinkle_server.native_calls import METHODS
from twinkle_server.native_checkpoints import (
    MARKER,
    checkpoint_files,
    checkpoint_name,
    file_response,
    saved_names,
)
from twinkle_server.native_http import answer, authenticate, json_body, service_of, wait_seconds
from twinkle_server.native_table import adapters_of

router = APIRouter()


@dataclass(frozen=True)
class FullModel:
    """The target of a call on a full-parameter base: the model itself, as the owner's ``Call.entry``."""

    tenant: str
    base_model: str
    adapter_id: None = None  # every call runs on the whole model
    rename: None = None  # messages need no renaming: there is no name inside the model to hide

    @property
    def name(self) -> str:
        return self.base_model


def full_checkpoint_root(service: Any, tenant: str, base_model: str) -> Path:
    return Path(service.config.state_dir) / "tenants" / tenant / "full" / quote(base_model, safe="")


# ============================================================================================ the calls
def _get_train_configs(call: Call) -> Callable[[], Any]:
    take(call.args, "get_train_configs")

    def run() -> Any:
        configs = dict(call.guard("get_train_configs", lambda: call.model.get_train_configs(adapter_name=None)))
        configs["base_model"] = call.entry.base_model
        return tensor_wire.jsonable(configs)
    return run


def _get_state_dict(call: Call) -> Callable[[], Any]:
    take(call.args, "get_state_dict")
    limit = 4 * call.service.config.limits.max_body_bytes

    def run() -> Any:
        state = call.model.get_state_dict(adapter_name=None)
        size = sum(v.numel() * v.element_size() for v in state.values())
        if size > limit:
            raise PayloadTooLarge(f"get_state_dict: the model's weights are {size:,} bytes, over the server's "
                                  f"response limit of {limit:,} bytes (4 x limits.max_body_mb); save() them and "
                                  f"download the checkpoint instead")
        return tensor_wire.encode(state)
    return run


#: the methods on a full-parameter model: the adapters', with the model-wide state calls
FULL_METHODS: dict[str, Callable[[Call], Callable[[], Any]]] = {
    **METHODS, "get_train_configs": _get_train_configs, "get_state_dict": _get_state_dict}


# ============================================================================================ routes
def _owned(request: Request, tenant: Any, base_model: Any) -> tuple[Any, Any]:
    """The service and host of ``tenant``'s full-parameter ``base_model`` (404 for anyone but its owner)."""
    service = service_of(request)
    if not isinstance(base_model, str):
        raise BadRequest(f"base_model must name your full-parameter base model; hosted: "
                         f"{service.hosted(tenant.name)}")
    host = service.host(base_model, tenant.name)
    if not is_full_parameter(host):
        raise BadRequest(f"{base_model!r} is shared through LoRA adapters: add one with add_adapter_to_model and "
                         f"call it by name (POST /twinkle/v1/adapters/{{name}}/call)")
    return service, host


@router.post("/full/call")
async def call(request: Request) -> Any:
    tenant = authenticate(request)
    body = await json_body(request)
    service, host = _owned(request, tenant, body.get("base_model"))
    checked = call_request(body, FULL_METHODS, ("base_model",))
    method, prepare, args, wait_s = checked.method, checked.prepare, checked.args, wait_seconds(checked.wait_s)
    entry = FullModel(tenant=tenant.name, base_model=host.name)
    checkpoints = full_checkpoint_root(service, tenant.name, host.name)
    table = adapters_of(request.app.state)

    def decode_and_check() -> Callable[[], Any]:
        decoded = tensor_wire.decode(args, where=f"{method}.args")
        return prepare(Call(service=service, host=host, entry=entry, table=table, args=decoded,
                            checkpoints=checkpoints))

    run = await run_in_threadpool(decode_and_check)  # decoding and checking a large batch is not the event loop's
    request_id = service.submit(tenant, f"native.full.{method}", host.name, run)
    return await answer(service, tenant, request_id, wait_s)


def _checkpoint_dir(service: Any, tenant: Any, base_model: str, name: str) -> Path:
    name = checkpoint_name(name, "checkpoint")
    directory = full_checkpoint_root(service, tenant.name, base_model) / name
    if not (directory / MARKER).is_file():
        raise NotFound(f"{base_model!r} has no checkpoint {name!r}")
    return directory


@router.get("/full/checkpoints")
async def list_checkpoints(request: Request, base_model: str | None = None) -> dict[str, Any]:
    tenant = authenticate(request)
    service, host = _owned(request, tenant, base_model)
    return {"checkpoints": saved_names(full_checkpoint_root(service, tenant.name, host.name))}


@router.get("/full/checkpoints/{name}")
async def checkpoint(name: str, request: Request, base_model: str | None = None) -> dict[str, Any]:
    tenant = authenticate(request)
    service, host = _owned(request, tenant, base_model)
    directory = _checkpoint_dir(service, tenant, host.name, name)
    return {"name": name, "files": await run_in_threadpool(checkpoint_files, directory)}


@router.get("/full/checkpoints/{name}/files/{path:path}")
async def checkpoint_file(name: str, path: str, request: Request, base_model: str | None = None) -> Any:
    tenant = authenticate(request)
    service, host = _owned(request, tenant, base_model)
    directory = _checkpoint_dir(service, tenant, host.name, name)
    return await file_response(directory, path, f"checkpoint {name!r} of {host.name!r}")
