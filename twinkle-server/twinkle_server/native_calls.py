"""The native API's calls: ``POST /adapters/{name}/call`` runs one whitelisted ``TwinkleModel`` method on the
tenant's adapter.

Only the methods in :data:`METHODS` exist on the wire. Each has a preparer (see :mod:`twinkle_server.native_args`)
that checks its arguments in the handler, so a refused call never reaches the queue; the closure it returns runs on
the base model's lane, in order per tenant and never concurrently with another call on that model. Only registered
names cross the wire (losses, optimizers, schedulers, metrics), never code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from twinkle_server import tensor_wire
from twinkle_server.errors import NotFound
from twinkle_server.metrics_log import native_key
from twinkle_server.native_args import (
    REQUIRED,
    Call,
    call_request,
    integer,
    number,
    plain_options,
    registered,
    take,
)
from twinkle_server.native_batch import checked_batch, encode_outputs, wanted_outputs
from twinkle_server.native_checkpoints import (
    checkpoint_root,
    prepare_load,
    prepare_resume_from_checkpoint,
    prepare_save,
)
from twinkle_server.native_http import answer, authenticate, json_body, service_of, wait_seconds
from twinkle_server.native_sampling import prepare_sample
from twinkle_server.native_table import adapters_of

router = APIRouter()


# --- configuration
def _set_loss(call: Call) -> Any:
    a = take(call.args, "set_loss", loss=REQUIRED, options=None)
    name, options = registered("loss", a["loss"], "set_loss"), plain_options(a["options"], "set_loss")
    return lambda: call.guard("set_loss", lambda: call.model.set_loss(name, adapter_name=call.aid, **options))


def _set_optimizer(call: Call) -> Any:
    a = take(call.args, "set_optimizer", optimizer=REQUIRED, gradient_accumulation_steps=1, options=None)
    name = registered("optimizer", a["optimizer"], "set_optimizer")
    options = plain_options(a["options"], "set_optimizer")
    steps = integer(a["gradient_accumulation_steps"], "set_optimizer: gradient_accumulation_steps", low=1)
    return lambda: call.guard("set_optimizer", lambda: call.model.set_optimizer(
        name, adapter_name=call.aid, gradient_accumulation_steps=steps, **options))


def _set_lr_scheduler(call: Call) -> Any:
    a = take(call.args, "set_lr_scheduler", scheduler=REQUIRED, options=None)
    name = registered("scheduler", a["scheduler"], "set_lr_scheduler")
    options = plain_options(a["options"], "set_lr_scheduler")
    return lambda: call.guard("set_lr_scheduler", lambda: call.model.set_lr_scheduler(
        name, adapter_name=call.aid, **options))


def _add_metric(call: Call) -> Any:
    a = take(call.args, "add_metric", metric=REQUIRED, options=None)
    name, options = registered("metric", a["metric"], "add_metric"), plain_options(a["options"], "add_metric")
    return lambda: call.guard("add_metric", lambda: call.model.add_metric(name, adapter_name=call.aid, **options))


# --- compute
def _forward_backward(call: Call) -> Any:
    a = take(call.args, "forward_backward", inputs=REQUIRED, return_outputs=None, temperature=1.0)
    batch = checked_batch(a, call.host, call.service, "forward_backward")
    wanted = wanted_outputs(a["return_outputs"], "forward_backward", batch, call.host, call.service)
    temperature = number(a["temperature"], "forward_backward: temperature")

    def run() -> Any:
        result = call.guard("forward_backward", lambda: call.model.forward_backward(inputs=batch,
                                                                                      adapter_name=call.aid))
        record(call, "forward_backward", {"loss": scalar(result.get("loss")),
                                          "tokens": scalar(result.get("num_tokens"))})
        # a loss that applied the LM head itself has no logits: only what exists is returned
        return encode_outputs(result, batch, wanted, temperature)
    return run


def _forward_only(call: Call) -> Any:
    a = take(call.args, "forward_only", inputs=REQUIRED, disable_adapters=False, return_outputs=["logits"],
              temperature=1.0)
    batch = checked_batch(a, call.host, call.service, "forward_only")
    wanted = wanted_outputs(a["return_outputs"], "forward_only", batch, call.host, call.service)
    disable = bool(a["disable_adapters"])
    temperature = number(a["temperature"], "forward_only: temperature")

    def run() -> Any:
        result = call.guard("forward_only", lambda: call.model.forward_only(
            inputs=batch, adapter_name=call.aid, disable_adapters=disable))
        return encode_outputs(dict(result), batch, wanted, temperature)
    return run


# --- optimisation
def _clip_grad_and_step(call: Call) -> Any:
    a = take(call.args, "clip_grad_and_step", max_grad_norm=1.0, norm_type=2.0)
    limit = number(a["max_grad_norm"], "max_grad_norm", optional=True)
    norm_type = number(a["norm_type"], "norm_type")

    def run() -> Any:
        learning_rate = _learning_rate(call)
        norm = call.guard("clip_grad_and_step", lambda: call.model.clip_grad_and_step(
            limit, norm_type, adapter_name=call.aid))
        if norm is not None:  # None: a call inside a gradient-accumulation window, which steps nothing
            _record_step(call, learning_rate, norm)
        return norm
    return run


def _step(call: Call) -> Any:
    take(call.args, "step")

    def run() -> None:
        learning_rate = _learning_rate(call)
        call.guard("step", lambda: call.model.step(adapter_name=call.aid))
        state = _train_state(call)
        _record_step(call, learning_rate, None if state is None else state.last_grad_norm)
    return run


def _clip_grad_norm(call: Call) -> Any:
    a = take(call.args, "clip_grad_norm", max_grad_norm=1.0, norm_type=2.0)
    limit = number(a["max_grad_norm"], "max_grad_norm")
    norm_type = number(a["norm_type"], "norm_type")
    return lambda: call.guard("clip_grad_norm", lambda: call.model.clip_grad_norm(
        limit, norm_type, adapter_name=call.aid))


def _plain(method: str) -> Callable[[Call], Any]:
    def prepare(call: Call) -> Any:
        take(call.args, method)
        return lambda: call.guard(method, lambda: getattr(call.model, method)(adapter_name=call.aid))
    return prepare


def _calculate_metric(call: Call) -> Any:
    a = take(call.args, "calculate_metric", reset=True)
    return lambda: tensor_wire.jsonable(call.guard("calculate_metric", lambda: call.model.calculate_metric(
        adapter_name=call.aid, reset=bool(a["reset"]))))


# --- what the console shows (service.metrics, as the Tinker routes record theirs): cheap reads, no model work
def scalar(value: Any) -> float | None:
    """A one-element tensor or a number as a float (``None`` for anything else)."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item()) if value.numel() == 1 else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def record(call: Call, kind: str, values: dict[str, Any]) -> None:
    """Keep ``values`` for the console under the target's key (:func:`~twinkle_server.metrics_log.native_key`)."""
    call.service.metrics.record(call.entry.tenant, native_key(call.entry), kind, values)


