"""Tinker sampling: sampling sessions on the base model or a sampler checkpoint (create, describe, join) and
``asample``, which also serves the SDK's ``compute_logprobs`` (a one-token sample with ``prompt_logprobs``). Samples
are queued on the base model's lane and answered with a future."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from tinker import types as ttypes

from twinkle_server import tinker_wire as wire
from twinkle_server.errors import BadRequest, NotFound, PayloadTooLarge
from twinkle_server.tinker_common import (
    check_session,
    find_checkpoint,
    future_response,
    json_response,
    lora_host,
    service_of,
    tenant_of,
    unsupported,
)
from twinkle_server.tinker_futures import body_digest, submissions_of
from twinkle_server.tinker_samplers import host_samplers_of
from twinkle_server.tinker_sampling_sessions import SamplingSession, sampling_sessions_of

router = APIRouter()


def new_sampling_session(service: Any, tenant_name: str, *, model_path: str | None, base_model: str | None,
                         session_id: str | None = None) -> SamplingSession:
    """A sampling session (not yet added) on the sampler checkpoint ``model_path``, else on ``base_model``."""
    sampling_session_id = f"sampler-{uuid.uuid4().hex}"
    if model_path is not None:
        record = find_checkpoint(service.registry, tenant_name, model_path)
        if record.kind == "state":
            raise BadRequest(f"{model_path} is a training checkpoint; sample from a sampler checkpoint "
                             f"(save_weights_for_sampler's path, tinker://<run>/sampler_weights/<name>)")
        run = service.registry.run(tenant_name, record.model_id)
        if base_model is not None and base_model != run.base_model:
            raise BadRequest(f"{model_path} is an adapter of {run.base_model}, not {base_model}")
        service.host(run.base_model)
        return SamplingSession(sampling_session_id=sampling_session_id, tenant=tenant_name, base_model=run.base_model,
                               session_id=session_id, model_path=model_path, source="checkpoint",
                               directory=record.directory)
    if base_model is None:
        raise BadRequest("give model_path (a sampler checkpoint) or base_model")
    lora_host(service, tenant_name, base_model)
    return SamplingSession(sampling_session_id=sampling_session_id, tenant=tenant_name, base_model=base_model,
                           session_id=session_id)


@router.post("/api/v1/create_sampling_session")
async def create_sampling_session(request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    service = service_of(request)
    req = wire.parse_model(ttypes.CreateSamplingSessionRequest, await request.body())
    check_session(service.registry, tenant.name, req.session_id)
    session = new_sampling_session(service, tenant.name, model_path=req.model_path, base_model=req.base_model,
                                   session_id=req.session_id)
    sampling_sessions_of(request).add(session)
    return json_response({"type": "create_sampling_session", "sampling_session_id": session.sampling_session_id},
                         ttypes.CreateSamplingSessionResponse)


@router.get("/api/v1/samplers/{sampling_session_id}")
async def get_sampler(sampling_session_id: str, request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    session = sampling_sessions_of(request).get(tenant.name, sampling_session_id)
    return json_response({"sampler_id": session.sampling_session_id, "base_model": session.base_model,
                          "model_path": session.model_path}, ttypes.GetSamplerResponse)


@router.post("/api/v1/join_sampling_session")
async def join_sampling_session(request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    sessions = sampling_sessions_of(request)
    req = wire.parse_model(ttypes.JoinSamplingSessionRequest, await request.body())
    session = sessions.get(tenant.name, req.sampling_session_id)
    with sessions.lock:
        session.clients += 1
        counter = session.clients
    return json_response({"type": "join_sampling_session", "client_counter": counter},
                         ttypes.JoinSamplingSessionResponse)


def refuse_unsupported_sampling(req: ttypes.SampleRequest) -> None:
    if req.topk_prompt_logprobs or req.topk_sample_logprobs:
        raise unsupported("top-k logprobs (topk_prompt_logprobs / topk_sample_logprobs)",
                          "request include_prompt_logprobs or use the sampled tokens' logprobs")
    if req.target_prompt_logprobs is not None:
        raise unsupported("target_prompt_logprobs", "use compute_logprobs on the prompt")
    if req.prompt_alt_tokens_k:
        raise unsupported("prompt_alt_tokens_k")
    if req.record_stability_info:
        raise unsupported("record_stability_info (stability recording for stable_reinforce)")


@router.post("/api/v1/asample")
async def asample(request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    service = service_of(request)
    sessions = sampling_sessions_of(request)
    samplers = host_samplers_of(request)
    limits = service.config.limits
    body = await request.body()
    req = wire.parse_model(ttypes.SampleRequest, body)
    if req.sampling_session_id is not None:
        session = sessions.get(tenant.name, req.sampling_session_id)
    else:
        session = new_sampling_session(service, tenant.name, model_path=req.model_path, base_model=req.base_model)
    if session.expired:
        raise NotFound(session.expired)
    refuse_unsupported_sampling(req)
    host = service.host(session.base_model)
    prompt = wire.model_input_tokens(req.prompt, what="prompt")
    if not prompt:
        raise BadRequest("the prompt is empty: give at least one token")
    wire.check_tokens(prompt, vocab_size=host.vocab_size, what="prompt")
    if not 1 <= req.num_samples <= limits.max_samples_per_request:
        raise BadRequest(f"num_samples must lie in 1..{limits.max_samples_per_request} "
                         f"(limits.max_samples_per_request), got {req.num_samples}")
    params = wire.sample_params(req.sampling_params)
    budget = len(prompt) + (params.max_tokens or 0) * req.num_samples
    if budget > limits.max_tokens_per_request:
        raise PayloadTooLarge(f"the prompt and the requested samples come to {budget} tokens, above "
                              f"limits.max_tokens_per_request={limits.max_tokens_per_request}")
    want_prompt_logprobs = bool(req.prompt_logprobs)
    last_n = req.prompt_logprobs_last_n
    if last_n is not None:
        if not want_prompt_logprobs:
            raise BadRequest("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs")
        if not 1 <= last_n <= len(prompt) - 1:
            raise BadRequest(f"prompt_logprobs_last_n must lie in 1..{len(prompt) - 1} (len(prompt) - 1), got "
                             f"{last_n}")
    n = req.num_samples

    def work() -> wire.WireResult:
        sampler_id = samplers.sampler_for(host, session)
        sequences = host.sample(sampler_id, prompt, n, params)
        if len(sequences) != n:
            raise RuntimeError(f"the host returned {len(sequences)} sequences for num_samples={n}")
        prompt_logprobs = None
        if want_prompt_logprobs:
            prompt_logprobs = list(host.compute_logprobs(sampler_id, prompt))
            if last_n is not None:
                cut = len(prompt_logprobs) - last_n
                prompt_logprobs = [None] * cut + prompt_logprobs[cut:]
        return wire.WireResult.proto(wire.encode_sample_response(sequences, prompt_logprobs))

    # a retried POST of the same sample in a sampling session gets the first one's future
    key = None
    if req.sampling_session_id is not None and req.seq_id is not None:
        key = (tenant.name, req.sampling_session_id, str(req.seq_id), body_digest(body))
    fresh: list[str] = []

    def submit() -> str:
        fresh.append(service.submit(tenant, "sample", session.base_model, work))
        return fresh[0]

    request_id = submissions_of(request).submit_once(key, submit)
    if fresh and req.sampling_session_id is not None:
        with sessions.lock:  # for retrieve_futures
            session.pending.append((request_id, int(req.seq_id or 0)))
    return future_response(request_id, sample_sequence_ids=[f"{request_id}.{i}" for i in range(n)])
