"""The ray_pool reward on a real local Ray cluster: scores equal the reward's own; a hung, dying or exiting
reward costs its chunk (nan, with a warning naming it) and the next call is scored normally."""

from __future__ import annotations

import logging
import math
import time

import pytest
from twinkle_ray.reward_pool import RayRewardPool, chunk_bounds

from twinkle_core.errors import ConfigError
from twinkle_core.rewards import load_reward

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
T = "twinkle_ray.testing"
PROMPTS = ["p"] * 5


def test_scores_equal_the_reward_in_process_and_two_workers_share_the_work(ray_cluster):
    completions = ["a", "bb", "ccc", "dddd", "eeeee"]
    pool = load_reward("ray_pool", {"reward": f"{T}:length_reward", "workers": 2})
    assert isinstance(pool, RayRewardPool)
    assert pool(PROMPTS, completions) == load_reward(f"{T}:length_reward")(PROMPTS, completions)
    pids = RayRewardPool(f"{T}:worker_pid", workers=2)(PROMPTS, completions)
    assert len(set(pids)) == 2 and pids[:3] == [pids[0]] * 3  # chunks of 3 and 2


@pytest.mark.parametrize("marker, reward, cause", [("SLOW", "slow_on_marker", "no scores within 3 s"),
                                                   ("DIE", "dies_on_marker", "actor died"),
                                                   ("EXIT", "exits_on_marker", "called sys.exit(3)")])
def test_a_failing_chunk_scores_nan_with_a_warning_and_training_goes_on(ray_cluster, caplog, marker, reward, cause):
    pool = RayRewardPool(f"{T}:{reward}", workers=2, timeout_s=3)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="twinkle.ray"):
        scores = pool(PROMPTS, ["a", "bb", "ccc", "dd" + marker, "e"])
    elapsed = time.monotonic() - start
    assert scores[:3] == [1.0, 2.0, 3.0] and all(math.isnan(s) for s in scores[3:]), scores
    assert elapsed < 30, elapsed
    assert f"reward '{T}:{reward}'" in caplog.text and cause in caplog.text, caplog.text
    assert pool(PROMPTS, ["a", "bb", "ccc", "dd", "e"]) == [1.0, 2.0, 3.0, 2.0, 1.0]  # the pool recovered


def test_bad_options_are_clear_errors():
    with pytest.raises(ConfigError, match="workers must be a positive integer"):
        RayRewardPool("exact_match", workers=0)
    with pytest.raises(ConfigError, match="timeout_s must be a positive number"):
        RayRewardPool("exact_match", timeout_s=float("nan"))


def test_chunks_cover_every_completion_once():
    assert chunk_bounds(5, 2) == [(0, 3), (3, 5)]
    assert chunk_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]
