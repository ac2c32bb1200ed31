"""The advantage estimators against naive references written from the papers' formulas.

References loop in Python over floats (double precision) and share nothing with the implementation.
float64 inputs must agree to ~1e-12 relative; float32 inputs to a few float32 ulps of the values' magnitude.
"""

from __future__ import annotations

import math

import pytest
import torch
from twinkle_rl.advantages import (
    ESTIMATORS,
    gae,
    grpo_advantages,
    informative_groups,
    overlong_mask,
    reinforce_pp_advantages,
    rloo_advantages,
    soft_overlong_penalty,
    whiten,
)

from twinkle_core.errors import ConfigError

F32_ULP = torch.finfo(torch.float32).eps


def random_rewards(groups=5, n=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(groups, n, generator=g, dtype=torch.float64) * 3 + 1).to(dtype)


def assert_matches(actual: torch.Tensor, expected: list, dtype: torch.dtype):
    expected_t = torch.tensor(expected, dtype=torch.float64)
    assert actual.dtype == dtype
    if dtype == torch.float64:
        torch.testing.assert_close(actual, expected_t, rtol=1e-12, atol=1e-12)
    else:
        scale = max(1.0, float(expected_t.abs().max()))
        torch.testing.assert_close(actual.double(), expected_t, rtol=0, atol=8 * F32_ULP * scale)


# --------------------------------------------------------------------------- references


def mean(xs):
    return sum(xs) / len(xs)


def ref_grpo(rows, scale_by_std=True, eps=1e-4):
    """DeepSeekMath eq. (outcome supervision): A_i = (r_i - mean(r)) / std(r), std the sample std."""
    out = []
    for row in rows:
        m = mean(row)
        std = math.sqrt(sum((x - m) ** 2 for x in row) / (len(row) - 1))
        out.append([(x - m) / (std + eps) if scale_by_std else x - m for x in row])
    return out


def ref_rloo(rows):
    """Ahmadian et al. 2024: A_i = r_i - 1/(k-1) sum_{j != i} r_j."""
    out = []
    for row in rows:
        k = len(row)
        out.append([row[i] - sum(row[j] for j in range(k) if j != i) / (k - 1) for i in range(k)])
    return out


def ref_reinforce_pp(rows, eps=1e-8):
    """Hu 2025: normalise by the global batch mean and (population) std."""
    flat = [x for row in rows for x in row]
    m = mean(flat)
    std = math.sqrt(sum((x - m) ** 2 for x in flat) / len(flat))
    return [[(x - m) / (std + eps) for x in row] for row in rows]


def ref_gae(rewards, values, mask, gamma, lam):
    """Schulman et al. 2016, backward: delta_t = r_t + g V_{t+1} - V_t, A_t = delta_t + g l A_{t+1}."""
    advantages, returns = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        steps = [t for t, m in enumerate(m_row) if m]
        a_row = [0.0] * len(m_row)
        next_v, next_a = 0.0, 0.0
        for t in reversed(steps):
            delta = r_row[t] + gamma * next_v - v_row[t]
            a_row[t] = delta + gamma * lam * next_a
            next_v, next_a = v_row[t], a_row[t]
        advantages.append(a_row)
        returns.append([a_row[t] + v_row[t] if m_row[t] else 0.0 for t in range(len(m_row))])
    return advantages, returns


def ref_overlong(length, max_length, cache):
    """DAPO eq. 13."""
    if length <= max_length - cache:
        return 0.0
    if length <= max_length:
        return ((max_length - cache) - length) / cache
    return -1.0


# --------------------------------------------------------------------------- group estimators


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_matches_reference(dtype, scale_by_std):
    r = random_rewards(dtype=dtype)
    expected = ref_grpo(r.double().tolist(), scale_by_std=scale_by_std)
    assert_matches(grpo_advantages(r, scale_by_std=scale_by_std), expected, dtype)


def test_grpo_equal_rewards_give_zero_and_dr_grpo_is_unscaled():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    a = grpo_advantages(r)
    assert torch.equal(a[0], torch.zeros(3, dtype=torch.float64))
    assert_matches(ESTIMATORS["dr_grpo"](r), ref_grpo(r.tolist(), scale_by_std=False), torch.float64)
    assert_matches(ESTIMATORS["grpo"](r, eps=0.5), ref_grpo(r.tolist(), eps=0.5), torch.float64)


