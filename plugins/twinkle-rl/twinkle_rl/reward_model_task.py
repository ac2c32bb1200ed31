"""The ``reward_model`` task: a Bradley–Terry reward model trained on answer pairs (chosen / rejected).

The data is the ``preference`` task's (the same rows, chat template, ``max_length`` cuts and ``over_length``), and so
is the batch layout (:mod:`twinkle_rl.layout`: ``2P`` sequences for ``P`` pairs); the network is a sequence-score
model (``model_kind = "sequence_score"``: a transformers ``AutoModelForSequenceClassification`` with one label on the
HF backend), so the saved model loads in plain transformers and in TRL, and the ``reward_model`` reward
(:mod:`twinkle_rl.model_reward`) scores an online RL run's completions with it. The default loss is
``bradley_terry``; a row's ``margin`` column enters it as in TRL. The held-out evaluation is the loss's own metrics
on ``data.eval`` (``eval_accuracy``: the share of pairs whose chosen answer scores higher, ``eval_margin``).

``task_options``: ``max_length``, ``over_length`` (``truncate`` / ``skip``), ``pad_to_multiple_of`` as for the
``preference`` task. Packing is refused: each sequence's score is read at its row's last token.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

from twinkle_core.data.template import Template
from twinkle_core.errors import ConfigError
from twinkle_core.task import Task
from twinkle_rl.checks import optional_integer
from twinkle_rl.layout import SCORED_PAIRS
from twinkle_rl.pair_loading import load_pairs, no_chat_template
from twinkle_rl.pairs import OVER_LENGTH, PreferenceFeature, collate_pairs

#: the score head's module name in transformers' sequence classifiers of decoder models
SCORE_HEAD = "score"
PACKING_REFUSAL = ("the reward_model task reads each sequence's score at its row's last token, so sequences cannot "
                   "be packed into one row; set data.packing: false")


class RewardModelTask(Task):
    name: ClassVar[str] = "reward_model"
    default_loss: ClassVar[str] = "bradley_terry"
    model_kind: ClassVar[str] = "sequence_score"
    provides: ClassVar[frozenset[str]] = frozenset({SCORED_PAIRS})
    console_keys: ClassVar[tuple[str, ...]] = ("accuracy", "margin")
    curve_keys: ClassVar[tuple[str, ...]] = ("accuracy", "margin")

    def __init__(self, *, over_length: str = "truncate", max_length: int | None = None,
                 pad_to_multiple_of: int | None = None, packing: bool = False) -> None:
        if over_length not in OVER_LENGTH:
            raise ConfigError(f"task_options.over_length must be one of {', '.join(OVER_LENGTH)}, "
                              f"got {over_length!r}")
        if packing:
            raise ConfigError(PACKING_REFUSAL)
        max_length = optional_integer("task_options.max_length", max_length, low=2)
        pad_to_multiple_of = optional_integer("task_options.pad_to_multiple_of", pad_to_multiple_of, low=1)
        super().__init__(over_length=over_length, max_length=max_length, pad_to_multiple_of=pad_to_multiple_of)
        self.pad_token_id: int | None = None
        self.stats: dict[str, int] = {}

    def load_dataset(self, path: Any, tokenizer: Any, *, max_length: int | None = None, mode: str | None = None,
                     packing: bool | None = None, over_length: str | None = None) -> list[PreferenceFeature]:
        """Read pairs (a .jsonl/.json/.parquet/.csv file, or a list of dicts) into tokenised pairs."""
        if mode not in (None, "chat"):
            raise ConfigError(f"data.mode: the reward_model task reads chat pairs (mode: chat), got {mode!r}")
        if packing:
            raise ConfigError(PACKING_REFUSAL)
        if not getattr(tokenizer, "chat_template", None):
            raise no_chat_template(tokenizer, "reward_model")
        max_length = max_length if max_length is not None else self.options["max_length"]
        max_length = optional_integer("data.max_length (the reward_model task)", max_length, low=2)
        template = Template(tokenizer, mode="chat")
        self.pad_token_id = template.pad_token_id
        loaded = load_pairs(path, template, max_length=max_length,
                            over_length=over_length if over_length is not None else self.options["over_length"])
        self.stats = loaded.stats
        return loaded.features

    def adapter_config(self, model: Any, config: Any) -> Any:
        """A LoRA adapter trains the new score head whole (PEFT's ``modules_to_save``) and saves it with the adapter:
        LoRA on a randomly initialised head would leave it random. ``score`` is the head of transformers'
        sequence classifiers of decoder models (Llama, Qwen, Mistral, Gemma, GPT-2 ...)."""
        if isinstance(config, dict):
            return config if config.get("modules_to_save") else {**config, "modules_to_save": [SCORE_HEAD]}
        if hasattr(config, "modules_to_save") and not config.modules_to_save:  # a backend's config (peft.LoraConfig)
            config = copy.copy(config)
            config.modules_to_save = [SCORE_HEAD]
        return config

    def collate(self, features: list[Any]) -> dict[str, Any]:
        if self.pad_token_id is None:
            raise RuntimeError("RewardModelTask.collate needs the pad token id: call load_dataset first")
        batch = collate_pairs(features, self.pad_token_id, pad_to_multiple_of=self.options["pad_to_multiple_of"])
        del batch["labels"]  # a score per sequence: no token is predicted
        return batch


__all__ = ["RewardModelTask"]
