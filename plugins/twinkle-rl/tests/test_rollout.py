"""One rollout (``RolloutEngine.run``) with a scripted sampler: seeds by coordinates, DAPO's dynamic sampling,
overlong filtering and soft punishment, and a sampler that answers the wrong number of completions."""

from __future__ import annotations

import pytest
import torch
from twinkle_rl.prompts import PromptFeature, collate_prompts
from twinkle_rl.rewards import RewardSet
from twinkle_rl.rollout import RolloutEngine, RolloutStats

from twinkle_core.sampling import Completion, Sampler, SamplingParams, sample_seed

N = 2


class ScriptedSampler(Sampler):
    """Completion ``j`` of prompt ``i`` is ``script(prompt index, j)``; records the seeds it was given."""

    name = "scripted"

    def __init__(self, script, **options):
        super().__init__(**options)
        self.script, self.seeds = script, []

    def sample(self, prompts, *, n, params, seeds):
        self.seeds.append(seeds)
        return [[self.script(p[0], j) for j in range(n)] for p in prompts]


def completion(text: str, length: int, finish: str = "stop") -> Completion:
    return Completion(token_ids=list(range(10, 10 + length)), logprobs=[-0.5] * length, finish_reason=finish,
                      text=text)


def score_text(prompts, completions, **fields):
    return [float(c == "good") for c in completions]


def engine(script, **options) -> tuple[RolloutEngine, ScriptedSampler]:
    sampler = ScriptedSampler(script)
    return RolloutEngine(sampler=sampler, rewards=RewardSet([score_text]), params=SamplingParams(max_new_tokens=4),
                         num_generations=N, estimator="grpo", estimator_options={}, seed=7, pad_token_id=0,
                         **options), sampler


def draws(*batches):
    """``draw()`` giving batches of prompts whose token ids start with their index."""
    queue = [collate_prompts([PromptFeature(index=i, prompt_ids=[i, 1, 2], text=f"p{i}") for i in batch])
             for batch in batches]
    return lambda: queue.pop(0)


def test_completions_are_seeded_by_rollout_draw_prompt_and_index():
    eng, sampler = engine(lambda i, j: completion("good" if j else "bad", 2))
    eng.run(draws([3, 5]), 4, RolloutStats())
    assert sampler.seeds == [[[sample_seed(7, 4, 0, 3, j) for j in range(N)],
                              [sample_seed(7, 4, 0, 5, j) for j in range(N)]]]


def test_dynamic_sampling_draws_more_for_groups_that_teach_nothing():
    # prompts 0 and 1: both answers "good" (no signal); 2 and 3: one good, one bad
    eng, sampler = engine(lambda i, j: completion("good" if i < 2 or j else "bad", 2), dynamic_sampling=True,
                          max_sampling_rounds=3)
    stats = RolloutStats()
    rollout = eng.run(draws([0, 1], [2, 3]), 0, stats)
    assert len(sampler.seeds) == 2  # a second draw was needed, no third
    assert rollout.rewards.tolist() == [[0.0, 1.0], [0.0, 1.0]]
    assert stats.sums["groups_dropped"] == 2
    assert "groups_filled_uninformative" not in stats.sums


def test_dynamic_sampling_fills_with_dropped_groups_after_the_last_round():
    eng, _ = engine(lambda i, j: completion("good", 2), dynamic_sampling=True, max_sampling_rounds=2)
    stats = RolloutStats()
    rollout = eng.run(draws([0, 1], [2, 3]), 0, stats)
    assert rollout.rewards.shape == (2, N)
    assert stats.sums["groups_filled_uninformative"] == 2
    assert torch.equal(rollout.advantages, torch.zeros(2, N, dtype=rollout.advantages.dtype))


def test_overlong_filtering_masks_truncated_completions_out_of_the_loss():
    eng, _ = engine(lambda i, j: completion("good", 4, "length") if j else completion("bad", 2), overlong_filter=True)
    rollout = eng.run(draws([0]), 0, RolloutStats())
    labels = rollout.batch["labels"]
    assert (labels[1] == -100).all()  # the truncated one teaches nothing
    assert (labels[0] != -100).sum() == 2


def test_soft_overlong_punishment_shapes_the_reward():
    # DAPO: no penalty up to max_length - cache_length (2), then linear down to -1 at max_length (4)
    eng, _ = engine(lambda i, j: completion("bad", 2 + 2 * j), overlong_penalty={"max_length": 4, "cache_length": 2})
    rollout = eng.run(draws([0]), 0, RolloutStats())
    assert rollout.rewards.tolist() == [[0.0, -1.0]]