def test_grpo_needs_two_samples_for_std():
    with pytest.raises(ConfigError, match="n >= 2"):
        grpo_advantages(torch.ones(3, 1))
    assert torch.equal(grpo_advantages(torch.ones(3, 1), scale_by_std=False), torch.zeros(3, 1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rloo_matches_reference(dtype):
    r = random_rewards(groups=3, n=5, dtype=dtype)
    assert_matches(rloo_advantages(r), ref_rloo(r.double().tolist()), dtype)
    assert_matches(ESTIMATORS["rloo"](r), ref_rloo(r.double().tolist()), dtype)


def test_rloo_needs_two_samples():
    with pytest.raises(ConfigError, match="n >= 2"):
        rloo_advantages(torch.ones(2, 1))


def test_group_estimators_reject_flat_rewards():
    with pytest.raises(ValueError, match=r"\[num_groups, n\]"):
        grpo_advantages(torch.ones(4))


def test_integer_rewards_become_float32():
    assert grpo_advantages(torch.tensor([[0, 1], [1, 1]])).dtype == torch.float32


# --------------------------------------------------------------------------- REINFORCE++


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reinforce_pp_matches_reference(dtype):
    r = random_rewards(groups=4, n=3, dtype=dtype)
    assert_matches(reinforce_pp_advantages(r), ref_reinforce_pp(r.double().tolist()), dtype)


def on_two_ranks(estimate, shards):
    """Run ``estimate(shard, global_sum)`` as two ranks would: each rank's local sums are all-reduced (added)."""
    local = []
    for shard in shards:  # first pass: what each rank hands to the all-reduce
        estimate(shard, lambda t: local.append(t.clone()) or t)
    assert all(t.dtype == torch.float64 for t in local)
    reduced = local[0] + local[1]

    def all_reduce(rank):
        def global_sum(t):
            assert torch.equal(t, local[rank])
            return reduced
        return global_sum

    return [estimate(shard, all_reduce(rank)) for rank, shard in enumerate(shards)]


def test_reinforce_pp_two_ranks_equal_one_process():
    r = random_rewards(groups=6, n=4, seed=3)
    shards = (r[:2], r[2:])  # unequal shares: ranks need not hold the same number of groups
    per_rank = on_two_ranks(lambda x, gs: reinforce_pp_advantages(x, global_sum=gs), shards)
    torch.testing.assert_close(torch.cat(per_rank), reinforce_pp_advantages(r), rtol=1e-12, atol=1e-12)
    per_rank = on_two_ranks(lambda x, gs: ESTIMATORS["reinforce_pp"](x, global_sum=gs), shards)
    torch.testing.assert_close(torch.cat(per_rank), reinforce_pp_advantages(r), rtol=1e-12, atol=1e-12)


def test_reinforce_pp_constant_batch_is_zero():
    assert torch.equal(reinforce_pp_advantages(torch.full((2, 3), 0.7)), torch.zeros(2, 3))


# --------------------------------------------------------------------------- GAE and whitening


def gae_batch(dtype):
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(4, 7, generator=g, dtype=torch.float64).to(dtype)
    values = torch.randn(4, 7, generator=g, dtype=torch.float64).to(dtype)
    mask = torch.zeros(4, 7, dtype=torch.bool)
    mask[0, 2:7] = True  # prompt first, completion to the end
    mask[1, 3:5] = True  # right padding after the completion
    mask[2, 0:7] = True
    mask[3, 6] = True  # a one-token completion
    return rewards, values, mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.7), (1.0, 1.0)])
def test_gae_matches_backward_recursion(dtype, gamma, lam):
    rewards, values, mask = gae_batch(dtype)
    advantages, returns = gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref_a, ref_r = ref_gae(rewards.double().tolist(), values.double().tolist(), mask.tolist(), gamma, lam)
    assert_matches(advantages, ref_a, dtype)
    assert_matches(returns, ref_r, dtype)


def test_gae_ignores_garbage_outside_the_mask():
    rewards, values, mask = gae_batch(torch.float64)
    dirty_r, dirty_v = rewards.clone(), values.clone()
    dirty_r[~mask], dirty_v[~mask] = float("nan"), 1e9
    clean, dirty = gae(rewards, values, mask), gae(dirty_r, dirty_v, mask)
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
        assert torch.equal(b[~mask], torch.zeros_like(b[~mask]))


def test_gae_rejects_gaps_and_shape_mismatch():
    mask = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]])
    with pytest.raises(ValueError, match=r"rows \[0\]"):
        gae(torch.zeros(2, 4), torch.zeros(2, 4), mask)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        gae(torch.zeros(2, 4), torch.zeros(2, 3), mask)


