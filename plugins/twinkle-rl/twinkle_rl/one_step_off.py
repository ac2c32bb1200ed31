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
* dynamic sampling, which needs to draw more prompts mid-rollout, is refused in this mode.

Exact resume. The in-flight rollout was sampled with weights a checkpoint does not hold (those of the step
before), so it cannot be sampled again on resume: the checkpoint stores the rollout itself (its experience
tensors, completions, rewards, advantages, statistics and policy step: :meth:`InflightRollout.state`), and a
resumed run trains on it as the uninterrupted run does. To have it for any checkpoint, also the one an
interrupt writes from the last complete step, the task waits for the in-flight rollout when the trainer takes
its state after each optimizer step (``Task.state_dict``). The sampling still overlaps the step it was
launched in, all of it when each rollout is one optimizer step (``ppo_epochs: 1``, the default split); with
several steps per rollout it overlaps the first of them only. A checkpoint of an older version holds only the
in-flight prompts: they are sampled again with the checkpoint's weights (that one rollout has no lag), with
a warning that this resume is not exact.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_core.prompt_inputs import PromptInputs
from twinkle_core.sampling import Completion
from twinkle_rl.experience import PROMPT_INPUTS
from twinkle_rl.prompts import PromptFeature, collate_prompts
from twinkle_rl.rollout import RewardReport, Rollout, RolloutEngine, RolloutStats


def check_one_step_off(engine: RolloutEngine) -> None:
    refusal = engine.sampler.overlap_refusal()
    if refusal is not None:
        raise ConfigError(f"task_options.one_step_off samples while the policy trains, so {refusal}")
    if engine.dynamic_sampling:
        raise ConfigError("task_options.one_step_off cannot be combined with dynamic_sampling (it would draw more "
                          "prompts from the background thread); turn one of them off")


class InflightRollout:
    """One rollout sampled on a background thread from prompts drawn on the main thread (or restored, already
    sampled, from a checkpoint: :meth:`restored`)."""

    def __init__(self, engine: RolloutEngine, features: list[PromptFeature], rollout: int) -> None:
        self.prompt_index, self.rollout = [f.index for f in features], rollout
        self.stats = RolloutStats()
        self.policy_step = engine.sampler.policy_step
        batch = collate_prompts(list(features))
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twinkle-rollout")
        self._future: Future[Rollout] = self._pool.submit(engine.run, lambda: batch, rollout, self.stats)

    @classmethod
    def restored(cls, state: dict[str, Any]) -> InflightRollout:
        """The rollout a checkpoint stored with :meth:`state`, ready to train on."""
        inflight = cls.__new__(cls)
        inflight.prompt_index, inflight.rollout = list(state["prompt_index"]), int(state["rollout"])
        inflight.policy_step = int(state["policy_step"])
        inflight.stats = RolloutStats(sums=dict(state["stats"]["sums"]), maxima=dict(state["stats"]["maxima"]))
        inflight._pool = None
        inflight._future = Future()
        inflight._future.set_result(rollout_from_state(state["sampled"]))
        return inflight

    def result(self) -> Rollout:
        """Wait for the rollout (its sampling error, if any, is raised here, on the main thread)."""
        try:
            return self._future.result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def wait(self) -> None:
        """Block until the rollout is sampled (its result or error stays for :meth:`result`)."""
        self._future.exception()

    def state(self) -> dict[str, Any]:
        """The rollout as plain tensors, lists and numbers, for a checkpoint (waits until it is sampled)."""
        return {"prompt_index": list(self.prompt_index), "rollout": self.rollout, "policy_step": self.policy_step,
                "stats": {"sums": dict(self.stats.sums), "maxima": dict(self.stats.maxima)},
                "sampled": rollout_state(self.result())}

    def cancel(self) -> None:
        self._future.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


_COMPLETION_FIELDS = ("token_ids", "logprobs", "finish_reason", "policy_step", "text")


def rollout_state(rollout: Rollout) -> dict[str, Any]:
    """A sampled rollout as a checkpoint holds it (a completion's sampler-specific ``extra`` is left out)."""
    batch = dict(rollout.batch)
    if PROMPT_INPUTS in batch:  # plain dicts, which a checkpoint loads with weights_only=True
        batch[PROMPT_INPUTS] = [None if item is None else item.state() for item in batch[PROMPT_INPUTS]]
    return {"batch": batch, "rewards": rollout.rewards, "advantages": rollout.advantages,
            "completions": [{key: getattr(c, key) for key in _COMPLETION_FIELDS} for c in rollout.completions],
            "reward_magnitudes": dict(rollout.report.magnitudes)}


def rollout_from_state(state: dict[str, Any]) -> Rollout:
    """The inverse of :func:`rollout_state`."""
    completions = [Completion(**{key: c[key] for key in _COMPLETION_FIELDS}) for c in state["completions"]]
    batch = dict(state["batch"])
    if PROMPT_INPUTS in batch:
        batch[PROMPT_INPUTS] = [None if item is None else PromptInputs.from_state(item) for item in batch[PROMPT_INPUTS]]
    return Rollout(batch=batch, completions=completions, rewards=state["rewards"],
                   advantages=state["advantages"], report=RewardReport(magnitudes=dict(state["reward_magnitudes"])))


__all__ = ["InflightRollout", "check_one_step_off", "rollout_from_state", "rollout_state"]
