"""The ``preference`` task: answer pairs (chosen / rejected) for DPO-family losses.

Rows and their validation: :mod:`twinkle_rl.rows`; tokenised pairs: :mod:`twinkle_rl.pairs`. Batches: :mod:`twinkle_rl.layout` (``2P`` sequences
for ``P`` pairs, pair by pair). A dataset feature is one whole pair, so data-parallel sharding and
batching by feature never split a pair; ``data.batch_size`` counts pairs.

``task_options`` (all optional):

* ``reference``: ``auto`` (default), ``adapter``, ``model``, ``precomputed`` or ``none``: where the reference
  log-probabilities come from (see :mod:`twinkle_rl.reference`);
* ``over_length``: a pair longer than ``max_length``: ``truncate`` (default; the same cuts on both
  sequences: the shared prompt from its start, then both answers from their ends) or ``skip``. A pair whose
  two answers are the same tokens after the cut (they differed only beyond it) teaches nothing: it is
  skipped with a warning and counted with the pairs whose answers are the same text
  (``stats["skipped_identical"]``);
* ``max_length``, ``packing``, ``pad_to_multiple_of``: defaults for the data options of the same name;
* ``adapter_name``: the adapter (tenant) this task trains, for a model with several adapters (a
  ``MultiLoraTransformersModel`` with one task per tenant): the ``adapter`` and ``precomputed`` references
  run that tenant's base model. Default: the model's only adapter.

Data options (``load_dataset`` keyword arguments, the recipe's ``data.*``): ``max_length`` (of each
sequence: prompt + one answer), ``packing`` (every sequence of a batch in one padding-free row of
``position_ids`` resets, so a row holds up to ``2 * batch_size`` sequences), ``over_length``, and
``mode`` (only ``chat``).
"""

from __future__ import annotations

import logging
from typing import Any

from twinkle_core.data.template import Template
from twinkle_core.errors import ConfigError
from twinkle_core.model.train_configs import TrainingSetup
from twinkle_core.task import Task
from twinkle_rl.checks import optional_integer
from twinkle_rl.layout import PREFERENCE_PAIRS
from twinkle_rl.pair_loading import load_pairs, no_chat_template
from twinkle_rl.pairs import (
    OVER_LENGTH,
    PreferenceFeature,
    collate_pairs,
)
from twinkle_rl.precompute import precompute_reference
from twinkle_rl.reference import (
    REFERENCES,
    ReferenceProvider,
    base_logits,
    make_reference,
    reference_logps,
    resolve_auto,
)

logger = logging.getLogger("twinkle.rl")


