"""Advantage estimators of online RL, as plain torch functions.

Group estimators take ``rewards`` shaped ``[num_groups, n]``: row ``g`` holds the scalar rewards of the ``n``
completions sampled for prompt ``g``. They return advantages of the same shape and dtype (integer and half
precision rewards give float32).

Overflow. Every estimator computes in float64 on rewards divided by a power of two (per group, or agreed over
the ranks for the batch-normalising ones): dividing by a power of two is exact, so ordinary rewards give
bit for bit the advantages of the textbook formula, and any finite rewards, up to float64's largest
(``1e308``), give finite moments: the group std of ``[1e308, -1e308]`` no longer overflows to ``inf`` (which
turned every advantage of the group into 0). What the estimators cannot change is the range of their
result: ``dr_grpo``, ``rloo`` and PPO's GAE give advantages in reward units, and the rollout refuses
advantages the float32 loss cannot hold (:class:`twinkle_rl.rewards.RewardError` naming the reward).

``ESTIMATORS`` maps a recipe's ``advantage:`` name to one of them with a uniform
signature; :func:`gae` is separate because PPO's estimate needs a value model.

``global_sum`` is an optional callable ``(tensor) -> tensor`` returning the element-wise sum of a tensor over
the data-parallel ranks (an all-reduce). Estimators that normalise over the whole batch use it, so that
``R`` ranks holding ``1/R`` of the batch each get the advantages one process would get for all of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from twinkle_core.errors import ConfigError
from twinkle_rl.checks import finite_number

GlobalSum = Callable[[torch.Tensor], torch.Tensor]


def _as_groups(rewards: torch.Tensor, where: str) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"{where}: rewards must be a tensor shaped [num_groups, n], got {shape}")
    return _floating(rewards)


def _floating(x: torch.Tensor) -> torch.Tensor:
    if x.dtype in (torch.float32, torch.float64):
        return x
    return x.to(torch.float32)  # integer rewards, or half precision whose eps would swamp small spreads


def _like(result: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``result`` in ``source``'s dtype; float32 for integer sources (and half precision: its range is too small
    for advantages of large rewards)."""
    return result.to(source.dtype if source.dtype in (torch.float32, torch.float64) else torch.float32)


#: power-of-two exponents the scaling keeps to: ``2 ** -MAX_EXPONENT`` and ``2 ** MAX_EXPONENT`` are normal float64
MAX_EXPONENT = 1000


def _inverse_scale(magnitude: torch.Tensor) -> torch.Tensor:
    """``2 ** -e`` with ``magnitude * 2 ** -e`` in ``[0.5, 1)``: a power of two, so multiplying by it is exact
    (1 where ``magnitude`` is 0 or not finite; ``e`` kept to ``[-MAX_EXPONENT, 1024]``)."""
    _, exponent = torch.frexp(magnitude)
    inverse = torch.pow(2.0, -exponent.clamp(-MAX_EXPONENT, 1024).to(torch.float64))
    usable = (magnitude > 0) & torch.isfinite(magnitude)
    return torch.where(usable, inverse, torch.ones_like(inverse))


