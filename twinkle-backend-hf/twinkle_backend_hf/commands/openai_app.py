"""The ASGI app of ``twinkle serve-model``: OpenAI's ``/v1/models``, ``/v1/chat/completions`` and
``/v1/completions`` over one loaded model (FastAPI).

One generation runs at a time (a lock held for a whole request, its ``n`` answers and its stream included): the
model is one set of weights on one device, and requests that arrive meanwhile wait their turn.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# imported by serve_model once it has checked that they are installed; at module level because FastAPI reads the
# endpoints' annotations (strings here) in this module's namespace
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse

from twinkle_backend_hf.commands.openai_protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    GenerationRequest,
    RequestError,
    chat_choice,
    chat_chunk_choice,
    completion_choice,
    new_id,
    now,
    parse_request,
    response,
    usage,
)
from twinkle_backend_hf.commands.text_generation import TextGenerator

logger = logging.getLogger(__name__)


@dataclass
class ServedModel:
    """What the app serves: the generator (model, tokenizer, stop tokens), its public name and its context length
    (None when the config does not say)."""
    generator: TextGenerator
    name: str
    context_length: int | None
    created: int

    @property
    def tokenizer(self) -> Any:
        return self.generator.tokenizer

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.messages is not None:
            from jinja2 import TemplateError

            if not getattr(self.tokenizer, "chat_template", None):
                raise RequestError("this model's tokenizer has no chat template, so it cannot render messages: "
                                   "use /v1/completions with a plain prompt", "messages")
            try:
                ids = self.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True,
                                                         tokenize=True, return_dict=True)["input_ids"]
            except TemplateError as exc:  # a template that refuses this conversation (e.g. the order of roles)
                raise RequestError(f"the model's chat template refuses these messages: {exc}", "messages") from None
        else:
            ids = self.tokenizer(request.prompt)["input_ids"]
        if not ids:
            raise RequestError("the prompt is empty: give some text", "prompt")
        return list(ids)

    def max_tokens(self, request: GenerationRequest, prompt_length: int) -> int:
        """The request's ``max_tokens``, else the endpoint's default, within the model's context."""
        room = None if self.context_length is None else self.context_length - prompt_length
        if room is not None and room < 1:
            raise RequestError(f"the prompt has {prompt_length} tokens and this model's context is "
                               f"{self.context_length}: shorten it", "messages" if request.messages else "prompt",
                               code="context_length_exceeded")
        if request.max_tokens is not None:
            if room is not None and request.max_tokens > room:
                raise RequestError(f"max_tokens {request.max_tokens} does not fit: the prompt has {prompt_length} "
                                   f"tokens and this model's context is {self.context_length}; ask for at most "
                                   f"{room}", "max_tokens", code="context_length_exceeded")
            return request.max_tokens
        if request.messages is None:
            return min(COMPLETIONS_DEFAULT_MAX_TOKENS, room) if room is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        return room if room is not None else 2048  # the chat endpoint answers until the end of the turn


def torch_generator(seed: int | None) -> Any:
    """A CPU random generator for sampling: seeded by the request, else from fresh entropy."""
    import torch

    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sse(data: Any) -> str:
    """One server-sent event; a payload of ``[DONE]`` is sent as it is."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Generation:
    """One checked request against the served model: its prompt, limits and answers (blocking; under the lock)."""

    def __init__(self, served: ServedModel, request: GenerationRequest, lock: threading.Lock) -> None:
        self.served, self.request, self.lock = served, request, lock
        if request.model is not None and request.model != served.name:
            raise RequestError(f"the model {request.model!r} does not exist here; this server serves "
                               f"{served.name!r}", "model", code="model_not_found", status=404)
        self.chat = request.messages is not None
        self.prompt = served.prompt_ids(request)
        self.options = request.sampling(served.max_tokens(request, len(self.prompt)))
        self.id = new_id("chatcmpl" if self.chat else "cmpl")
        self.created = now()
        self.kind = "chat.completion" if self.chat else "text_completion"

    def body(self) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        choices, generated = [], 0
        with self.lock:
            random = torch_generator(self.request.seed)
            for index in range(self.request.n):
                answer = self.served.generator.complete(self.prompt, self.options, random)
                generated += answer.completion_tokens
                make = chat_choice if self.chat else completion_choice
                choices.append(make(index, answer.text, answer.finish_reason))
        return response(self.kind, self.id, self.created, self.served.name, choices,
                        usage(len(self.prompt) * self.request.n, generated))

    def _chunk(self, index: int, text: str | None, finish_reason: str | None = None, *,
               first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            return response("chat.completion.chunk", self.id, self.created, self.served.name,
                            [chat_chunk_choice(index, delta, finish_reason)])
        return response("text_completion", self.id, self.created, self.served.name,
                        [completion_choice(index, text or "", finish_reason)])

    def events(self) -> Iterator[str]:
        """The streamed response: server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``."""
        generated = 0
        with self.lock:
            random = torch_generator(self.request.seed)
            try:
                for index in range(self.request.n):
                    if self.chat:
                        yield sse(self._chunk(index, None, first=True))
                    for piece in self.served.generator.stream(self.prompt, self.options, random):
                        if piece.text:
                            yield sse(self._chunk(index, piece.text))
                        if piece.finish_reason is not None:
                            generated += piece.completion_tokens
                            yield sse(self._chunk(index, None, piece.finish_reason))
            except RuntimeError as exc:  # the response has started: the error can only be an event
                logger.exception("generation failed")
                yield sse(RequestError(f"generation failed: {exc}", kind="server_error", status=500).body())
                yield sse("[DONE]")
                return
        if self.request.include_usage:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            yield sse(response(kind, self.id, self.created, self.served.name, [],
                               usage(len(self.prompt) * self.request.n, generated)))
        yield sse("[DONE]")


def create_app(served: ServedModel) -> Any:
    """The FastAPI app serving ``served``."""
    app = FastAPI(title=f"twinkle serve-model: {served.name}")
    lock = threading.Lock()

    @app.exception_handler(RequestError)
    async def refused(_request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(404)
    async def not_found(request: Request, _exc: Exception) -> JSONResponse:
        return JSONResponse(RequestError(f"no such endpoint {request.method} {request.url.path}; this server has "
                                         f"GET /v1/models, POST /v1/chat/completions and POST /v1/completions",
                                         code="not_found", status=404).body(), status_code=404)

    @app.exception_handler(RuntimeError)
    async def failed(_request: Request, exc: RuntimeError) -> JSONResponse:  # e.g. the device ran out of memory
        logger.exception("generation failed", exc_info=exc)
        return JSONResponse(RequestError(f"generation failed: {exc}", kind="server_error", status=500).body(),
                            status_code=500)

    model_card = {"id": served.name, "object": "model", "created": served.created, "owned_by": "twinkle"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        if name != served.name:
            raise RequestError(f"the model {name!r} does not exist here; this server serves {served.name!r}",
                               "model", code="model_not_found", status=404)
        return model_card

    async def answer(request: Request, *, chat: bool) -> Any:
        try:
            body = await request.json()
        except ValueError:
            raise RequestError("the request body is not valid JSON") from None
        generation = await run_in_threadpool(Generation, served, parse_request(body, chat=chat), lock)
        if generation.request.stream:
            return StreamingResponse(generation.events(), media_type="text/event-stream")
        return await run_in_threadpool(generation.body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await answer(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await answer(request, chat=False)

    return app
