"""The OpenAI wire format that ``twinkle serve-model`` speaks: requests checked field by field, responses built.

Every request field is either implemented, or accepted only with the value that means "off" (``logprobs: false``,
``tools: []``, ``frequency_penalty: 0``, ...), or refused with an OpenAI-shaped error naming it (HTTP 400): a
client never gets an answer that silently ignored what it asked for.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from twinkle_backend_hf.commands.text_generation import SamplingOptions

#: fields both endpoints implement
COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "stop", "n", "seed", "stream",
                           "stream_options", "user"})
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
#: fields accepted only with these values (what the OpenAI API does when they are left out)
OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),
    "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_N = 16
#: OpenAI's default ``max_tokens`` of the legacy completions endpoint
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class RequestError(Exception):
    """A request the server refuses, as OpenAI answers one: ``{"error": {message, type, param, code}}``."""

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request of either endpoint (``messages`` for chat, ``prompt`` for completions)."""
    model: str | None
    max_tokens: int | None  # None: the endpoint's default
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    n: int
    seed: int | None
    stream: bool
    include_usage: bool
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None

    def sampling(self, max_tokens: int) -> SamplingOptions:
        return SamplingOptions(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, stop=self.stop)


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float, *,
            low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value > high or value < low or (
            low_open and value == low):
        bracket = "(" if low_open else "["
        raise RequestError(f"'{name}' must be a number in {bracket}{low:g}, {high:g}], got {value!r}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        limit = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise RequestError(f"'{name}' must be an integer {limit}, got {value!r}", name)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"'stop' must be a non-empty string or a list of them, got {value!r}", "stop")
    return tuple(stops)


def is_off(value: Any, off: Any) -> bool:
    """Whether ``value`` is the "off" value ``off`` (0 and 0.0 alike, but false is not 0)."""
    if off is None or isinstance(off, bool) or isinstance(value, bool):
        return value is off
    return value == off


def check_fields(body: dict[str, Any], implemented: frozenset[str]) -> None:
    for name, value in body.items():
        if name in implemented:
            continue
        if name in OFF_VALUES and any(is_off(value, off) for off in OFF_VALUES[name]):
            continue
        what = f"'{name}'" if name not in OFF_VALUES else f"'{name}' (other than {OFF_VALUES[name][-1]!r})"
        raise RequestError(f"{what} is not supported by twinkle serve-model; it implements "
                           f"{', '.join(sorted(implemented))}", name, code="unsupported_parameter")


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                    and set(part) <= {"type", "text"}):
                raise RequestError(f"{where}: only text parts ({{'type': 'text', 'text': ...}}) are supported, got "
                                   f"{part!r}", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{where}: 'content' must be a string or a list of text parts, got {content!r}", "messages")


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {'role', 'content'} objects", "messages")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with 'role' and 'content'", "messages")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise RequestError(f"{where}: field '{extra[0]}' is not supported by twinkle serve-model (only 'role' "
                               f"and 'content')", "messages", code="unsupported_parameter")
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}: role {role!r} is not supported; use one of {', '.join(ROLES)}", "messages")
        # the chat templates of trained models know "system"; OpenAI's "developer" is its newer name
        checked.append({"role": ROLES[role], "content": _text_content(message.get("content"), where)})
    return checked


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if not isinstance(prompt, str):
        raise RequestError(f"'prompt' must be a string (token ids and several prompts are not supported), got "
                           f"{prompt!r}", "prompt")
    return prompt


def _max_tokens(body: dict[str, Any], *, chat: bool) -> int | None:
    max_tokens = _integer(body, "max_tokens", 1)
    if not chat:
        return max_tokens
    newer = _integer(body, "max_completion_tokens", 1)
    if newer is not None and max_tokens is not None and newer != max_tokens:
        raise RequestError("'max_tokens' and 'max_completion_tokens' differ; give one of them",
                           "max_completion_tokens")
    return newer if newer is not None else max_tokens


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """``(stream, include_usage)``."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(f"'stream' must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise RequestError(f"'stream_options' supports only {{'include_usage': true|false}}, got {options!r}",
                           "stream_options")
    return bool(stream), bool((options or {}).get("include_usage"))


def _typed(body: dict[str, Any], name: str, kind: type, what: str) -> Any:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        raise RequestError(f"'{name}' must be {what}, got {value!r}", name)
    return value


def parse_request(body: Any, *, chat: bool) -> GenerationRequest:
    """The checked request of ``/v1/chat/completions`` (``chat``) or ``/v1/completions``."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    stream, include_usage = _stream(body)
    return GenerationRequest(
        model=_typed(body, "model", str, "a string"), max_tokens=_max_tokens(body, chat=chat),
        temperature=_number(body, "temperature", 1.0, 0, 2),
        top_p=_number(body, "top_p", 1.0, 0, 1, low_open=True), stop=_stop(body),
        n=_integer(body, "n", 1, MAX_N) or 1, seed=_typed(body, "seed", int, "an integer"), stream=stream,
        include_usage=include_usage,
        messages=_messages(body) if chat else None, prompt=None if chat else _prompt(body))


# ---------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
            "logprobs": None}


def chat_chunk_choice(index: int, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}


def completion_choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}


def response(kind: str, response_id: str, created: int, model: str, choices: list[dict[str, Any]],
             token_usage: dict[str, int] | None = None) -> dict[str, Any]:
    """``kind``: "chat.completion", "chat.completion.chunk" or "text_completion" (both completion shapes)."""
    out: dict[str, Any] = {"id": response_id, "object": kind, "created": created, "model": model, "choices": choices}
    if token_usage is not None or kind != "chat.completion.chunk":
        out["usage"] = token_usage
    return out
