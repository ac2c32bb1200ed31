"""One rollout: prompts -> completions -> rewards -> advantages -> an experience batch.

:class:`RolloutEngine` runs on every rank on that rank's share of the prompts, so a group of ``n``
completions of one prompt is always sampled, scored and normalised on one rank. Only the estimators
that normalise over the whole batch (REINFORCE++) reduce over the data-parallel ranks (:class:`DataParallel`).

Dynamic sampling (DAPO): groups whose rewards are all equal carry no signal for group-relative
advantages; with ``dynamic_sampling`` they are dropped and more prompts are drawn until the rollout has
as many informative groups as prompts in a data batch, at most ``max_sampling_rounds`` draws; what is
still missing is filled with dropped groups (their advantages are zero) and counted. The rounds are
agreed over the ranks, so a lockstep sampler (FSDP2, ZeRO-3) never waits on a rank that has stopped.

Groups without a score: when a reward returns ``nan`` ("no score") for every completion of a prompt, that
group carries no signal about the prompt, and scoring its ``nan`` as 0 (``on_nan: zero``) would train on the
other rewards alone. Such a group trains nothing: its advantages are 0, its labels are masked (so it adds no
KL term and does not dilute the loss's mean), the advantages are estimated over the other groups only, and
it counts as ``groups_without_score``; each rollout with such groups logs one warning naming the reward.
The advantages handed to the float32 loss must be finite: rewards so large that an estimator in reward units
(``dr_grpo``, ``rloo``) overflows float32 stop training with a :class:`~twinkle_rl.rewards.RewardError` naming
the reward with the largest scores.
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
from twinkle_core.sampling import Completion, Sampler, SamplingParams, sample_prompts, sample_seed
from twinkle_rl.advantages import ESTIMATORS, informative_groups, soft_overlong_penalty
from twinkle_rl.experience import completion_lengths, experience_batch
from twinkle_rl.prompts import PromptFeature
from twinkle_rl.rewards import RewardError, RewardSet

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
class RewardReport:
    """What a rollout learnt about its rewards: each one's largest finite magnitude (named when advantages
    overflow) and how many groups it left without a score (one warning per rollout)."""

    magnitudes: dict[str, float] = field(default_factory=dict)
    unscored: dict[str, int] = field(default_factory=dict)

    def warn(self, groups: int) -> None:
        for name, count in self.unscored.items():
            logger.warning("reward %r returned nan for every completion of %d of the %d prompts of this rollout: "
                           "those groups train nothing (logged as groups_without_score)", name, count, groups)


def check_advantages(advantages: torch.Tensor, report: RewardReport, what: str = "advantages",
                     hint: str = "; or use advantage: grpo, which normalises each group") -> None:
    """``advantages`` must be finite in float32, the dtype the loss reads; else a :class:`RewardError` naming the
    reward with the largest scores (the estimator's result is in reward units)."""
    if bool(torch.isfinite(advantages.to(torch.float32)).all()):
        return
    largest = max(report.magnitudes.items(), key=lambda item: item[1], default=("(none)", math.nan))
    raise RewardError(f"rewards: the {what} of this rollout are not finite in float32 (the loss's dtype); the "
                      f"largest scores come from reward {largest[0]!r} (|score| up to {largest[1]:g}). Scale that "
                      f"reward down (scores of order 1){hint}")


@dataclass
class Rollout:
    """An experience batch of ``S = groups * n`` rows and what the logs report about it."""

    batch: dict[str, torch.Tensor]
    completions: list[Completion]
    rewards: torch.Tensor  # [groups, n], after overlong shaping
    advantages: torch.Tensor  # [groups, n]
    report: RewardReport = field(default_factory=RewardReport)


@dataclass
class Scored:
    """One prompt's group: its completions, their total rewards ``[n]`` and whether every reward scored it."""

    feature: PromptFeature
    completions: list[Completion]
    rewards: torch.Tensor
    scored: bool = True


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
    # the two steps a rollout of another shape replaces (the multi-turn agent engine: agent_rollout.py)
    def sample_groups(self, features: list[PromptFeature], rollout: int, draw_index: int) -> list[list[Completion]]:
        """``n`` completions of each prompt, seeded by (rollout, draw, prompt, index)."""
        seeds = [[sample_seed(self.seed, rollout, draw_index, f.index, j) for j in range(self.n)] for f in features]
        groups = sample_prompts(self.sampler, [f.prompt_ids for f in features], n=self.n, params=self.params,
                                seeds=seeds, inputs=[f.inputs for f in features])
        if len(groups) != len(features) or any(len(g) != self.n for g in groups):
            raise RuntimeError(f"sampler {type(self.sampler).__name__} returned {[len(g) for g in groups]} completions "
                               f"for {len(features)} prompts x {self.n}")
        return groups

    def score_groups(self, features: list[PromptFeature], groups: list[list[Completion]], stats: RolloutStats,
                     report: RewardReport) -> list[Scored]:
        """Every group's total rewards ``[n]`` (after overlong shaping), recorded in ``stats`` and ``report``."""
        prompts = [f.text for f in features for _ in range(self.n)]
        completions = [c.text for g in groups for c in g]
        keys = sorted({k for f in features for k in f.fields})
        fields = {k: [f.fields.get(k) for f in features for _ in range(self.n)] for k in keys}
        scores = self.rewards.score(prompts, completions, fields)
        stats.add("nan_rewards", scores.nan_count)
        scored = torch.ones(len(features), dtype=torch.bool)
        for name, values in scores.per_reward.items():
            scored &= self._record(name, torch.tensor(values, dtype=torch.float64).view(len(features), self.n),
                                   stats, report)
        rewards = torch.tensor(scores.total, dtype=torch.float64).view(len(features), self.n)
        if self.overlong_penalty:
            lengths = completion_lengths([c for g in groups for c in g]).to(torch.float64).view_as(rewards)
            rewards = rewards + soft_overlong_penalty(lengths, **self.overlong_penalty)
        return [Scored(f, groups[i], rewards[i], bool(scored[i])) for i, f in enumerate(features)]

    @staticmethod
    def _record(name: str, values: torch.Tensor, stats: RolloutStats, report: RewardReport) -> torch.Tensor:
        """Log one reward's scores ``[groups, n]``; ``[groups]`` bool: False where it scored no completion."""
        finite = values[~values.isnan()]
        stats.add(f"reward/{name}", sum(finite.tolist()))
        stats.add(f"reward/{name}#count", finite.numel())
        report.magnitudes[name] = max(report.magnitudes.get(name, 0.0), float(finite.abs().max()) if finite.numel() else 0.0)
        without = values.isnan().all(dim=1)
        if bool(without.any()):
            report.unscored[name] = report.unscored.get(name, 0) + int(without.sum())
        return ~without

    # ------------------------------------------------------------------ one rollout
    def run(self, draw: Callable[[], dict[str, Any]], rollout: int, stats: RolloutStats) -> Rollout:
        started = time.perf_counter()
        kept: list[Scored] = []
        dropped: list[Scored] = []
        report = RewardReport()
        target = None
        for draw_index in range(self.max_sampling_rounds if self.dynamic_sampling else 1):
            need = target is None or len(kept) < target
            if draw_index > 0 and not self.dp.any(need):
                break
            features = list(draw()["prompts"]) if need else []
            target = len(features) if target is None else target
            sampling = time.perf_counter()
            groups = self.sample_groups(features, rollout, draw_index)  # an empty list keeps a lockstep sampler matched
            stats.add("generation_time_s", time.perf_counter() - sampling)
            if not features:
                continue
            scoring = time.perf_counter()
            scored = self.score_groups(features, groups, stats, report)
            stats.add("reward_time_s", time.perf_counter() - scoring)
            informative = torch.ones(len(features), dtype=torch.bool)
            if self.dynamic_sampling:  # a group without a score is not informative either
                informative = informative_groups(torch.stack([g.rewards for g in scored]))
                informative &= torch.tensor([g.scored for g in scored], dtype=torch.bool)
            for i, group in enumerate(scored):
                (kept if informative[i] else dropped).append(group)
        stats.add("groups_dropped", max(len(kept) + len(dropped) - (target or 0), 0) if self.dynamic_sampling else 0)
        if len(kept) < (target or 0):
            stats.add("groups_filled_uninformative", target - len(kept))
            kept.extend(dropped[: target - len(kept)])
        kept = kept[:target]
        stats.add("sampler_time_s", time.perf_counter() - started)
        report.warn(len(kept))
        return self._build(kept, stats, report)

    def _advantages(self, rewards: torch.Tensor, scored: torch.Tensor, token_counts: torch.Tensor,
                    report: RewardReport) -> torch.Tensor:
        """The estimator's advantages over the scored groups (0 for the others, and for PPO: its critic's GAE
        replaces them after the rollout). ``token_counts [groups, n]``: each completion's trained tokens."""
        advantages = torch.zeros_like(rewards)
        if self.estimator is not None:  # only batch-normalising estimators reduce over the ranks
            advantages[scored] = self.estimator(rewards[scored], global_sum=self.dp.sum,
                                                token_counts=token_counts[scored], **self.estimator_options)
            check_advantages(advantages, report)
        return advantages

    def _build(self, kept: list[Scored], stats: RolloutStats, report: RewardReport) -> Rollout:
        rewards = torch.stack([g.rewards for g in kept]) if kept else torch.zeros(0, self.n, dtype=torch.float64)
        scored = torch.tensor([g.scored for g in kept], dtype=torch.bool)
        completions = [c for g in kept for c in g.completions]
        lengths = completion_lengths(completions)
        truncated = torch.tensor([c.finish_reason == "length" for c in completions], dtype=torch.bool)
        trained = torch.where(truncated, 0.0, lengths) if self.overlong_filter else lengths
        advantages = self._advantages(rewards, scored, trained.reshape(len(kept), self.n), report)
        prompts = [g.feature.prompt_ids for g in kept for _ in range(self.n)]
        inputs = [g.feature.inputs for g in kept for _ in range(self.n)]
        batch = experience_batch(prompts, completions, pad_token_id=self.pad_token_id, inputs=inputs)
        batch["advantages"] = advantages.reshape(-1).to(torch.float32)
        without_score = (~scored).repeat_interleave(self.n)
        batch["labels"][without_score] = IGNORE_INDEX  # no score for the prompt: the group trains nothing
        stats.add("groups_without_score", float((~scored).sum()))
        if self.overlong_filter and truncated.any():
            batch["labels"][truncated] = IGNORE_INDEX  # DAPO overlong filtering: a cut answer teaches nothing either way
        stats.add("completions", len(completions))
        stats.add("reward", float(rewards.sum()))
        stats.add("reward_sq", float((rewards ** 2).sum()))
        stats.add("completion_tokens", float(lengths.sum()))
        stats.add("truncated", float(truncated.sum()))
        stats.add("empty_completions", float((lengths == 0).sum()))
        if len(completions):
            stats.max("completion_length_max", float(lengths.max()))
        return Rollout(batch=batch, completions=completions, rewards=rewards, advantages=advantages, report=report)


__all__ = ["DataParallel", "RewardReport", "Rollout", "RolloutEngine", "RolloutStats", "Scored", "check_advantages"]