def _scaled_groups(rewards: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rewards / s, 1 / s)`` in float64, ``s`` a power of two per group (row) around its largest magnitude."""
    r = _as_groups(rewards, where).to(torch.float64)
    inverse = _inverse_scale(r.abs().amax(dim=1, keepdim=True))
    return r * inverse, inverse


# --------------------------------------------------------------------------- group baselines


def grpo_advantages(rewards: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's group-relative advantage (Shao et al. 2024, DeepSeekMath, §4.1.2, outcome supervision):

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

    ``std`` is the unbiased (``n - 1``) sample standard deviation, as ``torch.std`` and TRL's GRPO compute
    it; ``eps`` (TRL's 1e-4) keeps a group of equal rewards at advantage 0 instead of 0/0.

    ``scale_by_std=False`` is Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"):
    ``A_i = r_i - mean(r_group)``, removing the per-question difficulty bias that the division introduces.
    """
    eps = finite_number("advantage_options.eps", eps, low=0.0, low_open=scale_by_std)
    x, inverse = _scaled_groups(rewards, "grpo_advantages")  # the formula on rewards / s: exact, no overflow
    centered = x - x.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return _like(centered / inverse, rewards)
    if x.shape[1] < 2:
        raise ConfigError(f"grpo_advantages: the group std needs n >= 2 completions per prompt, got n = "
                          f"{x.shape[1]}; sample more per prompt or use dr_grpo (no std)")
    advantages = centered / (x.std(dim=1, keepdim=True) + eps * inverse)  # (r - m) / (std + eps), both over s
    return _like(advantages, rewards)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics", eq. 5 / Kool et al. 2019):

        A_i = r_i - 1/(n-1) * sum_{j != i} r_j

    each completion's baseline is the mean reward of the other ``n - 1`` samples of its prompt.
    """
    x, inverse = _scaled_groups(rewards, "rloo_advantages")
    n = x.shape[1]
    if n < 2:
        raise ConfigError(f"rloo_advantages: the leave-one-out baseline needs n >= 2 completions per prompt, "
                          f"got n = {n}")
    others_mean = (x.sum(dim=1, keepdim=True) - x) / (n - 1)
    return _like((x - others_mean) / inverse, rewards)


# --------------------------------------------------------------------------- batch normalisation


def _reduce(sums: torch.Tensor, global_sum: GlobalSum | None) -> torch.Tensor:
    return sums if global_sum is None else global_sum(sums)


def _global_moments(x: torch.Tensor, mask: torch.Tensor | None,
                    global_sum: GlobalSum | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean, population variance, 1 / s)``: the moments of ``x / s`` over all ranks, in float64, ``s`` a
    power of two. ``mask`` weighs each element (a 0/1 mask, or counts: an element of weight ``k`` counts as
    ``k`` equal elements); ``None`` weighs every element 1.

    One all-reduce of ``[sum x, sum x^2, count, probe]``: ``s`` is 1 unless those sums overflow (values beyond
    about ``1e154``); then ``probe``, the sum over the ranks of ``2 ** (e - 1023)`` for each rank's largest
    magnitude ``< 2 ** e``, gives every rank the same ``s >= 2 ** max(e)``, and a second all-reduce sums the
    moments of ``x / s``. float64 keeps ``E[x^2] - E[x]^2`` accurate for the values this is used on.
    """
    x64 = x.to(torch.float64)
    weight = torch.ones_like(x64) if mask is None else mask.to(torch.float64)
    x64 = torch.where(weight > 0, x64, torch.zeros_like(x64))  # padding may hold garbage, even nan
    largest = x64.abs().max() if x64.numel() else x64.new_zeros(())
    probe = torch.where(largest > 0, torch.pow(2.0, torch.frexp(largest)[1].to(torch.float64) - 1023),
                        largest.new_zeros(()))
    total, total_sq, count, probe = _reduce(torch.stack([(x64 * weight).sum(), (x64 * x64 * weight).sum(),
                                                         weight.sum(), probe]), global_sum).unbind()
    inverse = torch.ones((), dtype=torch.float64)
    if not (torch.isfinite(total) and torch.isfinite(total_sq)):  # the same on every rank: the sums are global
        inverse = torch.pow(2.0, -(torch.frexp(probe)[1].to(torch.float64) + 1022))
        scaled = x64 * inverse
        total, total_sq, count = _reduce(torch.stack([(scaled * weight).sum(), (scaled * scaled * weight).sum(),
                                                      weight.sum()]), global_sum).unbind()
    count = count.clamp(min=1.0)
    mean = total / count
    variance = (total_sq / count - mean * mean).clamp(min=0.0)
    return mean, variance, inverse


