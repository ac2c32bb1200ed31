"""The PPO critic: a value head on its own ``TwinkleModel``, a sibling of the policy.

The critic is built with ``model.sibling(task=ValueTask())``: the same model class, source, strategy and
precision as the policy, with a per-token value head (``model_kind = "token_value"``: one output per
token, ``outputs["values"]`` of shape ``[B, T]``). It starts from the policy's source weights, has its own
optimizer and trains with the ``ppo_value`` loss on the same micro-batches as the policy, stepping right
after the policy's optimizer step. Training checkpoints hold it in ``<checkpoint>/critic``.

Alignment: ``values[:, t]`` is read at the positions whose logits predict label ``t + 1`` (the shifted
layout of ``old_logps``), i.e. it is the value of the state *before* the completion token it scores.
"""

from __future__ import annotations

import logging
import os
from typing import Any, ClassVar

import torch

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_core.task import Task

logger = logging.getLogger("twinkle.rl")

CRITIC_DIR = "critic"


class ValueTask(Task):
    """The critic's task: no data of its own (the PPO task feeds it), a scalar head per token."""

    name: ClassVar[str] = "value"
    default_loss: ClassVar[str] = "ppo_value"
    model_kind: ClassVar[str] = "token_value"

    def load_dataset(self, path: str, tokenizer: Any, **data_options: Any) -> Any:
        raise ConfigError("the value task trains a PPO critic on the ppo task's rollouts; it reads no data set")

    def collate(self, features: list[Any]) -> dict[str, Any]:
        raise ConfigError("the value task trains a PPO critic on the ppo task's rollouts; it collates nothing")

    def process_outputs(self, outputs: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
        return {**outputs, "values": outputs["logits"][..., 0]}


class Critic:
    """The critic model, built from the policy, and its training step."""

    def __init__(self, policy: Any, *, lr: float = 1e-4, weight_decay: float = 0.0, max_grad_norm: float | None = 1.0,
                 clip_range_value: float = 0.2, model_id: str | None = None) -> None:
        overrides = {"model_id": model_id} if model_id is not None else {}
        self.model = policy.sibling(task=ValueTask(), **overrides)
        self.model.set_loss("ppo_value", clip_range_value=clip_range_value)
        self.model.set_optimizer("AdamW", lr=lr, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm
        self.pending = 0  # micro-batches back-propagated since the last step

    def values(self, batch: dict[str, Any]) -> torch.Tensor:
        """``[S, T - 1]`` values in the shifted layout, float32 on the CPU."""
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        values = self.model.forward_only(inputs=inputs)["values"]
        return values[:, :-1].detach().float().cpu()

    def train_micro_batch(self, batch: dict[str, Any]) -> None:
        self.model.forward_backward(inputs=batch)
        self.pending += 1

    def step(self) -> None:
        if self.pending:
            self.model.clip_grad_and_step(max_grad_norm=self.max_grad_norm)
            self.pending = 0

    def metrics(self) -> dict[str, float]:
        out = self.model.calculate_metric(reset=True)
        # the policy's line already carries the step; the critic's learning rate is its recipe value
        return {f"critic/{k}": v for k, v in out.items() if k not in ("step", "lr", "tokens")}

    def save(self, directory: str) -> None:
        self.model.save(CRITIC_DIR, output_dir=directory)

    def load(self, directory: str) -> None:
        path = os.path.join(directory, CRITIC_DIR)
        if not os.path.isdir(path):
            raise ConfigError(f"{directory} has no {CRITIC_DIR}/ (the PPO critic): it was not written by a ppo run")
        self.model.resume_from_checkpoint(path)


def generalized_advantages(rewards: torch.Tensor, values: torch.Tensor, labels: torch.Tensor, *, gamma: float,
                           lam: float, gae: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the completion tokens of each row, with the sequence reward on its last token.

    ``rewards`` ``[S]``, ``values`` ``[S, T - 1]`` shifted, ``labels`` ``[S, T]``; returns advantages and
    returns in the shifted layout (zero outside the completion)."""
    mask = (labels[:, 1:] != IGNORE_INDEX).to(values.dtype)
    token_rewards = torch.zeros_like(values)
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=1).values
    rows = torch.nonzero(last >= 0).flatten()
    token_rewards[rows, last[rows]] = rewards[rows].to(values.dtype)
    # a multi-turn agent row has gaps (the environment's untrained tokens between the model's turns): GAE runs over
    # its model tokens as one sequence, moved to the front of the row in order, and the results are moved back
    order = torch.sort((mask == 0).to(torch.int8), dim=1, stable=True).indices
    advantages, returns = gae(token_rewards.gather(1, order), (values * mask).gather(1, order), mask.gather(1, order),
                              gamma=gamma, lam=lam)
    return advantages.new_zeros(advantages.shape).scatter(1, order, advantages), \
        returns.new_zeros(returns.shape).scatter(1, order, returns)