def _train_state(call: Call) -> Any:
    """The target's training state when its model is in this process (a Ray host's ranks keep theirs: ``None``)."""
    state_of = getattr(call.model, "train_state", None)
    return None if state_of is None else state_of(call.aid)


def _learning_rate(call: Call) -> float | None:
    """The learning rate the next optimizer step applies (read before the step: the scheduler advances it)."""
    state = _train_state(call)
    groups = getattr(state.optimizer, "param_groups", None) if state is not None else None
    return scalar(groups[0].get("lr")) if groups else None


def _record_step(call: Call, learning_rate: float | None, grad_norm: Any) -> None:
    state = _train_state(call)
    record(call, "optim_step", {"step": None if state is None else state.step, "learning_rate": learning_rate,
                                "grad_norm": scalar(grad_norm)})


# --- state
def train_configs(call: Call) -> dict[str, Any]:
    """The adapter's ``get_train_configs``, in the tenant's names: other tenants' adapters are not disclosed."""
    configs = dict(call.model.get_train_configs(adapter_name=call.aid))
    configs.pop("tenants", None)
    configs["adapter_name"] = call.entry.name
    configs["adapters"] = [e.name for e in call.table.of_tenant(call.entry.tenant, call.entry.base_model)
                           if e.ready]
    configs["base_model"] = call.entry.base_model
    return tensor_wire.jsonable(configs)


def _get_train_configs(call: Call) -> Any:
    take(call.args, "get_train_configs")
    return lambda: train_configs(call)


def _get_state_dict(call: Call) -> Any:
    take(call.args, "get_state_dict")

    def run() -> Any:
        state = call.model.get_state_dict(adapter_name=call.aid)
        inner, outer = f".{call.aid}.", f".{call.entry.name}."
        return tensor_wire.encode({k.replace(inner, outer): v for k, v in state.items()})
    return run


METHODS: dict[str, Callable[[Call], Callable[[], Any]]] = {
    "set_loss": _set_loss,
    "set_optimizer": _set_optimizer,
    "set_lr_scheduler": _set_lr_scheduler,
    "add_metric": _add_metric,
    "forward_backward": _forward_backward,
    "forward_only": _forward_only,
    "clip_grad_and_step": _clip_grad_and_step,
    "clip_grad_norm": _clip_grad_norm,
    "step": _step,
    "zero_grad": _plain("zero_grad"),
    "lr_step": _plain("lr_step"),
    "calculate_metric": _calculate_metric,
    "get_train_configs": _get_train_configs,
    "get_state_dict": _get_state_dict,
    "save": prepare_save,
    "load": prepare_load,
    "resume_from_checkpoint": prepare_resume_from_checkpoint,
    "sample": prepare_sample,
}


@router.post("/adapters/{adapter}/call")
async def call(adapter: str, request: Request) -> Any:
    tenant = authenticate(request)
    service, table = service_of(request), adapters_of(request.app.state)
    entry = table.get(tenant.name, adapter)
    checked = call_request(await json_body(request), METHODS)
    method, prepare, args, wait_s = checked.method, checked.prepare, checked.args, wait_seconds(checked.wait_s)
    host = service.host(entry.base_model, tenant.name)
    checkpoints = checkpoint_root(service, tenant.name, entry.name)

    def decode_and_check() -> Callable[[], Any]:
        decoded = tensor_wire.decode(args, where=f"{method}.args")
        return prepare(Call(service=service, host=host, entry=entry, table=table, args=decoded,
                            checkpoints=checkpoints))

    run = await run_in_threadpool(decode_and_check)  # decoding and checking a large batch is not the event loop's

    def work() -> Any:
        if not table.current(entry) or not entry.ready:
            raise NotFound(f"adapter {adapter!r} not found (it was removed, or its creation failed)")
        return run()

    request_id = service.submit(tenant, f"native.{method}", entry.base_model, work)
    return await answer(service, tenant, request_id, wait_s)
