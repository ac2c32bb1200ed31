"""One rollout: prompts -> completions -> rewards -> advantages -> an experience batch.

:class:`RolloutEngine` runs on every rank on that rank's share of the prompts, so a group of ``n``
completions of one prompt is always sampled, scored and normalised on one rank. Only the estimators
that normalise over the whole batch (REINFORCE++) reduce over the data-parallel ranks (:class:`DataParallel`).

Dynamic sampling (DAPO): groups whose rewards are all equal carry no signal for group-relative
advantages; with ``dynamic_sampling`` they are dropped and more prompts are drawn until the rollout has
as many informative groups as prompts in a data batch, at most ``max_sampling_rounds`` draws; what is
still missing is filled with dropped groups (their advantages are zero) and counted. The rounds are
agreed over the ranks, so a lockstep sampler (FSDP2, ZeRO-3) never waits on a rank that has stopped.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.model.data_parallel import DataParallelView
from twinkle_core.sampling import Completion, Sampler, SamplingParams, sample_seed
from twinkle_rl.advantages import ESTIMATORS, informative_groups, soft_overlong_penalty
from twinkle_rl.experience import completion_lengths, experience_batch
from twinkle_rl.prompts import PromptFeature
from twinkle_rl.rewards import RewardSet

if TYPE_CHECKING:
    from twinkle_core.model.base import TwinkleModel

logger = logging.getLogger("twinkle.rl")


@dataclass
class RolloutStats:
    """Sums over one rank's completions (reduced over the ranks when logged)."""

    sums: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def max(self, key: str, value: float) -> None:
        self.maxima[key] = max(self.maxima.get(key, -math.inf), float(value))

    def merge(self, other: RolloutStats) -> None:
        for key, value in other.sums.items():
            self.add(key, value)
        for key, value in other.maxima.items():
            self.max(key, value)