def reinforce_pp_advantages(rewards: torch.Tensor, *, token_counts: torch.Tensor | None = None, eps: float = 1e-8,
                            global_sum: GlobalSum | None = None) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs", eq. 8-10):

        A_t = (r - mean_tokens(r)) / (std_tokens(r) + eps)

    The outcome reward ``r`` of a completion is its return at each of its tokens (``gamma = 1``), and the
    per-token returns are normalised over every trained token of the global batch (all prompts, all samples,
    all ranks via ``global_sum``), as the paper and its authors' implementation (OpenRLHF) do: a completion of
    ``L`` tokens weighs ``L`` in the mean and the std. ``token_counts`` (shaped like ``rewards``) gives each
    completion's number of trained tokens; the rollout always passes it. Without it every completion weighs
    one (a completion-level normalisation, only for callers that have no lengths). All tokens of a completion
    share one advantage, so the result keeps ``rewards``' shape.

    ``std`` is the population (``N``) standard deviation: it is what the global sums give without a special
    case for ``N = 1``, and over a global batch ``N`` vs ``N - 1`` is immaterial. The paper's per-token KL
    penalty belongs to the reward / loss, not to this normalisation.
    """
    eps = finite_number("advantage_options.eps", eps, low=0.0, low_open=True)
    r = _floating(rewards)
    if token_counts is not None:
        if token_counts.shape != rewards.shape:
            raise ValueError(f"reinforce_pp_advantages: token_counts {tuple(token_counts.shape)} must have the "
                             f"rewards' shape {tuple(rewards.shape)}")
        if bool((token_counts < 0).any()):
            raise ValueError("reinforce_pp_advantages: token_counts must be >= 0")
    mean, variance, inverse = _global_moments(r, token_counts, global_sum)
    advantages = (r.to(torch.float64) * inverse - mean) / (variance.sqrt() + eps * inverse)
    return _like(advantages, rewards)


def whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8,
           global_sum: GlobalSum | None = None) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the positions where ``mask`` is true (PPO's advantage whitening).

    Moments are the population ones, over all ranks when ``global_sum`` is given. ``shift_mean=False``
    adds the mean back (only the scale changes). Positions outside ``mask`` are 0.
    """
    if x.shape != mask.shape:
        raise ValueError(f"whiten: x {tuple(x.shape)} and mask {tuple(mask.shape)} must have the same shape")
    eps = finite_number("whiten: eps", eps, low=0.0, low_open=True)
    mean, variance, inverse = _global_moments(x, mask, global_sum)
    centered = x.to(torch.float64) * inverse - mean
    denominator = variance + eps * inverse * inverse  # (var + eps) over s^2; 0 only if eps * s^-2 underflows
    whitened = centered * torch.rsqrt(denominator) if bool(denominator > 0) else torch.zeros_like(centered)
    if not shift_mean:
        whitened = whitened + mean / inverse
    whitened = torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
    return _like(whitened, x)


# --------------------------------------------------------------------------- PPO


def _check_contiguous(mask: torch.Tensor) -> None:
    if mask.shape[1] == 0:
        return
    starts = (mask[:, 1:] & ~mask[:, :-1]).sum(dim=1) + mask[:, 0].long()
    if bool((starts > 1).any()):
        rows = torch.nonzero(starts > 1).flatten().tolist()
        raise ValueError(f"gae: the mask of rows {rows} has gaps; each row's completion tokens must be contiguous")


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 11-16), right to left over each row:

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}

    with ``V`` and ``A`` after a row's last completion token taken as 0 (the episode ends there). All
    tensors are ``[B, T]``; ``mask`` is true on completion tokens, contiguous in each row (left or right
    padding either side). Returns ``(advantages, returns)``, ``returns = advantages + values``, both 0
    outside ``mask`` (whatever ``token_rewards`` / ``values`` hold there, nan included). Both are float64
    when an input is float64, else float32.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or token_rewards.dim() != 2:
        raise ValueError(f"gae: token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and mask "
                         f"{tuple(mask.shape)} must all be [B, T]")
    valid = mask.bool()
    _check_contiguous(valid)
    dtype = torch.promote_types(_floating(token_rewards).dtype, _floating(values).dtype)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    rewards_ = torch.where(valid, token_rewards.to(dtype), zero)
    values_ = torch.where(valid, values.to(dtype), zero)
    advantages = torch.zeros_like(values_)
    next_value = torch.zeros_like(values_[:, 0])
    next_advantage = torch.zeros_like(values_[:, 0])
    for t in range(values_.shape[1] - 1, -1, -1):
        delta = rewards_[:, t] + gamma * next_value - values_[:, t]
        advantage = torch.where(valid[:, t], delta + gamma * lam * next_advantage, zero)
        advantages[:, t] = advantage
        # outside the mask both stay 0, so the recursion starts afresh at each row's last valid token
        next_value, next_advantage = values_[:, t], advantage
    returns = torch.where(valid, advantages + values_, zero)
    return advantages, returns


