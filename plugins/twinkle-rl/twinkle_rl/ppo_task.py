"""The ``ppo`` task: online RL with a learned critic and GAE (Schulman et al. 2017; Ouyang et al. 2022).

Everything of the ``grpo`` task (:mod:`twinkle_rl.online_task`: sampler, rewards, rollouts, mini-batches,
reference, logs, resume) with these differences:

* the advantages are per token, from GAE on the critic's values (:mod:`twinkle_rl.critic`), with the
  sequence reward on the last completion token; ``whiten_advantages`` (default true) normalises them over
  the rollout's completion tokens on every rank together;
* the critic trains with the ``ppo_value`` loss on the same micro-batches as the policy and steps after each
  policy step; its loss and clip fraction are logged as ``critic/...``;
* ``num_generations`` defaults to 1 (no groups needed), the loss to ``ppo``.

Extra ``task_options``: ``gamma`` (1.0), ``lam`` (0.95), ``whiten_advantages`` (true), and ``critic``: ``lr``
(1e-4), ``weight_decay`` (0), ``max_grad_norm`` (1.0), ``clip_range_value`` (0.2), ``model_id`` (default:
the policy's source).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_rl.advantages import gae, whiten
from twinkle_rl.checks import finite_number, optional_finite_number
from twinkle_rl.critic import Critic, generalized_advantages
from twinkle_rl.online_task import OnlineRLTask
from twinkle_rl.rollout import Rollout, check_advantages

CRITIC_OPTIONS = ("lr", "weight_decay", "max_grad_norm", "clip_range_value", "model_id")


def _checked_critic_options(options: dict[str, Any]) -> dict[str, Any]:
    """``task_options.critic`` with its numbers checked (``nan`` passes no comparison)."""
    if "lr" in options:
        options["lr"] = finite_number("task_options.critic.lr", options["lr"], low=0.0, low_open=True)
    if "weight_decay" in options:
        options["weight_decay"] = finite_number("task_options.critic.weight_decay", options["weight_decay"], low=0.0)
    if "max_grad_norm" in options:
        options["max_grad_norm"] = optional_finite_number("task_options.critic.max_grad_norm (None: no clipping)",
                                                          options["max_grad_norm"], low=0.0, low_open=True)
    if "clip_range_value" in options:
        options["clip_range_value"] = optional_finite_number(
            "task_options.critic.clip_range_value (None: no clipping)", options["clip_range_value"], low=0.0,
            low_open=True)
    return options


class PPOTask(OnlineRLTask):
    name: ClassVar[str] = "ppo"
    default_loss: ClassVar[str] = "ppo"
    provides: ClassVar[frozenset[str]] = OnlineRLTask.provides | {"old_values", "returns"}
    default_num_generations: ClassVar[int] = 1

    def __init__(self, *, num_generations: int = 1, gamma: float = 1.0, lam: float = 0.95,
                 whiten_advantages: bool = True, critic: dict[str, Any] | None = None, **options: Any) -> None:
        if "advantage" in options:
            raise ConfigError("task_options.advantage: the ppo task's advantages are GAE on its critic's values; "
                              "use task grpo for group-relative estimators")
        super().__init__(num_generations=num_generations, advantage="reinforce_pp", **options)
        self.advantage = None  # the rollout engine leaves advantages to the critic
        unknown = sorted(set(critic or {}) - set(CRITIC_OPTIONS))
        if unknown:
            raise ConfigError(f"task_options.critic got unknown option(s) {unknown}; known: {', '.join(CRITIC_OPTIONS)}")
        self.gamma = finite_number("task_options.gamma", gamma, low=0.0, high=1.0)
        self.lam = finite_number("task_options.lam", lam, low=0.0, high=1.0)
        self.whiten_advantages = bool(whiten_advantages)
        self.critic_options = _checked_critic_options(dict(critic or {}))
        self.critic: Critic | None = None

    def prepare_model(self, model: Any) -> None:
        # before a resumed run loads its checkpoint (the critic's own state comes with it, load_training_state)
        if self.critic is None:
            self.critic = Critic(model, **self.critic_options)

    def _require_critic(self) -> Critic:
        if self.critic is None:
            raise ConfigError("the ppo task's critic is built by task.prepare_model(model) before training "
                              "(twinkle train calls it; a script must too)")
        return self.critic

    def _after_rollout(self, model: Any, rollout: Rollout, chunk_size: int) -> None:
        critic = self._require_critic()
        batch = rollout.batch
        size = batch["input_ids"].shape[0]
        values = torch.cat([critic.values({k: batch[k][i:i + chunk_size] for k in ("input_ids", "attention_mask")})
                            for i in range(0, size, chunk_size)])
        rewards = rollout.rewards.reshape(-1).to(torch.float32)
        check_advantages(rewards, rollout.report, "rewards", hint="")  # GAE reads them in float32
        advantages, returns = generalized_advantages(rewards, values, batch["labels"], gamma=self.gamma,
                                                     lam=self.lam, gae=gae)
        mask = batch["labels"][:, 1:] != IGNORE_INDEX
        if self.whiten_advantages:
            advantages = whiten(advantages, mask, global_sum=self._engine(model).dp.sum)
        batch["advantages"] = torch.where(mask, advantages, torch.zeros_like(advantages)).float()
        batch["returns"] = returns.float()
        batch["old_values"] = values
        check_advantages(batch["advantages"], rollout.report, "GAE advantages", hint="")
        check_advantages(batch["returns"], rollout.report, "GAE returns", hint="")

    def next_training_batch(self, model: Any, draw: Any) -> dict[str, Any]:
        batch = super().next_training_batch(model, draw)
        critic_inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels", "returns", "old_values")}
        self._require_critic().train_micro_batch(critic_inputs)
        return batch

    def after_step(self, model: Any, *, step: int) -> None:
        self._require_critic().step()
        super().after_step(model, step=step)

    def step_metrics(self) -> dict[str, float]:
        return {**super().step_metrics(), **self._require_critic().metrics()}

    def save_training_state(self, model: Any, directory: str) -> None:
        self._require_critic().save(directory)

    def load_training_state(self, model: Any, directory: str) -> None:
        self._require_critic().load(directory)
