"""One-step-off rollouts: the next rollout is sampled in the background while the current one trains.

With ``task_options.one_step_off: true`` the task keeps one rollout in flight. When it starts training on
rollout ``r`` it has already launched rollout ``r + 1``, which a background thread samples with the
weights the sampler was last given; when the queue of ``r`` runs out, it waits for ``r + 1``, pushes the
current weights to the sampler and launches ``r + 2``. So every rollout is sampled by the policy as it
was one rollout earlier, and the log-probs the loss uses as ``old_logps`` are the sampler's own: the
importance ratio corrects for exactly that lag (logged as ``policy_lag``, in optimizer steps).

Only the sampling and scoring run in the background; prompts are drawn, weights pushed and the critic
or the reference run on the main thread. Hence the rules:

* the sampler must hold its own copy of the weights (``weight_sync: push``, e.g. ``hf_generate`` with
  ``copy_weights: true``), so that training never changes the weights it is decoding with, and it must
  not decode in lockstep (no collectives off the main thread);
* dynamic sampling, which needs to draw more prompts mid-rollout, is refused in this mode;
* a checkpoint stores the in-flight rollout's prompts; a resumed run samples them again with the
  checkpoint's weights (that one rollout has no lag), everything else continues exactly.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_rl.prompts import PromptFeature, collate_prompts
from twinkle_rl.rollout import Rollout, RolloutEngine, RolloutStats


def check_one_step_off(engine: RolloutEngine) -> None:
    if engine.sampler.weight_sync != "push":
        raise ConfigError("task_options.one_step_off samples while the policy trains, so the sampler needs its own "
                          "copy of the weights: set task_options.sampler.copy_weights: true (hf_generate) or use a "
                          "sampler with weight_sync 'push'")
    if engine.dynamic_sampling:
        raise ConfigError("task_options.one_step_off cannot be combined with dynamic_sampling (it would draw more "
                          "prompts from the background thread); turn one of them off")


class InflightRollout:
    """One rollout sampled on a background thread from prompts drawn on the main thread."""

    def __init__(self, engine: RolloutEngine, features: list[PromptFeature], rollout: int) -> None:
        self.features, self.rollout = list(features), rollout
        self.stats = RolloutStats()
        self.policy_step = engine.sampler.policy_step
        batch = collate_prompts(self.features)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twinkle-rollout")
        self._future: Future[Rollout] = self._pool.submit(engine.run, lambda: batch, rollout, self.stats)

    def result(self) -> Rollout:
        """Wait for the rollout (its sampling error, if any, is raised here, on the main thread)."""
        try:
            return self._future.result()
        finally:
            self._pool.shutdown(wait=True)

    def wait(self) -> None:
        """Block until the rollout is sampled (its result or error stays for :meth:`result`)."""
        self._future.exception()

    def state(self) -> dict[str, Any]:
        return {"prompt_index": [f.index for f in self.features], "rollout": self.rollout}

    def cancel(self) -> None:
        self._future.cancel()
        self._pool.shutdown(wait=True)