# --------------------------------------------------------------------------- DAPO


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``[num_groups]`` bool: False where every reward of the group is equal (DAPO's dynamic sampling,
    Yu et al. 2025, eq. 11, drops those: their group-relative advantages are all 0). A group holding a
    nan is not informative either."""
    r = _as_groups(rewards, "informative_groups")
    return r.amax(dim=1) > r.amin(dim=1)


def soft_overlong_penalty(lengths: torch.Tensor | Sequence[int], *, max_length: int,
                          cache_length: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), with ``L = max_length``, ``C = cache_length``:

        0                  if |y| <= L - C
        ((L - C) - |y|) / C  if L - C < |y| <= L
        -1                 if |y| > L

    a penalty ramping from 0 to -1 over the last ``C`` tokens of the budget, added to the reward.
    """
    if not (0 < cache_length <= max_length):
        raise ConfigError(f"soft_overlong_penalty: need 0 < cache_length <= max_length, got cache_length = "
                          f"{cache_length}, max_length = {max_length}")
    n = torch.as_tensor(lengths)
    n = n.to(torch.float64 if n.dtype == torch.float64 else torch.float32)
    soft_start = max_length - cache_length
    ramp = (soft_start - n) / cache_length
    penalty = torch.where(n <= soft_start, torch.zeros_like(n), ramp)
    return torch.where(n > max_length, torch.full_like(n, -1.0), penalty)


def overlong_mask(finish_reasons: Sequence[str], device: torch.device | str | None = None) -> torch.Tensor:
    """``[N]`` bool, True for completions cut by the length limit (``finish_reason == "length"``, see
    :class:`twinkle_core.sampling.Completion`): DAPO's overlong filtering (Yu et al. 2025, §3.4) masks
    them out of the loss, since a truncated answer's reward says little about its reasoning."""
    return torch.tensor([reason == "length" for reason in finish_reasons], dtype=torch.bool, device=device)


# --------------------------------------------------------------------------- recipe names


def _grpo(rewards: torch.Tensor, global_sum: GlobalSum | None = None,
          token_counts: torch.Tensor | None = None, **options: Any) -> torch.Tensor:
    return grpo_advantages(rewards, **options)  # per group: every group lives whole on one rank


def _dr_grpo(rewards: torch.Tensor, global_sum: GlobalSum | None = None,
             token_counts: torch.Tensor | None = None, **options: Any) -> torch.Tensor:
    if "scale_by_std" in options:
        raise ConfigError("dr_grpo never scales by the std; use 'grpo' with scale_by_std to choose")
    return grpo_advantages(rewards, scale_by_std=False, **options)


def _rloo(rewards: torch.Tensor, global_sum: GlobalSum | None = None,
          token_counts: torch.Tensor | None = None, **options: Any) -> torch.Tensor:
    return rloo_advantages(rewards, **options)


def _reinforce_pp(rewards: torch.Tensor, global_sum: GlobalSum | None = None,
                  token_counts: torch.Tensor | None = None, **options: Any) -> torch.Tensor:
    return reinforce_pp_advantages(rewards, token_counts=token_counts, global_sum=global_sum, **options)


#: a recipe's advantage name -> ``(rewards [num_groups, n], global_sum=None, token_counts=None, **options) ->
#: [num_groups, n]``; ``token_counts`` (each completion's trained tokens) matters to the token-level REINFORCE++
#: only: the group estimators are per sequence, as in their papers
ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
    "reinforce_pp": _reinforce_pp,
}
