"""Multi-turn agentic rollouts: model turns and environment turns alternate, only the model's tokens train.

With ``task_options.environment`` the ``grpo`` and ``ppo`` tasks sample each of a prompt's ``n`` trajectories as
a conversation with a fresh :class:`~twinkle_core.environments.Environment` (reset with the prompt row's fields):

1. the sampler writes one model turn from all tokens so far, stopping at the chat template's end-of-turn token;
   its tokens are appended with the sampler's log-probs and are trained;
2. the turn's text and tool calls go to the environment (:mod:`twinkle_rl.environment_runner`: every
   trajectory's step at once, each with ``step_timeout_s``; a hung or crashing step ends its trajectory and is
   counted and logged by ``<environment>/<tool>``);
3. the observation is rendered as a ``tool`` message by the chat template and appended **untrained** (no label,
   old log-prob 0), followed by the next generation prompt (:class:`~twinkle_rl.agent_turns.ChatTurns`);

until the environment says ``done``, or after ``max_turns`` model turns, or when the tokens after the prompt reach
``max_total_tokens`` (the trajectory is then cut and counts as truncated, finish reason ``length``).

A trajectory is one :class:`~twinkle_core.sampling.Completion` of the prompt: all tokens after the prompt, with
``extra["train_mask"]`` marking the model's, which :func:`~twinkle_rl.experience.experience_batch` labels; its
``text`` is the last model turn, which the task's ``rewards`` (optional with an environment) score. Its reward is
the sum of the environment's per-turn rewards (logged as ``reward/environment``) plus those rewards; the usual
estimators, dynamic sampling, one-step-off sampling and LoRA / full training then apply unchanged. Every turn is
seeded by (rollout, draw, prompt, trajectory, turn), so trajectories do not depend on the number of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from twinkle_core.environments import AgentMessage, Environment, EnvironmentFactory, parse_tool_calls
from twinkle_core.errors import ConfigError
from twinkle_core.sampling import Completion, SamplingParams, sample_seed
from twinkle_rl.agent_turns import ChatTurns
from twinkle_rl.checks import integer
from twinkle_rl.environment_runner import EnvironmentRunner, StepOutcome
from twinkle_rl.prompts import PromptFeature
from twinkle_rl.rewards import RewardSet
from twinkle_rl.rollout import DataParallel, RewardReport, RolloutEngine, RolloutStats, Scored

ENVIRONMENT_KEYS = frozenset({"name", "options", "max_turns", "max_total_tokens", "step_timeout_s"})
#: the reward name of the environment's summed per-turn rewards in the logs
ENVIRONMENT_REWARD = "environment"
#: sums every rank adds to the rollout statistics (also when zero: the ranks reduce the same keys)
AGENT_SUMS = ("env_turns", "env_tool_calls", "env_tool_errors", "env_timeouts", "env_errors")


@dataclass(frozen=True)
class AgentSettings:
    """``task_options.environment``: which environment, and the turn, token and time budgets of a trajectory."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4
    max_total_tokens: int = 512
    step_timeout_s: float = 30.0

    @classmethod
    def parse(cls, spec: Any) -> AgentSettings:
        if isinstance(spec, str):
            spec = {"name": spec}
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ConfigError(f"task_options.environment must be {{name: <registered name or module:Class>, "
                              f"options: {{}}, max_turns, max_total_tokens, step_timeout_s}}, got {spec!r}")
        unknown = sorted(set(spec) - ENVIRONMENT_KEYS)
        if unknown:
            raise ConfigError(f"task_options.environment got unknown key(s) {unknown}; known: "
                              f"{', '.join(sorted(ENVIRONMENT_KEYS))}")
        timeout = spec.get("step_timeout_s", 30.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ConfigError(f"task_options.environment.step_timeout_s must be a number of seconds > 0, "
                              f"got {timeout!r}")
        options = spec.get("options") or {}
        if not isinstance(options, dict):
            raise ConfigError(f"task_options.environment.options must be a mapping, got {options!r}")
        return cls(name=spec["name"], options=dict(options),
                   max_turns=integer("task_options.environment.max_turns", spec.get("max_turns", 4), low=1),
                   max_total_tokens=integer("task_options.environment.max_total_tokens",
                                            spec.get("max_total_tokens", 512), low=1),
                   step_timeout_s=float(timeout))


@dataclass
class Trajectory:
    """One conversation after its prompt: every token, which ones the model wrote, and the turns' rewards."""

    feature: PromptFeature
    sample: int
    env: Environment
    #: the prompt of its experience row: the feature's, or (opening observations) a prefix of it
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    train_mask: list[bool] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    text: str = ""
    message: AgentMessage | None = None
    last_token: int | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    policy_step: int = 0
    finish_reason: str | None = None
    failure: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def append(self, ids: list[int], logprobs: list[float] | None, budget: int) -> bool:
        """Add tokens (the model's when ``logprobs`` are given); False, and the trajectory cut, when they do not
        all fit in ``budget`` tokens after the prompt."""
        room = budget - len(self.token_ids)
        fits = len(ids) <= room
        ids = ids[:max(room, 0)]
        self.token_ids += ids
        self.logprobs += list(logprobs[:len(ids)]) if logprobs is not None else [0.0] * len(ids)
        self.train_mask += [logprobs is not None] * len(ids)
        if not fits:
            self.finish_reason = "length"
        return fits

    def completion(self) -> Completion:
        return Completion(token_ids=list(self.token_ids), logprobs=list(self.logprobs),
                          finish_reason=self.finish_reason or "length", policy_step=self.policy_step, text=self.text,
                          extra={"train_mask": list(self.train_mask), "prompt_ids": list(self.prompt_ids),
                                 "turn_rewards": list(self.turn_rewards),
                                 "environment_reward": float(sum(self.turn_rewards)), "failure": self.failure,
                                 "turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors})


class AgentRolloutEngine(RolloutEngine):
    """A :class:`~twinkle_rl.rollout.RolloutEngine` whose completions are multi-turn trajectories.

    ``rewards`` may be ``None`` (the environment's rewards alone); ``environment`` builds a fresh episode."""

    def __init__(self, *, environment: EnvironmentFactory, turns: ChatTurns, settings: AgentSettings,
                 rewards: RewardSet | None, **options: Any) -> None:
        super().__init__(rewards=rewards, **options)
        self.environment, self.turns, self.settings = environment, turns, settings
        name = getattr(environment, "environment_name", settings.name)
        self.runner = EnvironmentRunner(name, settings.step_timeout_s)

    @property
    def reward_names(self) -> list[str]:
        return [ENVIRONMENT_REWARD, *(self.rewards.names if self.rewards is not None else [])]

    # ------------------------------------------------------------------ trajectories
    def sample_groups(self, features: list[PromptFeature], rollout: int, draw_index: int) -> list[list[Completion]]:
        return self.play(features, self.n, self.params,
                         lambda index, j, turn: sample_seed(self.seed, rollout, draw_index, index, j, turn))

    def play(self, features: list[PromptFeature], n: int, params: SamplingParams,
             seed_of: Callable[[int, int, int], int]) -> list[list[Completion]]:
        """``n`` trajectories of each prompt; ``seed_of(prompt index, trajectory, turn)`` seeds each model turn."""
        trajectories = [Trajectory(f, j, self.environment(), list(f.prompt_ids), policy_step=self.sampler.policy_step)
                        for f in features for j in range(n)]
        self._open(trajectories)
        for i in range(len(features)):
            share_prompt(trajectories[i * n:(i + 1) * n])
        for turn in range(self.settings.max_turns):
            active = [t for t in trajectories if not t.done]
            if not self.dp.any(bool(active)):  # a lockstep sampler: every rank samples as many turns
                break
            self._model_turn(active, params, [[seed_of(t.feature.index, t.sample, turn)] for t in active])
            self._environment_turn([t for t in active if not t.done])
        for trajectory in trajectories:
            if not trajectory.done:
                trajectory.finish_reason = "length"  # max_turns reached
        self.runner.close([t.env for t in trajectories])
        return [[t.completion() for t in trajectories[i * n:(i + 1) * n]] for i in range(len(features))]

    def _open(self, trajectories: list[Trajectory]) -> None:
        outcomes = self.runner.reset([t.env for t in trajectories], [dict(t.feature.fields) for t in trajectories])
        for trajectory, outcome in zip(trajectories, outcomes, strict=True):
            if outcome.failure is not None:
                trajectory.finish_reason, trajectory.failure = "stop", outcome.failure
            elif outcome.result.observation:  # a user message between the prompt and its generation prompt
                trajectory.prompt_ids = self.turns.without_generation_prompt(trajectory.prompt_ids)
                trajectory.append(self.turns.opening_ids(outcome.result.observation), None,
                                  self.settings.max_total_tokens)

    def _model_turn(self, active: list[Trajectory], params: SamplingParams, seeds: list[list[int]]) -> None:
        prompts = [t.prompt_ids + t.token_ids for t in active]
        groups = self.sampler.sample(prompts, n=1, params=params, seeds=seeds)
        if len(groups) != len(active) or any(len(g) != 1 for g in groups):
            raise RuntimeError(f"sampler {type(self.sampler).__name__} returned {[len(g) for g in groups]} "
                               f"completions for {len(active)} trajectories x 1")
        for trajectory, (completion,) in zip(active, groups, strict=True):
            ids = list(completion.token_ids)
            trajectory.policy_step = completion.policy_step
            ended = completion.finish_reason == "stop"  # an end-of-turn token or a stop string
            closing = bool(ids) and ids[-1] in self.turns.end_of_turn_ids
            trajectory.text = self.turns.tokenizer.decode(ids[:-1] if closing else ids, skip_special_tokens=True)
            trajectory.last_token = ids[-1] if ids else None
            trajectory.message = parse_tool_calls(trajectory.text)
            trajectory.turns += 1
            trajectory.tool_calls += len(trajectory.message.tool_calls)
            trajectory.tool_errors += len(trajectory.message.errors)
            fits = trajectory.append(ids, list(completion.logprobs), self.settings.max_total_tokens)
            if fits and not ended:
                trajectory.finish_reason = "length"  # the turn hit max_new_tokens: its message is incomplete

    def _environment_turn(self, stepping: list[Trajectory]) -> None:
        outcomes = self.runner.step([t.env for t in stepping], [t.message for t in stepping])
        for trajectory, outcome in zip(stepping, outcomes, strict=True):
            self._answer(trajectory, outcome)

    def _answer(self, trajectory: Trajectory, outcome: StepOutcome) -> None:
        if outcome.failure is not None:
            trajectory.finish_reason, trajectory.failure = "stop", outcome.failure
            return
        result = outcome.result
        reward = float(result.reward)
        trajectory.turn_rewards.append(reward if math.isfinite(reward) else 0.0)
        if result.done:
            trajectory.finish_reason = "stop"
            return
        ids = self.turns.observation_ids(result.observation or "", trajectory.last_token)
        trajectory.append(ids, None, self.settings.max_total_tokens)

    # ------------------------------------------------------------------ rewards
    def score_groups(self, features: list[PromptFeature], groups: list[list[Completion]], stats: RolloutStats,
                     report: RewardReport) -> list[Scored]:
        completions = [c for g in groups for c in g]
        env = torch.tensor([c.extra["environment_reward"] for c in completions],
                           dtype=torch.float64).view(len(features), self.n)
        self._record(ENVIRONMENT_REWARD, env, stats, report)
        add_agent_stats(stats, completions)
        if self.rewards is None:
            scored = [Scored(f, groups[i], env[i]) for i, f in enumerate(features)]
        else:
            scored = super().score_groups(features, groups, stats, report)
        for i, group in enumerate(scored):
            group.rewards = group.rewards + (env[i] if self.rewards is not None else 0.0)
            group.feature = replace(group.feature, prompt_ids=list(groups[i][0].extra["prompt_ids"]))
        return scored

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, prompts: list[PromptFeature], *, seed: int, batch_size: int, temperature: float,
                 num_generations: int, accuracy_reward: str | None) -> dict[str, float]:
        """Held-out trajectories (greedy by default): ``reward/environment`` and the task's rewards, their total
        ``reward_mean``, ``accuracy`` (the ``accuracy_reward``, default the environment's), and the turns."""
        world = max(self.dp.view.size, 1)
        mine = prompts[self.dp.view.rank::world]
        params = SamplingParams(**{**self.params.__dict__, "temperature": float(temperature)})
        stats = RolloutStats()
        chunks = max(math.ceil(len(prompts) / world / batch_size), 1)
        for c in range(chunks):  # the same number of chunks on every rank (a lockstep sampler)
            chunk = mine[c * batch_size:(c + 1) * batch_size]
            groups = self.play(chunk, num_generations, params, lambda index, j, turn: sample_seed(seed, -1, index,
                                                                                                    j, turn))
            if chunk:
                self._evaluation_sums(chunk, groups, num_generations, stats)
        return evaluation_summary(stats, self.dp, self.reward_names, accuracy_reward)

    def _evaluation_sums(self, chunk: list[PromptFeature], groups: list[list[Completion]], n: int,
                         stats: RolloutStats) -> None:
        completions = [c for g in groups for c in g]
        total = [float(c.extra["environment_reward"]) for c in completions]
        stats.add(f"reward/{ENVIRONMENT_REWARD}", sum(total))
        stats.add(f"reward/{ENVIRONMENT_REWARD}#count", len(total))
        if self.rewards is not None:
            keys = sorted({k for f in chunk for k in f.fields})
            scores = self.rewards.score([f.text for f in chunk for _ in range(n)], [c.text for c in completions],
                                        {k: [f.fields.get(k) for f in chunk for _ in range(n)] for k in keys})
            for name, values in scores.per_reward.items():
                finite = [v for v in values if not math.isnan(v)]
                stats.add(f"reward/{name}", sum(finite))
                stats.add(f"reward/{name}#count", len(finite))
            total = [a + b for a, b in zip(total, scores.total, strict=True)]
        stats.add("reward", sum(total))
        stats.add("completions", len(completions))
        stats.add("completion_tokens", sum(len(c.token_ids) for c in completions))
        add_agent_stats(stats, completions)


def share_prompt(group: list[Trajectory]) -> None:
    """Give a prompt's trajectories one experience prompt (a group's rows share it): the shortest of theirs, which
    the others start with; what they have beyond it moves to their untrained tokens."""
    shortest = min((t.prompt_ids for t in group), key=len)
    for trajectory in group:
        extra = trajectory.prompt_ids[len(shortest):]
        if extra:
            trajectory.prompt_ids = list(shortest)
            trajectory.token_ids = extra + trajectory.token_ids
            trajectory.logprobs = [0.0] * len(extra) + trajectory.logprobs
            trajectory.train_mask = [False] * len(extra) + trajectory.train_mask


def add_agent_stats(stats: RolloutStats, completions: list[Completion]) -> None:
    stats.add("env_turns", sum(c.extra["turns"] for c in completions))
    stats.add("env_tool_calls", sum(c.extra["tool_calls"] for c in completions))
    stats.add("env_tool_errors", sum(c.extra["tool_errors"] for c in completions))
    stats.add("env_timeouts", sum(c.extra["failure"] == "timeout" for c in completions))
    stats.add("env_errors", sum(c.extra["failure"] == "error" for c in completions))


def agent_summary(stats: RolloutStats, dp: DataParallel) -> dict[str, float]:
    """The agent values of a train log line: turns and tool calls per trajectory, failed environment steps."""
    keys = ["completions", *AGENT_SUMS]
    return agent_values(dict(zip(keys, dp.sum(torch.tensor([stats.sums.get(k, 0.0) for k in keys],
                                                           dtype=torch.float64)).tolist(), strict=True)))


def agent_values(total: dict[str, float]) -> dict[str, float]:
    """Per-trajectory means and failure counts from summed :data:`AGENT_SUMS` and ``completions``."""
    count = total["completions"]
    if not count:
        return {}
    return {"turns_mean": total["env_turns"] / count, "tool_calls_mean": total["env_tool_calls"] / count,
            "tool_call_errors": total["env_tool_errors"], "env_timeouts": total["env_timeouts"],
            "env_errors": total["env_errors"]}


def evaluation_summary(stats: RolloutStats, dp: DataParallel, reward_names: list[str],
                       accuracy_reward: str | None) -> dict[str, float]:
    keys = ["reward", "completion_tokens", *AGENT_SUMS, *(f"reward/{n}" for n in reward_names),
            *(f"reward/{n}#count" for n in reward_names), "completions"]
    total = dict(zip(keys, dp.sum(torch.tensor([stats.sums.get(k, 0.0) for k in keys],
                                               dtype=torch.float64)).tolist(), strict=True))
    count = total["completions"] or 1.0
    out = {f"reward/{n}": total[f"reward/{n}"] / (total[f"reward/{n}#count"] or 1.0) for n in reward_names}
    out.update(agent_values(total))
    out["reward_mean"] = total["reward"] / count
    out["completion_length_mean"] = total["completion_tokens"] / count
    accuracy = accuracy_reward or ENVIRONMENT_REWARD
    if f"reward/{accuracy}" in out:
        out["accuracy"] = out[f"reward/{accuracy}"]
    out["num_examples"] = int(total["completions"])
    return out


__all__ = ["AGENT_SUMS", "ENVIRONMENT_REWARD", "AgentRolloutEngine", "AgentSettings", "Trajectory",
           "add_agent_stats", "agent_summary", "agent_values", "evaluation_summary"]