def test_whiten_matches_masked_reference():
    x = random_rewards(groups=3, n=6, seed=5)
    mask = torch.rand(3, 6, generator=torch.Generator().manual_seed(2)) > 0.3
    picked = x[mask].tolist()
    m = mean(picked)
    var = sum((v - m) ** 2 for v in picked) / len(picked)
    expected = [[(x[i, j].item() - m) / math.sqrt(var + 1e-8) if mask[i, j] else 0.0 for j in range(6)]
                for i in range(3)]
    assert_matches(whiten(x, mask), expected, torch.float64)
    kept_mean = [[v + m if mask[i][j] else 0.0 for j, v in enumerate(row)] for i, row in enumerate(expected)]
    assert_matches(whiten(x, mask, shift_mean=False), kept_mean, torch.float64)


def test_whiten_two_ranks_equal_one_process():
    x = random_rewards(groups=4, n=6, seed=6)
    mask = torch.rand(4, 6, generator=torch.Generator().manual_seed(4)) > 0.4
    shards = ((x[:1], mask[:1]), (x[1:], mask[1:]))
    per_rank = on_two_ranks(lambda shard, gs: whiten(*shard, global_sum=gs), shards)
    torch.testing.assert_close(torch.cat(per_rank), whiten(x, mask), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- DAPO


def test_informative_groups():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, float("nan"), 0.5]])
    assert informative_groups(r).tolist() == [False, True, False, False]


@pytest.mark.parametrize("max_length,cache", [(20, 4), (10, 10)])
def test_soft_overlong_penalty_matches_dapo(max_length, cache):
    lengths = list(range(0, max_length + 5))
    penalty = soft_overlong_penalty(torch.tensor(lengths), max_length=max_length, cache_length=cache)
    expected = [ref_overlong(n, max_length, cache) for n in lengths]
    assert penalty.dtype == torch.float32
    torch.testing.assert_close(penalty.double(), torch.tensor(expected, dtype=torch.float64),
                               rtol=0, atol=4 * F32_ULP)
    assert soft_overlong_penalty([16, 21], max_length=20, cache_length=4).tolist() == [0.0, -1.0]


def test_soft_overlong_penalty_rejects_bad_cache():
    with pytest.raises(ConfigError, match="cache_length"):
        soft_overlong_penalty([1], max_length=10, cache_length=11)


def test_overlong_mask():
    assert overlong_mask(["stop", "length", "stop"]).tolist() == [False, True, False]
    assert overlong_mask([]).shape == (0,)


# --------------------------------------------------------------------------- overflow


