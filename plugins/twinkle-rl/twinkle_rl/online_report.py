"""What the online RL tasks report: the per-step summary of the rollouts, and held-out evaluation.

Both reduce over the data-parallel ranks (every rank calls them): sums with one all-reduce, the longest
completion with one max-reduce, so the logged values are global whatever the number of ranks.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from twinkle_core.sampling import SamplingParams, sample_prompts, sample_seed
from twinkle_rl.rollout import DataParallel, RolloutEngine, RolloutStats

#: sums every rank reduces, also a rank whose rollouts had none of them (the keys must agree)
BASE_SUMS = ("completions", "reward", "reward_sq", "completion_tokens", "truncated", "sampler_time_s", "nan_rewards",
             "empty_completions", "groups_dropped", "groups_filled_uninformative", "groups_without_score", "policy_lag",
             "generation_time_s", "reward_time_s", "weight_sync_time_s", "rollout_wait_s")


def _accuracy(out: dict[str, float], names: list[str], accuracy_reward: str | None) -> None:
    accuracy = accuracy_reward or (names[0] if names else None)
    if accuracy is not None and f"reward/{accuracy}" in out:
        out["accuracy"] = out[f"reward/{accuracy}"]


def summarise(stats: RolloutStats, dp: DataParallel, *, reward_names: list[str], accuracy_reward: str | None,
              one_step_off: bool, dynamic_sampling: bool) -> dict[str, float]:
    """The train log line's rollout values since the last call."""
    keys = sorted(set(stats.sums) | set(BASE_SUMS) | {f"reward/{n}" for n in reward_names}
                  | {f"reward/{n}#count" for n in reward_names})
    sums = dp.sum(torch.tensor([stats.sums.get(k, 0.0) for k in keys], dtype=torch.float64))
    total = dict(zip(keys, sums.tolist(), strict=True))
    longest = dp.max(stats.maxima, ["completion_length_max"])["completion_length_max"]
    count = total["completions"]
    if not count:
        return {}
    mean = total["reward"] / count
    out = {"reward_mean": mean,
           "reward_std": math.sqrt(max(total["reward_sq"] / count - mean * mean, 0.0)),
           "completion_length_mean": total["completion_tokens"] / count,
           "completion_length_max": longest,
           "clipped_fraction": total["truncated"] / count,
           "sampler_time_s": total["sampler_time_s"],
           "sampler_tokens_per_s": total["completion_tokens"] / max(total["sampler_time_s"], 1e-9),
           "nan_rewards": total["nan_rewards"], "groups_without_score": total["groups_without_score"],
           "empty_completions": total["empty_completions"]}
    # where a rank's time went, per role (seconds over the logged steps, the mean over the data-parallel ranks)
    ranks = dp.view.size if dp.view.active else 1
    for key in ("generation_time_s", "reward_time_s", "weight_sync_time_s"):
        out[key] = total[key] / ranks
    if one_step_off:
        out["policy_lag"] = total["policy_lag"] / count
        out["rollout_wait_s"] = total["rollout_wait_s"] / ranks  # the trainer idle, waiting for the sampler
    if dynamic_sampling:
        out["groups_dropped"] = total["groups_dropped"]
        out["groups_filled_uninformative"] = total["groups_filled_uninformative"]
    for name in reward_names:
        scored = total[f"reward/{name}#count"]
        out[f"reward/{name}"] = total[f"reward/{name}"] / scored if scored else float("nan")
    _accuracy(out, reward_names, accuracy_reward)
    return out


def _chunk_sums(engine: RolloutEngine, chunk: list[Any], groups: list[Any], num_generations: int) -> torch.Tensor:
    """One chunk's sums: per reward (NaN scores left out), total reward, completion tokens, completions."""
    names = engine.rewards.names
    completions = [x for g in groups for x in g]
    keys = sorted({k for f in chunk for k in f.fields})
    fields = {k: [f.fields.get(k) for f in chunk for _ in range(num_generations)] for k in keys}
    scores = engine.rewards.score([f.text for f in chunk for _ in range(num_generations)],
                                  [x.text for x in completions], fields)
    sums = torch.zeros(len(names) + 3, dtype=torch.float64)
    for i, name in enumerate(names):
        sums[i] += sum(v for v in scores.per_reward[name] if not math.isnan(v))
    sums[-3] += sum(scores.total)
    sums[-2] += sum(len(x.token_ids) for x in completions)
    sums[-1] += len(completions)
    return sums


def evaluate_prompts(engine: RolloutEngine, prompts: list[Any], *, seed: int, batch_size: int, temperature: float,
                     num_generations: int, accuracy_reward: str | None) -> dict[str, float]:
    """Mean rewards of ``num_generations`` completions of each prompt; each rank answers every world-size-th."""
    dp = engine.dp
    world = max(dp.view.size, 1)
    mine = prompts[dp.view.rank::world]
    params = SamplingParams(**{**engine.params.__dict__, "temperature": float(temperature)})
    names = engine.rewards.names
    sums = torch.zeros(len(names) + 3, dtype=torch.float64)  # per reward..., total, completion tokens, count
    chunks = max(math.ceil(len(prompts) / world / batch_size), 1)
    for c in range(chunks):  # the same number of sampler calls on every rank (a lockstep sampler)
        chunk = mine[c * batch_size:(c + 1) * batch_size]
        seeds = [[sample_seed(seed, -1, f.index, j) for j in range(num_generations)] for f in chunk]
        groups = sample_prompts(engine.sampler, [f.prompt_ids for f in chunk], n=num_generations, params=params,
                                seeds=seeds, inputs=[f.inputs for f in chunk])
        if chunk:
            sums += _chunk_sums(engine, chunk, groups, num_generations)
    sums = dp.sum(sums)
    count = float(sums[-1]) or 1.0
    out = {f"reward/{name}": float(sums[i]) / count for i, name in enumerate(names)}
    out["reward_mean"] = float(sums[-3]) / count
    out["completion_length_mean"] = float(sums[-2]) / count
    _accuracy(out, names, accuracy_reward)
    out["num_examples"] = int(sums[-1])
    return out
