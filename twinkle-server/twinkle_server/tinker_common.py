"""What the Tinker API's route modules share: the request's service and tenant, JSON and future responses checked
against the SDK's own response models, refusals by name, checkpoint lookups, and per-app state."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from tinker import types as ttypes

from twinkle_server import tinker_wire as wire
from twinkle_server.errors import BadRequest, NotFound
from twinkle_server.full_host import is_full_parameter, tinker_refusal
from twinkle_server.registry import CHECKPOINT_KINDS

T = TypeVar("T")

#: the registry's checkpoint kind -> Tinker's checkpoint_type
CHECKPOINT_TYPE_OF_KIND = {"state": "training", "sampler": "sampler", "external": "external"}
#: a tinker:// path's kind segment -> the registry's checkpoint kind
CHECKPOINT_KIND_OF_SEGMENT = {"weights": "state", "sampler_weights": "sampler", "external_weights": "external"}

PER_APP_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------------------------------
# the request's service, tenant and per-app state
# ---------------------------------------------------------------------------------------------------------------
def service_of(request: Request) -> Any:
    """The :class:`~twinkle_server.app.Service` of the app serving ``request``."""
    return request.app.state.service


def tenant_of(request: Request) -> Any:
    """The tenant whose ``X-API-Key`` the request carries (401 for a missing or unknown key)."""
    return service_of(request).tenant(request.headers.get("X-API-Key"))


def per_app(request: Request, attribute: str, factory: Callable[[], T]) -> T:
    """``request.app.state.<attribute>``, made with ``factory()`` the first time any request asks for it."""
    app_state = request.app.state
    value = getattr(app_state, attribute, None)
    if value is None:
        with PER_APP_LOCK:
            value = getattr(app_state, attribute, None)
            if value is None:
                value = factory()
                setattr(app_state, attribute, value)
    return value


# ---------------------------------------------------------------------------------------------------------------
# responses and refusals
# ---------------------------------------------------------------------------------------------------------------
def json_response(payload: dict[str, Any], model_cls: type | None = None, status: int = 200) -> JSONResponse:
    """``payload`` as JSON, first validated against the SDK's response model ``model_cls`` when one is given."""
    if model_cls is not None:
        wire.validated(model_cls, payload)
    return JSONResponse(payload, status_code=status)


def future_response(request_id: str, model_id: str | None = None, **extra: Any) -> JSONResponse:
    """The ``UntypedAPIFuture`` the SDK polls with ``retrieve_future``."""
    payload: dict[str, Any] = {"request_id": request_id, **extra}
    if model_id is not None:
        payload["model_id"] = model_id
    return json_response(payload, ttypes.UntypedAPIFuture)


def string_metadata(value: dict[str, Any] | None) -> dict[str, str] | None:
    """User metadata as the SDK's models take it: string keys and values (empty or missing: ``None``)."""
    return {str(k): str(v) for k, v in value.items()} if value else None


def unsupported(feature: str, hint: str = "") -> BadRequest:
    """The 400 that names a feature this server does not offer (never a silent substitute)."""
    return BadRequest(f"{feature} is not supported by this server (Twinkle's Tinker-compatible API)"
                      + (f"; {hint}" if hint else ""))


def lora_host(service: Any, tenant: str, base_model: str) -> Any:
    """The host of ``base_model`` for Tinker's LoRA training and sampling: 404 for a model the tenant named
    ``tenant`` cannot see, a refusal naming the mode for its owner's full-parameter base (the Tinker API has no
    full-parameter training)."""
    host = service.host(base_model, tenant)
    if is_full_parameter(host):
        raise unsupported(*tinker_refusal(base_model))
    return host


def require_adam(optimizer_config: Any) -> None:
    """Refuse an optimizer config other than Adam (``None``: the SDK's default, Adam)."""
    optimizer = getattr(optimizer_config, "type", "adamw")
    if optimizer != "adamw":
        raise unsupported(f"optimizer {optimizer!r}", "only Adam (AdamW, the default) is")


def check_session(registry: Any, tenant_name: str, session_id: str | None) -> None:
    """404 unless ``session_id`` (when given) is one of the tenant's sessions."""
    if session_id is not None:
        registry.session(tenant_name, session_id)


# ---------------------------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------------------------
def parse_checkpoint_path(tinker_path: str) -> ttypes.ParsedCheckpointTinkerPath:
    try:
        return ttypes.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
    except ValueError:
        raise BadRequest(f"{tinker_path!r} is not a checkpoint path: expected tinker://<model_id>/<weights|"
                         f"sampler_weights|external_weights>/<name>") from None


def find_checkpoint(registry: Any, tenant_name: str, tinker_path: str) -> Any:
    """The tenant's checkpoint at ``tinker_path`` (400 for a malformed path, 404 for an unknown one)."""
    parse_checkpoint_path(tinker_path)
    return registry.checkpoint(tenant_name, tinker_path)


def checkpoint_at(registry: Any, tenant_name: str, model_id: str, segment: str, name: str) -> Any:
    """The checkpoint a REST route names as ``training_runs/<model_id>/checkpoints/<segment>/<name>``."""
    if segment not in CHECKPOINT_KIND_OF_SEGMENT:
        raise NotFound(f"checkpoint {segment}/{name} not found (kinds: {', '.join(CHECKPOINT_KIND_OF_SEGMENT)})")
    registry.run(tenant_name, model_id)
    return registry.checkpoint(tenant_name, f"tinker://{model_id}/{segment}/{name}")


def is_registered(registry: Any, run: Any, kind: str, name: str) -> bool:
    """Whether ``run`` already has a checkpoint of ``kind`` named ``name``."""
    try:
        registry.checkpoint(run.tenant, checkpoint_path(run, kind, name))
        return True
    except NotFound:
        return False


def checkpoint_path(run: Any, kind: str, name: str) -> str:
    """The tinker:// path a checkpoint of ``run`` gets when it is registered."""
    return f"tinker://{run.model_id}/{CHECKPOINT_KINDS[kind]}/{name}"


def directory_size(directory: Path) -> int | None:
    """The bytes of the files under ``directory`` (``None`` when it cannot be read)."""
    try:
        return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    except OSError:
        return None