def textbook_grpo(r: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """The formula as it was computed before the power-of-two scaling (float64)."""
    centered = r - r.mean(dim=1, keepdim=True)
    return centered / (r.std(dim=1, keepdim=True) + eps)


def test_power_of_two_scaling_changes_no_bit_of_ordinary_advantages():
    r = random_rewards(groups=8, n=6, seed=5) * 1000
    assert torch.equal(grpo_advantages(r), textbook_grpo(r))
    assert torch.equal(ESTIMATORS["dr_grpo"](r), r - r.mean(dim=1, keepdim=True))
    x = random_rewards(groups=3, n=4, seed=6)
    count = float(x.numel())
    mean = x.sum() / count  # the moments as the estimator always summed them: [sum x, sum x^2, count]
    std = ((x * x).sum() / count - mean * mean).clamp(min=0.0).sqrt()
    assert torch.equal(reinforce_pp_advantages(x), (x - mean) / (std + 1e-8))


@pytest.mark.parametrize("magnitude", [1e308, 1e200, 1e150])
def test_group_std_of_huge_rewards_is_scale_free(magnitude):
    """std([1e308, -1e308, ...]) overflows float64 (and every advantage of the group came out 0); the estimators
    are scale-invariant, so the advantages of r * c are those of r (with eps / c)."""
    unit = torch.tensor([[1.0, -1.0, 1.0, 0.0], [0.5, 0.25, -1.0, 1.0]], dtype=torch.float64)
    huge = unit * magnitude
    if magnitude == 1e308:
        # what the old formula gave: nothing to learn from (nan, or every advantage 0)
        assert torch.equal(textbook_grpo(huge).nan_to_num(), torch.zeros_like(huge))
    torch.testing.assert_close(grpo_advantages(huge), grpo_advantages(unit, eps=1e-4 / magnitude),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reinforce_pp_advantages(huge), reinforce_pp_advantages(unit, eps=1e-8 / magnitude),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rloo_advantages(huge) / magnitude, rloo_advantages(unit), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ESTIMATORS["dr_grpo"](huge) / magnitude, ESTIMATORS["dr_grpo"](unit),
                               rtol=1e-12, atol=1e-12)


def in_lockstep(estimate, shards):
    """Run ``estimate(shard, global_sum)`` on one thread per rank, every ``global_sum`` an all-reduce over them
    (as many as the estimator makes, in step)."""
    import threading

    barrier = threading.Barrier(len(shards))
    slots: list = [None] * len(shards)
    results: list = [None] * len(shards)
    errors: list = []

    def rank(index):
        def global_sum(t):
            slots[index] = t.clone()
            barrier.wait()
            total = sum(slots[1:], slots[0])
            barrier.wait()  # everyone has read the slots before the next reduction writes them
            return total

        try:
            results[index] = estimate(shards[index], global_sum)
        except Exception as exc:  # re-raised below, on the test's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(shards))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def test_reinforce_pp_and_whiten_on_huge_values_agree_over_two_ranks():
    """Moments of values beyond ~1e154 overflow; the ranks then agree on one power-of-two scale (a second
    all-reduce) and get the advantages one process gets."""
    r = random_rewards(groups=6, n=4, seed=3) * 1e306
    per_rank = in_lockstep(lambda x, gs: reinforce_pp_advantages(x, global_sum=gs), (r[:2], r[2:]))
    whole = reinforce_pp_advantages(r)
    assert torch.isfinite(whole).all()
    torch.testing.assert_close(torch.cat(per_rank), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(whole, reinforce_pp_advantages(r / 1e306, eps=1e-8 / 1e306), rtol=1e-9, atol=1e-9)
    x = random_rewards(groups=4, n=5, seed=4) * 1e200
    mask = torch.rand(4, 5, generator=torch.Generator().manual_seed(0)) > 0.3
    per_rank = in_lockstep(lambda shard, gs: whiten(*shard, global_sum=gs), ((x[:1], mask[:1]), (x[1:], mask[1:])))
    torch.testing.assert_close(torch.cat(per_rank), whiten(x, mask), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(whiten(x, mask), whiten(x / 1e200, mask, eps=1e-300), rtol=1e-9, atol=1e-9)


def test_non_finite_estimator_options_are_refused():
    with pytest.raises(ConfigError, match=r"advantage_options.eps must be a finite number > 0, got nan"):
        grpo_advantages(random_rewards(), eps=float("nan"))
    with pytest.raises(ConfigError, match=r"eps must be a finite number > 0"):
        reinforce_pp_advantages(random_rewards(), eps=float("inf"))
    with pytest.raises(ConfigError, match=r"whiten: eps"):
        whiten(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool), eps=-1.0)


# --------------------------------------------------------------------------- REINFORCE++ over tokens


def ref_reinforce_pp_tokens(rows, counts, eps=1e-8):
    """Hu et al. 2025, eq. 8-10 with an outcome reward: every trained token of a completion has the return r;
    the per-token returns are whitened over all tokens of the batch (population std)."""
    tokens = [x for row, row_counts in zip(rows, counts) for x, k in zip(row, row_counts) for _ in range(int(k))]
    m = mean(tokens)
    std = math.sqrt(sum((x - m) ** 2 for x in tokens) / len(tokens))
    return [[(x - m) / (std + eps) for x in row] for row in rows]


def random_counts(groups, n, seed=0, low=1, high=40):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (groups, n), generator=g).to(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reinforce_pp_normalises_over_tokens_not_completions(dtype):
    r = random_rewards(groups=17, n=4, dtype=dtype, seed=5)
    counts = random_counts(17, 4, seed=5)
    token_level = reinforce_pp_advantages(r, token_counts=counts)
    assert_matches(token_level, ref_reinforce_pp_tokens(r.double().tolist(), counts.tolist()), dtype)
    # with lengths 1-40 the completion-level normalisation is a different estimator (the bug)
    assert float((token_level - reinforce_pp_advantages(r)).abs().max()) > 0.05
    # equal lengths: both normalisations agree
    torch.testing.assert_close(reinforce_pp_advantages(r, token_counts=torch.full_like(counts, 7.0)),
                               reinforce_pp_advantages(r))


def test_reinforce_pp_over_tokens_two_ranks_equal_one_process():
    r, counts = random_rewards(groups=6, n=4, seed=3), random_counts(6, 4, seed=3)
    shards = ((r[:2], counts[:2]), (r[2:], counts[2:]))
    per_rank = on_two_ranks(lambda x, gs: ESTIMATORS["reinforce_pp"](x[0], global_sum=gs, token_counts=x[1]),
                            shards)
    torch.testing.assert_close(torch.cat(per_rank), reinforce_pp_advantages(r, token_counts=counts),
                               rtol=1e-12, atol=1e-12)


def test_reinforce_pp_token_counts_are_checked():
    r = random_rewards(groups=2, n=3)
    with pytest.raises(ValueError, match="shape"):
        reinforce_pp_advantages(r, token_counts=torch.ones(3, 2))
    with pytest.raises(ValueError, match=">= 0"):
        reinforce_pp_advantages(r, token_counts=-torch.ones(2, 3))
