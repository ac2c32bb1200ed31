"""The ``causal_lm`` task: pre-training on text and (multi-turn) SFT on conversations.

Data options (``load_dataset`` keyword arguments; the recipe's ``task_options`` provide defaults):

* ``mode``: ``"chat"`` (default; conversations, assistant turns trained) or ``"pretrain"``
  (``{"text": ...}`` rows, every token trained)
* ``max_length``: truncate samples to this many tokens (and the packing row length)
* ``truncation``: a sample longer than ``max_length`` keeps its start (``"right"``, default), keeps
  its end (``"left"``), or is an error (``"error"``)
* ``packing``: pack several samples per row, padding-free (needs ``max_length``)
* ``pad_to_multiple_of``: pad batch lengths up to a multiple (task option, used by ``collate``)
* ``template``: a built-in chat template name or a Jinja file, instead of the tokenizer's own
  (:mod:`twinkle_core.data.chat_templates`)
* ``columns``: ``{source column: target}`` mapping applied to every source without its own
* ``seed``: the seed of the weighted mixing of several sources (:mod:`twinkle_core.data.mixing`)

``path`` is a data spec (:mod:`twinkle_core.data.mixing`): a file, a data set directory, an
``hf://`` / ``ms://`` data set id, or a list of sources (``{path, weight, columns, split}``), or else
a list of rows.

Batches follow :mod:`twinkle_core.data.collate`: a padded batch has ``attention_mask``; a packed
batch has ``position_ids`` and no ``attention_mask``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any

from twinkle_core.data.collate import collate_causal_lm
from twinkle_core.data.formats import IGNORE_INDEX, InputFeature, RowError, Trajectory, is_conversation_row
from twinkle_core.data.loading import validate_row
from twinkle_core.data.mixing import Record, is_data_spec, load_spec
from twinkle_core.data.packing import pack_features
from twinkle_core.data.template import TRUNCATION_SIDES, Template
from twinkle_core.errors import ConfigError, DataFormatError
from twinkle_core.task import Task

logger = logging.getLogger(__name__)


def greedy_generate(model: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, pad_token_id: int,
                    stop_token_ids: Sequence[int] = (), early_stop: bool = True) -> list[list[int]]:
    """Greedy decoding: with a KV cache through ``model.generation_module()``, or for a model that does not lend
    its network (``ConfigError``: Megatron) without one, through ``model.forward_only``.

    Prompts are left-padded into one batch; the model gets ``input_ids``, ``attention_mask`` and
    ``position_ids`` computed from the mask (so padded rows see the same positions as unpadded
    ones). Returns the generated ids of each prompt, without the stop token. With
    ``early_stop=False`` exactly ``max_new_tokens`` forward calls are made (keeps ranks of a
    distributed model in lock step).
    """
    import torch

    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("cannot generate from an empty prompt")
    stop = set(int(s) for s in stop_token_ids)
    width = max(len(p) for p in prompts)
    batch = len(prompts)
    input_ids = torch.full((batch, width), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        attention_mask[row, width - len(prompt):] = 1
    generated: list[list[int]] = [[] for _ in prompts]
    finished = [False] * batch

    def take(logits: Any) -> Any:
        """Record the greedy token of every row; finished rows get padding."""
        next_tokens = logits[:, -1, :].float().argmax(dim=-1).detach().cpu()
        for row in range(batch):
            if finished[row]:
                next_tokens[row] = int(pad_token_id)
                continue
            token = int(next_tokens[row])
            if token in stop:
                finished[row] = True
            else:
                generated[row].append(token)
        return next_tokens.view(batch, 1).to(torch.long)

    with contextlib.ExitStack() as stack:
        gen = _lent_module(model, stack)
        if gen is not None:  # a KV cache: each new token costs one position, not the whole sequence
            _greedy_with_cache(gen, input_ids, attention_mask, take, max_new_tokens,
                               stop_early=lambda: early_stop and not gen.lockstep and all(finished))
            return generated
    for _ in range(max_new_tokens):  # a model that lends no network (Megatron): recompute the whole sequence
        if early_stop and all(finished):
            break
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        outputs = model.forward_only(inputs={"input_ids": input_ids, "attention_mask": attention_mask,
                                             "position_ids": position_ids})
        next_tokens = take(outputs["logits"] if isinstance(outputs, dict) else outputs.logits)
        input_ids = torch.cat([input_ids, next_tokens], dim=1)
        attention_mask = torch.cat([attention_mask, torch.ones((batch, 1), dtype=torch.long)], dim=1)
    return generated


def _lent_module(model: Any, stack: contextlib.ExitStack) -> Any:
    """``model.generation_module()`` entered on ``stack``, or None for a model that does not lend its network."""
    if not hasattr(model, "generation_module"):
        return None
    try:
        return stack.enter_context(model.generation_module())
    except ConfigError:
        return None


def _greedy_with_cache(gen: Any, input_ids: Any, attention_mask: Any, take: Any, max_new_tokens: int,
                       stop_early: Any) -> None:
    """Prefill the left-padded prompts, then feed one token per forward through the cache; ``take(logits)``
    records and returns the next tokens. Makes exactly ``max_new_tokens`` forwards unless ``stop_early()``."""
    import torch

    from twinkle_core.sampling import forward_keywords

    cache_key, keeps_logits = forward_keywords(gen.module)
    extra = {"logits_to_keep": 1} if keeps_logits else {}
    mask = attention_mask.to(gen.device)
    out = gen.module(input_ids=input_ids.to(gen.device), attention_mask=mask, use_cache=True,
                     position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **extra)
    for step in range(max_new_tokens):
        next_tokens = take(out.logits)
        if step == max_new_tokens - 1 or stop_early():
            return
        cache = getattr(out, cache_key)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = gen.module(input_ids=next_tokens.to(gen.device), attention_mask=mask, use_cache=True,
                         position_ids=mask.sum(-1, keepdim=True) - 1, **{cache_key: cache}, **extra)


def last_labelled_span(labels: Sequence[int]) -> tuple[int, int] | None:
    """``(start, end)`` of the last run of labelled tokens (the last trained answer), or ``None`` when nothing is
    labelled."""
    end = len(labels)
    while end > 0 and labels[end - 1] == IGNORE_INDEX:
        end -= 1
    if end == 0:
        return None
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return start, end


class CausalLMTask(Task):
    name = "causal_lm"
    default_loss = "cross_entropy"
    model_kind = "causal_lm"
    reads_logits = False  # process_outputs passes them through

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.pad_token_id: int | None = None
        self.template: Template | None = None

    @classmethod
    def check_recipe(cls, recipe: Any) -> list[str]:
        """``data.mode`` and the truncation side (``data.options`` or ``task_options``) are ones the template knows."""
        problems = []
        if recipe.data.mode not in (None, "chat", "pretrain"):
            problems.append(f"data.mode: must be 'chat' or 'pretrain', got {recipe.data.mode!r}")
        for where, options in (("data.options", recipe.data.options), ("task_options", recipe.task_options)):
            side = options.get("truncation")
            if side not in (None, *TRUNCATION_SIDES):
                problems.append(f"{where}.truncation: must be one of {', '.join(map(repr, TRUNCATION_SIDES))}, "
                                f"got {side!r}")
        return problems

    def _option(self, value: Any, key: str, default: Any) -> Any:
        return value if value is not None else self.options.get(key, default)

    # ------------------------------------------------------------------ data
    def make_template(self, tokenizer: Any, *, max_length: int | None = None, mode: str | None = None,
                      truncation: str | None = None, template: str | None = None) -> Template:
        return Template(tokenizer, max_length=self._option(max_length, "max_length", None),
                        mode=self._option(mode, "mode", "chat"),
                        truncation=self._option(truncation, "truncation", "right"),
                        chat_template=self._option(template, "template", None))

    def _records(self, path: Any, columns: Any, seed: int | None) -> tuple[str, list[Record]]:
        if is_data_spec(path):
            records = load_spec(path, columns=columns, seed=0 if seed is None else int(seed), validate=validate_row)
            return ", ".join(dict.fromkeys(r.source for r in records)), records
        if isinstance(path, dict):
            raise ConfigError(f"a data source mapping needs 'path' and only path, weight, columns, split; got "
                              f"{', '.join(map(repr, path))}")
        from twinkle_core.data.mixing import map_columns

        records = []
        for i, row in enumerate(path):
            try:
                records.append(Record("<rows>", i + 1, map_columns(row, columns) if columns else row))
            except RowError as exc:
                raise DataFormatError("<rows>", i + 1, str(exc)) from None
        return "<rows>", records

    def load_dataset(self, path: Any, tokenizer: Any, *, max_length: int | None = None, mode: str | None = None,
                     packing: bool | None = None, truncation: str | None = None, template: str | None = None,
                     columns: dict[str, str] | None = None, seed: int | None = None,
                     cache_dir: str | None = None, streaming: bool | None = None,
                     **data_options: Any) -> Any:
        """Read ``path`` (a data spec: a file, directory, data set id or list of sources; or a list of rows)
        into features.

        Bad rows raise :class:`~twinkle_core.errors.DataFormatError` naming the file and line.

        ``cache_dir``: keep the tokenised features there (:mod:`twinkle_core.data.cache`); a later call
        with the same files, tokenizer and options reads them back instead of tokenising (the result is
        then a lazily read sequence). ``streaming`` (``mode="pretrain"`` only): return a
        :class:`~twinkle_core.data.streaming.StreamingPretrainDataset` that reads and packs the text
        lazily into rows of ``max_length`` tokens.
        """
        if data_options:
            raise ConfigError(f"unknown data option(s) for causal_lm: {', '.join(sorted(data_options))}; "
                              "expected max_length, mode, packing, truncation, template, columns, seed, "
                              "cache_dir, streaming")
        packing = bool(self._option(packing, "packing", False))
        template_ = self.make_template(tokenizer, max_length=max_length, mode=mode, truncation=truncation,
                                       template=template)
        if packing and template_.max_length is None:
            raise ConfigError("packing=True needs max_length (the length of a packed row)")
        self.template = template_
        self.pad_token_id = template_.pad_token_id

        self._columns = self._option(columns, "columns", None)
        if streaming:
            from twinkle_core.data.streaming import StreamingPretrainDataset

            if template_.mode != "pretrain":
                raise ConfigError("data.streaming needs data.mode: pretrain (streaming packs plain text)")
            if template_.max_length is None:
                raise ConfigError("data.streaming needs data.max_length (the length of a packed row)")
            return StreamingPretrainDataset(path, template_, columns=self._columns)
        if cache_dir is not None and is_data_spec(path):
            from twinkle_core.data import cache

            source_id = cache.source_fingerprint(path)
            if source_id is not None:
                options = {"mode": template_.mode, "max_length": template_.max_length,
                           "truncation": template_.truncation, "template": self._option(template, "template", None),
                           "end_of_turn": sorted(template_.end_of_turn_ids),
                           "columns": self._columns, "seed": seed, "packing": packing}
                key = cache.fingerprint(source_id, template_.tokenizer, options)
                return cache.cached_features(os.fspath(cache_dir), key,
                                             lambda: self._encode(path, template_, packing, seed),
                                             description=str(path))
        return self._encode(path, template_, packing, seed)

    def _encode(self, path: Any, template_: Template, packing: bool, seed: int | None) -> list[InputFeature]:
        source, records = self._records(path, self._columns, seed)
        features = []
        encoded: dict[int, InputFeature] = {}  # a row repeated by mixing is encoded once
        for record in records:
            key = id(record)
            if key not in encoded:
                try:
                    encoded[key] = template_.encode(record.row)
                except RowError as exc:
                    raise DataFormatError(record.source, record.line, str(exc)) from None
            features.append(encoded[key])
        template = template_
        untrained = sum(1 for f in features if f.num_trained_tokens == 0)
        if features and untrained == len(features) and template.max_length is not None:
            raise DataFormatError(source, None, f"no sample has a trained token left after truncating to "
                                  f"max_length={template.max_length}; raise data.max_length")
        if untrained:
            logger.warning("%s: %d of %d samples have no trained token (truncated by max_length=%s?)",
                           source, untrained, len(features), template.max_length)
        if packing:
            features = pack_features(features, template.max_length)
        return features

    def collate(self, features: list[Any]) -> dict[str, Any]:
        if self.pad_token_id is None:
            raise RuntimeError("CausalLMTask.collate needs the pad token id: call load_dataset first")
        return collate_causal_lm(features, self.pad_token_id,
                                 pad_to_multiple_of=self.options.get("pad_to_multiple_of"))

    # ------------------------------------------------------------------ evaluation
    def _eval_examples(self, dataset: Any, template: Template) -> list[tuple[list[int], str]]:
        tokenizer = template.tokenizer
        if is_data_spec(dataset):
            records = [(r.source, r.line, r.row) for r in load_spec(
                dataset, columns=getattr(self, "_columns", None) or self.options.get("columns"), validate=validate_row)]
        else:
            records = [("<rows>", i + 1, row) for i, row in enumerate(dataset)]
        examples = []
        for source, line, row in records:
            if isinstance(row, InputFeature):
                if row.position_ids is not None:
                    raise ValueError("evaluate needs unpacked samples; load the held-out set with packing=False")
                span = last_labelled_span(row.labels)
                if span is None:
                    continue
                start, end = span
                answer = [t for t in row.input_ids[start:end] if t not in template.end_of_turn_ids]
                examples.append((list(row.input_ids[:start]),
                                 tokenizer.decode(answer, skip_special_tokens=True)))
                continue
            try:
                if isinstance(row, Trajectory):
                    trajectory = row
                elif is_conversation_row(row):
                    trajectory = Trajectory.from_dict(row, require_assistant_last=True)
                else:
                    raise RowError("evaluate needs conversation rows ('messages' or 'conversations') "
                                   "ending with the reference assistant turn")
                if trajectory.messages[-1].role != "assistant":
                    raise RowError("the last message must be the reference assistant turn")
                prompt = template.encode_prompt(trajectory.to_dicts()[:-1], tools=trajectory.extra.get("tools"))
            except RowError as exc:
                raise DataFormatError(source, line, str(exc)) from None
            examples.append((prompt, trajectory.messages[-1].content))
        return examples

    def evaluate(self, model: Any, dataset: Any, tokenizer: Any, **options: Any) -> dict[str, float]:
        """Exact match of greedy generations against the reference (last) assistant turns.

        ``dataset``: a file path, a list of conversation rows / :class:`Trajectory`, or features
        from ``load_dataset`` (prompt = tokens before the last trained span). Options:
        ``max_new_tokens`` (32), ``limit`` (all), ``batch_size`` (8). Every rank evaluates the same
        examples; in a multi-process run decoding always takes ``max_new_tokens`` steps.
        """
        from twinkle_core.distributed import world_size

        unknown = set(options) - {"max_new_tokens", "limit", "batch_size"}
        if unknown:
            raise ConfigError(f"unknown evaluate option(s) for causal_lm: {', '.join(sorted(unknown))}")
        max_new_tokens = int(options.get("max_new_tokens", 32))
        limit = options.get("limit")
        batch_size = int(options.get("batch_size", 8))
        template = self.template
        if template is None or template.tokenizer is not tokenizer or template.mode != "chat":
            template = Template(tokenizer, mode="chat")
        pad = template.pad_token_id
        examples = self._eval_examples(dataset, template)
        if limit is not None:
            examples = examples[: int(limit)]
        if not examples:
            return {"exact_match": 0.0, "num_examples": 0}
        early_stop = world_size() <= 1
        correct = 0
        for begin in range(0, len(examples), batch_size):
            chunk = examples[begin:begin + batch_size]
            outputs = greedy_generate(model, [prompt for prompt, _ in chunk], max_new_tokens=max_new_tokens,
                                      pad_token_id=pad, stop_token_ids=sorted(template.end_of_turn_ids),
                                      early_stop=early_stop)
            for (_, reference), generated in zip(chunk, outputs, strict=True):
                text = tokenizer.decode(generated, skip_special_tokens=True)
                correct += int(text.strip() == reference.strip())
        return {"exact_match": correct / len(examples), "num_examples": len(examples)}


__all__ = ["CausalLMTask", "greedy_generate"]
