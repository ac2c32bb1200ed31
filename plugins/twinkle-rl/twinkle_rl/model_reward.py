"""The ``reward_model`` reward: scores completions with a trained reward model (a sequence-score network, e.g. the
output of ``twinkle train`` with ``task: reward_model``, or any transformers ``AutoModelForSequenceClassification``
with one label).

Each completion is scored as the reward model was trained on answers: the prompt as the online task rendered it
(chat template with the generation prompt), then the completion followed by what the chat template writes after an
assistant turn's content (``<|im_end|>\\n`` for ChatML), tokenised prompt and answer separately as the training pairs
are. The score is the network's output at the sequence's last token, in batches of ``batch_size``.

Recipe::

    rewards:
      - name: reward_model
        options: {path: outputs/rm/final}
"""

from __future__ import annotations

import os
from typing import Any

import torch

from twinkle_core.errors import ConfigError
from twinkle_core.rewards import Reward

_MARKER = "\x00twinkle-answer\x00"


def model_directory(path: str) -> str:
    """A model directory: ``path`` itself, or the ``final`` model of a ``twinkle train`` output directory; ``hf://``
    and ``ms://`` ids are resolved to their local copy."""
    from twinkle_core.sources.resolve import resolve_model

    path = os.fspath(path)
    final = os.path.join(path, "final")
    if not os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(final, "config.json")):
        path = final
    return resolve_model(path)


def answer_suffix(tokenizer: Any) -> str:
    """What the chat template writes after an assistant turn's content (its end of turn), '' without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"},
                                          {"role": "assistant", "content": _MARKER}], tokenize=False)
    return text.split(_MARKER, 1)[1] if _MARKER in text else ""


class RewardModelScore(Reward):
    """The score of a trained reward model."""

    name = "reward_model"

    def __init__(self, path: str, batch_size: int = 16, device: str | None = None,
                 trust_remote_code: bool | None = None) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from twinkle_core.sources import resolve

        directory = model_directory(path)
        remote = resolve.trust_remote_code(trust_remote_code)  # explicit: never a question on stdin
        self.tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=remote)
        self.model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32,
                                                                        trust_remote_code=remote)
        if self.model.config.num_labels != 1:
            raise ConfigError(f"rewards: reward_model: {path!r} is a classifier with {self.model.config.num_labels} "
                              f"labels; a reward model has one (a score)")
        self.pad_token_id = self.model.config.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
                else self.tokenizer.eos_token_id
        self.model.config.pad_token_id = self.pad_token_id
        self.model.to(device or "cpu").eval()
        self.batch_size = int(batch_size)
        self.suffix = answer_suffix(self.tokenizer)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], **fields: list[Any]) -> list[float]:
        sequences = [self._ids(p) + self._ids(c + self.suffix) for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        device = next(self.model.parameters()).device
        for begin in range(0, len(sequences), self.batch_size):
            chunk = sequences[begin:begin + self.batch_size]
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, sequence in enumerate(chunk):
                ids[row, :len(sequence)] = torch.tensor(sequence, dtype=torch.long)
                mask[row, :len(sequence)] = 1
            logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            scores.extend(float(v) for v in logits[:, 0].float().cpu())
        return scores