class PreferenceTask(Task):
    name = "preference"
    default_loss = "dpo"
    model_kind = "causal_lm"
    provides = frozenset({PREFERENCE_PAIRS})
    #: the step line: how often the chosen answer out-scores the rejected one, and by how much (the DPO-family
    #: losses' metrics, :mod:`twinkle_rl.losses.base`)
    console_keys = ("rewards/accuracies", "rewards/margins")

    def __init__(self, *, reference: str = "auto", over_length: str = "truncate", max_length: int | None = None,
                 packing: bool = False, pad_to_multiple_of: int | None = None,
                 adapter_name: str | None = None) -> None:
        if reference not in REFERENCES:
            raise ConfigError(f"task_options.reference must be one of {', '.join(REFERENCES)}, got {reference!r}")
        if over_length not in OVER_LENGTH:
            raise ConfigError(f"task_options.over_length must be one of {', '.join(OVER_LENGTH)}, "
                              f"got {over_length!r}")
        max_length = optional_integer("task_options.max_length", max_length, low=2)
        pad_to_multiple_of = optional_integer("task_options.pad_to_multiple_of", pad_to_multiple_of, low=1)
        super().__init__(reference=reference, over_length=over_length, max_length=max_length, packing=packing,
                         pad_to_multiple_of=pad_to_multiple_of, adapter_name=adapter_name)
        self.reference = reference
        self.adapter_name = adapter_name
        self.provider: ReferenceProvider | None = (None if reference in ("auto", "precomputed")
                                                   else make_reference(reference, adapter_name=adapter_name))
        self.pad_token_id: int | None = None
        self.packing = bool(packing)
        #: counts of the last load_dataset: pairs kept, truncated, skipped for their length, skipped because both
        #: answers are the same (text, or tokens after truncation)
        self.stats: dict[str, int] = {}

    # ------------------------------------------------------------------ data
    def load_dataset(self, path: Any, tokenizer: Any, *, max_length: int | None = None, mode: str | None = None,
                     packing: bool | None = None, over_length: str | None = None) -> list[PreferenceFeature]:
        """Read pairs (a .jsonl/.json/.parquet/.csv file, or a list of dicts) into tokenised pairs."""
        if mode not in (None, "chat"):
            raise ConfigError(f"data.mode: the preference task reads chat pairs (mode: chat), got {mode!r}")
        max_length = max_length if max_length is not None else self.options["max_length"]
        over_length = over_length if over_length is not None else self.options["over_length"]
        # at least 2 tokens: a prompt and an answer
        max_length = optional_integer("data.max_length (the preference task)", max_length, low=2)
        if not getattr(tokenizer, "chat_template", None):
            raise no_chat_template(tokenizer, "preference")
        template = Template(tokenizer, mode="chat")  # no max_length: pairs are cut together below
        self.template = template
        self.pad_token_id = template.pad_token_id
        self.packing = bool(packing if packing is not None else self.options["packing"])

        loaded = load_pairs(path, template, max_length=max_length, over_length=over_length)
        self.stats = loaded.stats
        return loaded.features

    def collate(self, features: list[Any]) -> dict[str, Any]:
        if self.pad_token_id is None:
            raise RuntimeError("PreferenceTask.collate needs the pad token id: call load_dataset first")
        return collate_pairs(features, self.pad_token_id, packing=self.packing,
                             pad_to_multiple_of=self.options["pad_to_multiple_of"])

    def evaluate(self, model: Any, dataset: Any, tokenizer: Any, *, max_new_tokens: int = 32, batch_size: int = 8,
                 limit: int | None = None) -> dict[str, float]:
        """How often greedy generation gives the chosen answer (``preferred_rate``) or the rejected one.

        ``dataset``: the pairs from ``load_dataset`` (the recipe's ``data.eval``). Every rank decodes the
        same prompts; with several processes decoding always takes ``max_new_tokens`` steps."""
        from twinkle_core.distributed import world_size
        from twinkle_core.tasks.causal_lm import greedy_generate

        if dataset is None:
            raise ConfigError("train.evaluate_options: the preference task evaluates on data.eval; set it")
        template = getattr(self, "template", None)
        if template is None or template.tokenizer is not tokenizer:
            template = Template(tokenizer, mode="chat")
        pairs = list(dataset)[: None if limit is None else int(limit)]
        if not pairs:
            return {"preferred_rate": 0.0, "rejected_rate": 0.0, "num_examples": 0}

        def text(ids: Any) -> str:
            return tokenizer.decode(list(ids), skip_special_tokens=True).strip()

        chosen = rejected = 0
        for begin in range(0, len(pairs), batch_size):
            chunk = pairs[begin:begin + batch_size]
            outputs = greedy_generate(model, [p.prompt_ids for p in chunk], max_new_tokens=max_new_tokens,
                                      pad_token_id=template.pad_token_id, early_stop=world_size() <= 1,
                                      stop_token_ids=sorted(template.end_of_turn_ids))
            for pair, generated in zip(chunk, outputs, strict=True):
                answer = text(generated)
                chosen += int(answer == text(pair.chosen_ids))
                rejected += int(answer == text(pair.rejected_ids))
        return {"preferred_rate": chosen / len(pairs), "rejected_rate": rejected / len(pairs),
                "num_examples": len(pairs)}

    # ------------------------------------------------------------------ reference
    def prepare_model(self, model: Any) -> None:
        """Make the reference before training: the frozen copy must hold the initial weights, so it is made
        here, before a resumed run loads its checkpoint."""
        if self.provider is None and self.reference == "auto" and TrainingSetup.of(model).adapters:
            # a script that adds the adapter first: decided now
            self.provider = make_reference("adapter", adapter_name=self.adapter_name)
        if self.provider is not None:
            self.provider.prepare(model)

    def _resolve(self, model: Any) -> ReferenceProvider:
        """``auto``, decided once the adapter and loss are set (``prepare_dataset``, or the first batch)."""
        if self.provider is None:
            if self.reference == "precomputed":
                raise ConfigError("task_options.reference: precomputed: this batch carries no precomputed reference "
                                  "log-probs; call task.prepare_dataset(model, features, split=..., output_dir=...) "
                                  "on the data set before training (twinkle train does)")
            choice = resolve_auto(model)
            step = TrainingSetup.of(model).step
            if choice == "model" and step > 0:
                raise ConfigError(
                    f"task_options.reference is auto and this full fine-tuning run starts at step {step} (resumed): "
                    f"a frozen reference made now would hold trained weights, not the initial ones. Set "
                    f"task_options.reference: model, which copies the weights before the checkpoint is loaded")
            provider = make_reference(choice, adapter_name=self.adapter_name)
            provider.prepare(model)
            logger.info("preference task: reference auto -> %s", choice)
            self.provider = provider
        return self.provider

    def prepare_dataset(self, model: Any, dataset: Any, *, split: str, output_dir: str) -> Any:
        """Decide ``auto`` and make the reference now that the adapter and loss are set and no checkpoint is
        loaded yet; with ``reference: precomputed``, annotate every pair with its reference log-probs."""
        if self.reference == "precomputed":
            import torch

            def reference(batch: dict[str, Any]) -> torch.Tensor:
                with torch.no_grad():
                    return reference_logps(base_logits(model, batch, self.adapter_name), batch)

            return precompute_reference(dataset, model=model, collate=self.collate, reference=reference, split=split,
                                        output_dir=output_dir)
        if split == "train":
            self._resolve(model)
        return dataset

    def prepare_batch(self, model: Any, batch: dict[str, Any]) -> dict[str, Any]:
        """Add the reference log-probabilities ``ref_logps`` [S] unless the batch carries them already."""
        if batch.get("ref_logps") is not None:
            return batch
        ref_logps = self._resolve(model).ref_logps(model, batch)
        return batch if ref_logps is None else {**batch, "ref_logps": ref_logps}


__all__ = ["PreferenceTask"]