@dataclass(frozen=True)
class DataParallel:
    """The rollout's reductions over the model's data-parallel ranks (:attr:`TwinkleModel.data_parallel
    <twinkle_core.model.base.TwinkleModel.data_parallel>`): every reduction of rollouts runs over that view's group
    only, so tensor- or pipeline-parallel ranks, which hold the same prompts, are not counted twice. Values are
    reduced on the accelerator's device (NCCL reduces no CPU tensors) and come back on the CPU."""

    view: DataParallelView = field(default_factory=DataParallelView)

    @classmethod
    def of(cls, model: TwinkleModel) -> DataParallel:
        return cls(model.data_parallel)

    def _device(self) -> Any:
        from twinkle_core.accelerator import current_accelerator

        return current_accelerator().device()

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the data-parallel ranks, on the CPU (unchanged in one process)."""
        if not self.view.active:
            return value
        return self.view.sum(value, self._device()).cpu()

    def any(self, flag: bool) -> bool:
        return bool(self.sum(torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)).item() > 0)

    def max(self, values: dict[str, float], keys: list[str]) -> dict[str, float]:
        """``values[key]`` maximised over the data-parallel ranks (a missing key counts as 0)."""
        local = torch.tensor([values.get(k, 0.0) for k in keys], dtype=torch.float64)
        if self.view.active:
            local = self.view.max(local, self._device()).cpu()
        return dict(zip(keys, local.tolist(), strict=True))


@dataclass
class Rollout:
    """An experience batch of ``S = groups * n`` rows and what the logs report about it."""

    batch: dict[str, torch.Tensor]
    completions: list[Completion]
    rewards: torch.Tensor  # [groups, n], after overlong shaping
    advantages: torch.Tensor  # [groups, n]


class RolloutEngine:
    def __init__(self, *, sampler: Sampler, rewards: RewardSet, params: SamplingParams, num_generations: int,
                 estimator: str | None, estimator_options: dict[str, Any], seed: int, pad_token_id: int,
                 dynamic_sampling: bool = False, max_sampling_rounds: int = 4, overlong_filter: bool = False,
                 overlong_penalty: dict[str, int] | None = None, dp: DataParallel | None = None) -> None:
        self.dp = dp or DataParallel()
        self.sampler, self.rewards, self.params = sampler, rewards, params
        self.n = num_generations
        self.estimator = ESTIMATORS[estimator] if estimator is not None else None
        self.estimator_options = dict(estimator_options)
        self.seed, self.pad_token_id = seed, pad_token_id
        self.dynamic_sampling = dynamic_sampling
        self.max_sampling_rounds = max_sampling_rounds
        self.overlong_filter = overlong_filter
        self.overlong_penalty = overlong_penalty

    # ------------------------------------------------------------------ sampling and scoring
    def _sample(self, features: list[PromptFeature], rollout: int, draw_index: int) -> list[list[Completion]]:
        seeds = [[sample_seed(self.seed, rollout, draw_index, f.index, j) for j in range(self.n)] for f in features]
        groups = self.sampler.sample([f.prompt_ids for f in features], n=self.n, params=self.params, seeds=seeds)
        if len(groups) != len(features) or any(len(g) != self.n for g in groups):
            raise RuntimeError(f"sampler {type(self.sampler).__name__} returned {[len(g) for g in groups]} completions "
                               f"for {len(features)} prompts x {self.n}")
        return groups

    def _score(self, features: list[PromptFeature], groups: list[list[Completion]],
               stats: RolloutStats) -> torch.Tensor:
        prompts = [f.text for f in features for _ in range(self.n)]
        completions = [c.text for g in groups for c in g]
        keys = sorted({k for f in features for k in f.fields})
        fields = {k: [f.fields.get(k) for f in features for _ in range(self.n)] for k in keys}
        scores = self.rewards.score(prompts, completions, fields)
        stats.add("nan_rewards", scores.nan_count)
        for name, values in scores.per_reward.items():
            finite = [v for v in values if not math.isnan(v)]
            stats.add(f"reward/{name}", sum(finite))
            stats.add(f"reward/{name}#count", len(finite))
        rewards = torch.tensor(scores.total, dtype=torch.float64).view(len(features), self.n)
        if self.overlong_penalty:
            lengths = completion_lengths([c for g in groups for c in g]).to(torch.float64).view_as(rewards)
            rewards = rewards + soft_overlong_penalty(lengths, **self.overlong_penalty)
        return rewards

    # ------------------------------------------------------------------ one rollout
    def run(self, draw: Callable[[], dict[str, Any]], rollout: int, stats: RolloutStats) -> Rollout:
        started = time.perf_counter()
        kept: list[tuple[PromptFeature, list[Completion], torch.Tensor]] = []
        dropped: list[tuple[PromptFeature, list[Completion], torch.Tensor]] = []
        target = None
        for draw_index in range(self.max_sampling_rounds if self.dynamic_sampling else 1):
            need = target is None or len(kept) < target
            if draw_index > 0 and not self.dp.any(need):
                break
            features = list(draw()["prompts"]) if need else []
            target = len(features) if target is None else target
            groups = self._sample(features, rollout, draw_index)  # an empty list keeps a lockstep sampler matched
            if not features:
                continue
            rewards = self._score(features, groups, stats)
            informative = informative_groups(rewards) if self.dynamic_sampling else torch.ones(len(features), dtype=torch.bool)
            for i, feature in enumerate(features):
                (kept if informative[i] else dropped).append((feature, groups[i], rewards[i]))
        stats.add("groups_dropped", max(len(kept) + len(dropped) - (target or 0), 0) if self.dynamic_sampling else 0)
        if len(kept) < (target or 0):
            stats.add("groups_filled_uninformative", target - len(kept))
            kept.extend(dropped[: target - len(kept)])
        kept = kept[:target]
        stats.add("sampler_time_s", time.perf_counter() - started)
        return self._build(kept, stats)

    def _build(self, kept: list[tuple[PromptFeature, list[Completion], torch.Tensor]], stats: RolloutStats) -> Rollout:
        rewards = torch.stack([r for _, _, r in kept]) if kept else torch.zeros(0, self.n, dtype=torch.float64)
        if self.estimator is None:  # PPO: advantages come from the critic (GAE), after the rollout
            advantages = torch.zeros_like(rewards)
        else:  # only batch-normalising estimators reduce over the ranks; the group ones ignore global_sum
            advantages = self.estimator(rewards, global_sum=self.dp.sum, **self.estimator_options)
        completions = [c for _, g, _ in kept for c in g]
        prompts = [f.prompt_ids for f, _, _ in kept for _ in range(self.n)]
        batch = experience_batch(prompts, completions, pad_token_id=self.pad_token_id)
        batch["advantages"] = advantages.reshape(-1).to(torch.float32)
        truncated = torch.tensor([c.finish_reason == "length" for c in completions], dtype=torch.bool)
        if self.overlong_filter and truncated.any():
            batch["labels"][truncated] = IGNORE_INDEX  # DAPO overlong filtering: a cut answer teaches nothing either way
        lengths = completion_lengths(completions)
        stats.add("completions", len(completions))
        stats.add("reward", float(rewards.sum()))
        stats.add("reward_sq", float((rewards ** 2).sum()))
        stats.add("completion_tokens", float(lengths.sum()))
        stats.add("truncated", float(truncated.sum()))
        stats.add("empty_completions", float((lengths == 0).sum()))
        if len(completions):
            stats.max("completion_length_max", float(lengths.max()))
        return Rollout(batch=batch, completions=completions, rewards=rewards, advantages=advantages)


__all__ = ["DataParallel", "Rollout", "RolloutEngine", "RolloutStats"]
