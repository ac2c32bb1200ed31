"""Environment steps off the main thread, all trajectories of a turn at once, each with a timeout.

A tool can hang (a network call, an endless loop in user code) or crash. Every step runs on its own daemon
thread, so the steps of one turn overlap (an ``async def step`` gets its own event loop there), and the runner
waits for each at most ``timeout_s`` from the moment the turn's steps started. A step that times out or raises
ends its trajectory and is counted under ``<environment>/<tool>`` (the first tool call's name, or ``reply`` for a
turn without one); the thread of a hung step is abandoned, not joined: a daemon thread never holds up the exit.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from twinkle_core.environments import AgentMessage, Environment, StepResult

logger = logging.getLogger("twinkle.rl")


@dataclass
class StepOutcome:
    """A step's result, or why there is none (``failure``: ``"timeout"`` or ``"error"``, with ``detail``)."""

    result: StepResult | None = None
    failure: str | None = None
    detail: str = ""


@dataclass
class StepFailures:
    """Failed steps counted by kind (``timeout`` / ``error``) and ``<environment>/<tool>`` name."""

    counts: Counter[tuple[str, str]] = field(default_factory=Counter)

    def add(self, kind: str, name: str) -> None:
        self.counts[(kind, name)] += 1

    def total(self, kind: str) -> int:
        return sum(count for (k, _), count in self.counts.items() if k == kind)


def tool_name(message: AgentMessage) -> str:
    return message.tool_calls[0].name if message.tool_calls else "reply"


def _call(env: Environment, method: str, argument: Any) -> Any:
    result = env.close() if method == "close" else getattr(env, method)(argument)
    if inspect.isawaitable(result):
        return asyncio.run(_awaited(result))
    return result


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


class _Worker(threading.Thread):
    def __init__(self, env: Environment, method: str, argument: Any) -> None:
        super().__init__(daemon=True, name=f"twinkle-env-{method}")
        self.env, self.method, self.argument = env, method, argument
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = _call(self.env, self.method, self.argument)
        except Exception as exc:  # reported to the rollout, which ends this trajectory and counts it
            self.error = exc


class EnvironmentRunner:
    """Runs ``reset`` / ``step`` of many episodes concurrently with a per-call timeout."""

    def __init__(self, environment_name: str, timeout_s: float) -> None:
        self.environment_name, self.timeout_s = environment_name, float(timeout_s)
        self.failures = StepFailures()

    def _run(self, method: str, calls: list[tuple[Environment, Any]], names: list[str]) -> list[StepOutcome]:
        workers = [_Worker(env, method, argument) for env, argument in calls]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + self.timeout_s
        outcomes = []
        for worker, name in zip(workers, names, strict=True):
            worker.join(max(deadline - time.monotonic(), 0.0))
            outcomes.append(self._outcome(worker, method, f"{self.environment_name}/{name}"))
        return outcomes

    def _outcome(self, worker: _Worker, method: str, name: str) -> StepOutcome:
        if worker.is_alive():
            self.failures.add("timeout", name)
            logger.warning("environment %s: %s did not return within %gs; its trajectory ends here (counted as "
                           "env_timeouts)", name, method, self.timeout_s)
            return StepOutcome(failure="timeout", detail=f"{method} took longer than {self.timeout_s:g}s")
        if worker.error is not None:
            self.failures.add("error", name)
            logger.warning("environment %s: %s raised %s: %s; its trajectory ends here (counted as env_errors)",
                           name, method, type(worker.error).__name__, worker.error)
            return StepOutcome(failure="error", detail=f"{type(worker.error).__name__}: {worker.error}")
        return StepOutcome(result=worker.result)

    def reset(self, envs: list[Environment], row_fields: list[dict[str, Any]]) -> list[StepOutcome]:
        """``reset`` of each episode; a successful one's opening observation is ``result.observation``."""
        outcomes = self._run("reset", list(zip(envs, row_fields, strict=True)), ["reset"] * len(envs))
        for outcome in outcomes:
            if outcome.failure is None:
                outcome.result = StepResult(observation=str(outcome.result or ""))
        return outcomes

    def close(self, envs: list[Environment]) -> None:
        """``close`` every finished episode (a failure is counted and logged like a step's)."""
        self._run("close", [(env, None) for env in envs], ["close"] * len(envs))

    def step(self, envs: list[Environment], messages: list[AgentMessage]) -> list[StepOutcome]:
        outcomes = self._run("step", list(zip(envs, messages, strict=True)), [tool_name(m) for m in messages])
        for outcome, message in zip(outcomes, messages, strict=True):
            if outcome.failure is None and not isinstance(outcome.result, StepResult):
                name = f"{self.environment_name}/{tool_name(message)}"
                self.failures.add("error", name)
                logger.warning("environment %s: step returned %r, not a StepResult", name, outcome.result)
                outcome.result, outcome.failure = None, "error"
                outcome.detail = "step did not return a StepResult"
        return outcomes


__all__ = ["EnvironmentRunner", "StepFailures", "StepOutcome", "tool_name"]
