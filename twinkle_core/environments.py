"""The environment contract for multi-turn agentic RL: ``reset(row_fields) -> str``, ``step(message) -> StepResult``.

An environment plays the other side of a conversation with the policy. For each trajectory the RL task builds a
fresh one, calls :meth:`Environment.reset` with the prompt row's fields (``answer``, ``tests`` ...), then
alternates: the model writes one turn, the task hands it over as an :class:`AgentMessage` (its text and the tool
calls parsed from it), and the environment answers with a :class:`StepResult`: an observation (rendered as a
``tool`` message with the chat template; its tokens are never trained), a reward for that turn and whether the
episode is over. The trajectory's reward is the sum of its turns' rewards.

Tool calls use the Qwen / Hermes format of Qwen2 chat templates, one JSON object per tag::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>

A call that is not valid JSON, or lacks a string ``name`` or an object ``arguments``, is reported in
:attr:`AgentMessage.errors` (the environment decides what to answer), never raised.

Environments are registered by name (``twinkle_register_environments``) or given as ``module:Class``. A minimal
one, which rewards a final answer equal to the row's ``answer`` field::

    class Echo(Environment):
        name = "echo"

        def reset(self, row_fields):
            self.answer = str(row_fields["answer"])
            return ""

        def step(self, message):
            if message.tool_calls:
                return StepResult(observation="no tools here")
            return StepResult(reward=float(message.text.strip() == self.answer), done=True)

``step`` may also be ``async def``; the task runs each step off the main thread with a timeout, so a hung or
crashing environment ends its trajectory (counted and named in the logs), never the run.
"""

from __future__ import annotations

import inspect
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from twinkle_core.errors import ConfigError

TOOL_CALL_PATTERN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call: the tool's ``name`` and its keyword ``arguments``."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AgentMessage:
    """One model turn: its ``text`` (without the end-of-turn token), the well-formed ``tool_calls`` in it, and one
    line per malformed call in ``errors``."""

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one model turn. ``observation`` ``None`` (or empty) adds no tool message."""

    observation: str | None = None
    reward: float = 0.0
    done: bool = False


def parse_tool_calls(text: str) -> AgentMessage:
    """The turn ``text`` with its ``<tool_call>{json}</tool_call>`` calls parsed (malformed ones in ``errors``)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for match in TOOL_CALL_PATTERN.finditer(text):
        body = match.group(1).strip()
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            errors.append(f"tool call {body[:80]!r} is not valid JSON: {exc.msg}")
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            errors.append(f"tool call {body[:80]!r} needs a string 'name'")
            continue
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some templates serialise the arguments once more
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            errors.append(f"tool call {payload['name']!r}: 'arguments' must be a JSON object")
            continue
        calls.append(ToolCall(payload["name"], arguments))
    if text.count("<tool_call>") > len(calls) + len(errors):
        errors.append("a <tool_call> tag is not closed by </tool_call>")
    return AgentMessage(text=text, tool_calls=tuple(calls), errors=tuple(errors))


class Environment(ABC):
    """One episode's counterpart of the policy (a fresh instance per trajectory, built with the recipe's options)."""

    name: ClassVar[str] = ""

    def reset(self, row_fields: dict[str, Any]) -> str:
        """Start an episode for the prompt row whose fields (all but the prompt) are ``row_fields``; an extra
        opening observation for the model (a user message before its first turn), or ``""`` for none."""
        return ""

    @abstractmethod
    def step(self, message: AgentMessage) -> StepResult:
        """Answer one model turn (``async def`` is fine too)."""

    def close(self) -> None:
        """Release what the episode holds (processes, sandboxes); called once its trajectory ends."""


EnvironmentFactory = Callable[[], Environment]


def _import_environment(spec: str, plugins: Any) -> Any:
    if ":" not in spec:
        if plugins is None:
            from twinkle_core.plugins import get_plugins

            plugins = get_plugins()
        return plugins.load("environment", spec)
    from twinkle_core.lazy import import_object

    try:
        return import_object(spec)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"environment {spec!r}: cannot import it ({exc}); give 'package.module:Class' of an "
                          f"importable module") from exc


def load_environment(spec: str, options: dict[str, Any] | None = None, *, plugins: Any = None) -> EnvironmentFactory:
    """A factory of fresh episodes of the environment ``spec`` (a registered name or ``"package.module:Class"``),
    each built with ``options``. One instance is built here, so that a misspelt option fails at once."""
    options = dict(options or {})
    target = _import_environment(spec, plugins)
    if not (inspect.isclass(target) and issubclass(target, Environment)):
        raise ConfigError(f"environment {spec!r} must be a twinkle_core.environments.Environment subclass, got "
                          f"{target!r}")
    try:
        target(**options).close()
    except TypeError as exc:
        raise ConfigError(f"environment {spec!r}: bad options {sorted(options)}: {exc}") from exc

    def build() -> Environment:
        return target(**options)

    build.environment_name = target.name or target.__name__  # type: ignore[attr-defined]
    return build


__all__ = ["AgentMessage", "Environment", "EnvironmentFactory", "StepResult", "ToolCall", "load_environment",
           "parse_tool_calls"]