def test_a_sampler_answering_the_wrong_number_is_an_error():
    eng, _ = engine(lambda i, j: completion("good", 1))
    eng.sampler.sample = lambda prompts, **kw: [[completion("good", 1)]] * len(prompts)  # one instead of N
    with pytest.raises(RuntimeError, match="returned"):
        eng.run(draws([0]), 0, RolloutStats())


def test_the_rollout_reduces_over_the_models_data_parallel_view():
    from twinkle_rl.rollout import DataParallel

    from twinkle_core.model.data_parallel import DataParallelView

    class Model:  # what the rollout reads of a model: its data-parallel view (TwinkleModel.data_parallel)
        data_parallel = DataParallelView(rank=1, size=4, group="dp-group")

    dp = DataParallel.of(Model())
    assert dp.view is Model.data_parallel and (dp.view.rank, dp.view.size) == (1, 4)
    # one process: nothing to reduce over, whatever the view says
    value = torch.tensor([2.0], dtype=torch.float64)
    assert dp.sum(value) is value and dp.any(True) and not dp.any(False)
    assert dp.max({"a": 3.0}, ["a", "b"]) == {"a": 3.0, "b": 0.0}
    assert (DataParallel().view.rank, DataParallel().view.size) == (0, 1)


def test_a_group_without_any_score_trains_nothing_and_is_left_out_of_the_advantages(caplog):
    """A reward that gives nan ("no score") for every completion of a prompt: that group's advantages are 0 and
    its labels masked (no policy-gradient nor KL term, not counted in the loss's mean), the estimator normalises
    over the other groups only, and one warning names the reward."""
    import logging
    import math

    def no_score_for_prompt_0(prompts, completions, **fields):
        return [math.nan if p == "p0" else float(c == "good") for p, c in zip(prompts, completions, strict=True)]

    eng = RolloutEngine(sampler=ScriptedSampler(lambda i, j: completion("good" if j else "bad", 2)),
                        rewards=RewardSet([no_score_for_prompt_0, score_text]), params=SamplingParams(max_new_tokens=4),
                        num_generations=N, estimator="reinforce_pp", estimator_options={}, seed=7, pad_token_id=0)
    stats = RolloutStats()
    with caplog.at_level(logging.WARNING, logger="twinkle.rl"):
        rollout = eng.run(draws([0, 1, 2]), 0, stats)
    assert stats.sums["groups_without_score"] == 1
    assert torch.equal(rollout.advantages[0], torch.zeros(N, dtype=rollout.advantages.dtype))
    assert (rollout.batch["labels"][:N] == -100).all() and (rollout.batch["labels"][N:] != -100).any()
    # REINFORCE++ over the two scored groups only: their totals are [0, 2] each (score_text + parity), whitened
    scored = rollout.rewards[1:]
    expected = (scored - scored.mean()) / (scored.std(unbiased=False) + 1e-8)
    torch.testing.assert_close(rollout.advantages[1:], expected)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no_score_for_prompt_0" in warnings[0] and "1 of the 3 prompts" in warnings[0]


def test_reinforce_pp_weighs_each_completion_by_its_trained_tokens():
    """The rollout hands REINFORCE++ each completion's trained tokens: a long answer weighs its length in the
    batch mean and std (Hu et al. 2025), and an overlong-filtered one, which trains nothing, weighs 0."""
    lengths = {(0, 0): 1, (0, 1): 9, (1, 0): 4, (1, 1): 3}
    texts = {(0, 0): "good", (0, 1): "bad", (1, 0): "bad", (1, 1): "bad"}

    def script(i, j):
        return completion(texts[i, j], lengths[i, j], "length" if (i, j) == (1, 0) else "stop")

    for overlong_filter in (False, True):
        eng = RolloutEngine(sampler=ScriptedSampler(script), rewards=RewardSet([score_text]),
                            params=SamplingParams(max_new_tokens=9), num_generations=N, estimator="reinforce_pp",
                            estimator_options={}, seed=7, pad_token_id=0, overlong_filter=overlong_filter)
        rollout = eng.run(draws([0, 1]), 0, RolloutStats())
        r = rollout.rewards.double()
        weights = torch.tensor([[1.0, 9.0], [0.0 if overlong_filter else 4.0, 3.0]], dtype=torch.float64)
        m = (r * weights).sum() / weights.sum()
        std = (((r - m) ** 2 * weights).sum() / weights.sum()).sqrt()
        torch.testing.assert_close(rollout.advantages.double(), (r - m) / (std + 1e-8))
