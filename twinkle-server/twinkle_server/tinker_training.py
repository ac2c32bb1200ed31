"""Tinker training calls: create a LoRA training run (``create_model``), describe it (``get_info``), and train it
(``forward_backward`` / ``forward``, ``optim_step``). Everything but ``get_info`` is queued on the base model's lane
and answered with a future."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from tinker import types as ttypes

from twinkle_server import tinker_wire as wire
from twinkle_server.errors import BadRequest
from twinkle_server.tinker_common import (
    check_session,
    future_response,
    json_response,
    lora_host,
    require_adam,
    service_of,
    tenant_of,
    unsupported,
)
from twinkle_server.tinker_futures import tenant_queue
from twinkle_server.tinker_losses import tinker_loss

router = APIRouter()


@router.post("/api/v1/create_model")
async def create_model(request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    service = service_of(request)
    body = await request.body()
    req = wire.parse_model(ttypes.CreateModelRequest, body)
    check_session(service.registry, tenant.name, req.session_id)
    if req.lora_config is None:
        raise unsupported("full fine-tuning (create_model without lora_config)",
                          "use ServiceClient.create_lora_training_client")
    require_adam(req.optimizer_config)
    lora = req.lora_config
    host = lora_host(service, tenant.name, req.base_model)
    if not 1 <= lora.rank <= host.max_lora_rank:
        raise BadRequest(f"LoRA rank {lora.rank} is outside 1..{host.max_lora_rank} (max_lora_rank of "
                         f"{req.base_model} on this server)")
    if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
        raise BadRequest("at least one of train_mlp, train_attn, train_unembed must be true")
    lora_kwargs = {"seed": lora.seed, "train_mlp": lora.train_mlp, "train_attn": lora.train_attn,
                   "train_unembed": lora.train_unembed}
    meta = {"user_metadata": req.user_metadata or None, "api": "tinker"}

    def work() -> wire.WireResult:
        run = service.registry.new_run(tenant.name, base_model=req.base_model, lora_rank=lora.rank,
                                       lora=lora_kwargs, session_id=req.session_id,
                                       meta={k: v for k, v in meta.items() if v is not None})
        try:
            host.create_adapter(run.adapter_id, rank=lora.rank, **lora_kwargs)
        except BaseException:
            service.registry.remove_run(tenant.name, run.model_id)
            raise
        return wire.WireResult.json(wire.validated(ttypes.CreateModelResponse,
                                                   {"model_id": run.model_id, "type": "create_model"}))

    return future_response(tenant_queue(request, tenant).submit(
        "create_model", req.base_model, work, scope=req.session_id, seq_id=req.model_seq_id, body=body))


@router.post("/api/v1/get_info")
async def get_info(request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    service = service_of(request)
    req = wire.parse_model(ttypes.GetInfoRequest, await request.body())
    run = service.registry.run(tenant.name, req.model_id)
    host = service.host(run.base_model)
    # get_tokenizer() loads tokenizer_id (else the model name) with AutoTokenizer: the server's own tokenizer
    # directory is a path the client can open only on this machine, so it is named to loopback clients only
    tokenizer_id = getattr(getattr(host, "tokenizer", None), "name_or_path", None)
    loopback = request.client is not None and request.client.host in ("127.0.0.1", "::1", "localhost")
    if not (loopback and tokenizer_id and Path(tokenizer_id).is_dir()):
        tokenizer_id = None
    return json_response({"type": "get_info", "model_id": req.model_id,
                          "model_data": {"arch": model_type(host), "model_name": run.base_model,
                                         "tokenizer_id": tokenizer_id},
                          "optimizer_config": {"type": "adamw"}, "is_lora": True, "lora_rank": run.lora_rank,
                          "model_name": run.base_model}, ttypes.GetInfoResponse)


def model_type(host: Any) -> str | None:
    """The hosted network's architecture (its config's ``model_type``), if the host has one."""
    try:
        return str(host.model.export_config().model_type)
    except AttributeError:
        return None


@router.post("/api/v1/forward_backward")
async def forward_backward(request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    service = service_of(request)
    limits = service.config.limits
    body = wire.decompress(await request.body(), request.headers.get("content-encoding"),
                           max_bytes=limits.max_body_bytes)
    content_type = (request.headers.get("content-type") or "").split(";")[0].strip()
    if content_type == wire.JSON_MEDIA_TYPE:
        raise BadRequest("forward_backward takes the tinker protobuf body (application/x-protobuf), as the "
                         "Tinker SDK >= 0.38 sends it; JSON bodies are not accepted")
    call = wire.decode_forward_backward(body, max_tokens=limits.max_tokens_per_request)
    run = service.registry.run(tenant.name, call.model_id)
    host = service.host(run.base_model)
    wire.check_vocab(call.data, vocab_size=host.vocab_size)
    if call.loss_fn == "custom":
        raise unsupported("loss_fn 'custom' (a server-side traced loss from create_custom_loss)",
                          "forward_backward_custom with a Python callable runs it client-side over this "
                          "server's cross_entropy, or use a built-in loss")
    loss = tinker_loss(call.loss_fn, call.loss_fn_config)
    for index, datum in enumerate(call.data):
        try:
            loss.check_inputs(datum.loss_fn_inputs)
        except BadRequest as exc:
            raise BadRequest(f"data[{index}]: {exc.message}") from None
    data, forward_only, n_tokens = call.data, call.forward_only, sum(len(d.tokens) for d in call.data)

    def work() -> wire.WireResult:
        result = host.forward_backward(run.adapter_id, data, call.loss_fn, call.loss_fn_config,
                                       backward=not forward_only)
        message = wire.encode_forward_backward_output(result, num_datums=len(data))
        if not forward_only:
            loss_sum = result.metrics.get("loss:sum")
            service.record(tenant, run.model_id, "forward_backward",
                           {"loss": loss_sum, "datums": len(data), "tokens": n_tokens})
        return wire.WireResult.proto(message)

    kind = "forward" if forward_only else "forward_backward"
    request_id = tenant_queue(request, tenant).submit(kind, run.base_model, work, scope=call.model_id,
                                                      seq_id=call.seq_id or None, body=body)
    return future_response(request_id, model_id=call.model_id)


@router.post("/api/v1/optim_step")
async def optim_step(request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    service = service_of(request)
    body = await request.body()
    model_id, seq_id, params = wire.optim_params_of(body)
    run = service.registry.run(tenant.name, model_id)
    host = service.host(run.base_model)

    def work() -> wire.WireResult:
        metrics = host.optim_step(run.adapter_id, params) or {}
        service.record(tenant, run.model_id, "optim_step", {"learning_rate": params.learning_rate, **metrics})
        payload = {"metrics": {str(k): float(v) for k, v in metrics.items()}}
        return wire.WireResult.json(wire.validated(ttypes.OptimStepResponse, payload))

    request_id = tenant_queue(request, tenant).submit("optim_step", run.base_model, work, scope=model_id,
                                                      seq_id=seq_id, body=body)
    return future_response(request_id, model_id=model_id)
