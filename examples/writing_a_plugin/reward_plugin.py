"""A third-party task plugin: a Bradley-Terry reward model trained from preference pairs.

The network is any backend's ``token_value`` kind (one scalar per token, a real value head: the HF backend
builds ``AutoModelForTokenClassification`` with one label); the task reads the score at each sequence's last
real token, and the loss is ``-log sigmoid(score(chosen) - score(rejected))`` summed over pairs. It imports
public names of twinkle-core only, and registers like every other plugin:

    # pyproject.toml of the plugin's distribution
    [project.entry-points.twinkle]
    reward = "reward_plugin"

Then ``twinkle train`` takes ``task: pairwise_reward`` (the loss defaults to ``pairwise_logistic``); a backend that
does not declare the ``token_value`` kind refuses the task before building anything.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from twinkle_core import hookimpl
from twinkle_core.loss.base import Loss, LossOutput
from twinkle_core.records import LossRecord, TaskRecord
from twinkle_core.task import Task


class PairwiseRewardTask(Task):
    """Rows ``{"chosen": text, "rejected": text}`` (or token ids); each batch holds the chosen rows, then the
    rejected ones."""

    name = "pairwise_reward"
    default_loss = "pairwise_logistic"
    model_kind = "token_value"  # a scalar head on every token; the backend builds it

    def load_dataset(self, path, tokenizer, **data_options):
        def ids(value):
            return list(value) if isinstance(value, list) else tokenizer(value)["input_ids"]

        with open(path, encoding="utf-8") as rows:
            return [{"chosen": ids(row["chosen"]), "rejected": ids(row["rejected"])}
                    for row in map(json.loads, rows) if row]

    def collate(self, features):
        sequences = [f["chosen"] for f in features] + [f["rejected"] for f in features]
        width = max(len(s) for s in sequences)
        input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, tokens in enumerate(sequences):
            input_ids[row, : len(tokens)] = torch.tensor(tokens)
            attention_mask[row, : len(tokens)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def process_outputs(self, outputs, inputs):
        values = outputs["logits"].squeeze(-1)  # [rows, T]: the value head's output
        last = inputs["attention_mask"].sum(dim=1) - 1  # right padding: each row's last real token
        scores = values.gather(1, last.unsqueeze(1).to(values.device)).squeeze(1)
        return {**outputs, "scores": scores}

    def evaluate(self, model, dataset, tokenizer, **options):
        batch = self.collate(list(dataset))
        scores = model.forward_only(inputs=batch)["scores"]
        pairs = len(dataset)
        return {"pair_accuracy": float((scores[:pairs] > scores[pairs:]).float().mean())}


class PairwiseLogisticLoss(Loss):
    """``-log sigmoid(s_chosen - s_rejected)``, summed over the pairs of the micro-batch."""

    name = "pairwise_logistic"

    def __call__(self, outputs, inputs, context=None):
        chosen, rejected = outputs["scores"].float().chunk(2)
        margin = chosen - rejected
        return LossOutput(loss=-F.logsigmoid(margin).sum(), num_tokens=margin.numel(),
                          metrics={"pair_accuracy": float((margin > 0).float().mean())})


@hookimpl
def twinkle_register_tasks():
    yield TaskRecord("pairwise_reward", "reward_plugin:PairwiseRewardTask")


@hookimpl
def twinkle_register_losses():
    yield LossRecord("pairwise_logistic", "reward_plugin:PairwiseLogisticLoss")
