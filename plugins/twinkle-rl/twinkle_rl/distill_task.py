"""The ``gkd`` task: on-policy knowledge distillation from a teacher model (GKD, Agarwal et al. 2024).

The data is SFT data: chat rows whose ``messages`` end with an assistant answer. The prompt is everything
before the last assistant turn (:mod:`twinkle_rl.distill_batches`). For each data batch, as TRL's
``GKDTrainer.training_step`` does:

* with probability ``lmbda`` the completions are sampled from the **student** (the model being trained,
  with the sampler on its current weights): on-policy distillation;
* else, with ``seq_kd``, they are sampled from the **teacher** (sequence-level KD);
* else the data's own answers are used (supervised KD).

Each batch is ``prompt + completion`` token ids with labels on the completion tokens only, and
``teacher_logits`` ``[B, T, V]``: the teacher's forward (no gradient) on the same ids. The ``gkd`` loss (the
default) is the generalised Jensen-Shannon divergence between the student and those logits on the label
positions. The decision of each batch comes from a generator seeded by ``seed`` and the batch's number, so a
run (and every rank of it) makes the same choices, and a resumed run continues them. Held-out batches
(``data.eval``) always use the data's answers: ``eval_loss`` is the divergence to the teacher there, and
``train.evaluate_options`` adds the greedy exact match of the ``causal_lm`` task.

``task_options``:

* ``teacher`` (required): a model id or directory, built as a model of the student's class, strategy and
  precision (``model.sibling``) from that source, then frozen: no optimizer, no gradient. Student and teacher
  must share the tokenizer's vocabulary; a teacher whose vocabulary size differs is refused. A relative
  directory is relative to the working directory (task options are not recipe paths);
* ``lmbda`` (0.5): the on-policy fraction; ``seq_kd`` (false);
* ``max_new_tokens`` (128), ``temperature`` (0.9; 0 is greedy): the sampling of completions (TRL's defaults;
  as in TRL the loss's own ``temperature`` stays 1.0 unless ``loss.options`` set it);
* ``sampler``: ``{"name": "hf_generate", ...options}`` for the student's completions (default: ``hf_generate``
  on the student's own weights); the teacher's always use ``hf_generate`` on the teacher;
* ``seed`` (0); and the data options of the ``causal_lm`` task (``template``, ``truncation`` ...), but only
  ``data.mode: chat`` and no packing.

Memory: the teacher's logits of a micro-batch are kept whole, ``B x T x V`` float32 on the CPU until the loss
moves them to the device (at a vocabulary of 152k, 4 rows of 512 tokens are 1.2 GB). That is fine for the
small vocabularies and micro-batches this task is written for; a large vocabulary wants small micro-batches
(``data.batch_size`` with ``train.gradient_accumulation_steps``).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, ClassVar

import torch

from twinkle_core.errors import ConfigError
from twinkle_core.model.frozen import freeze
from twinkle_core.model.train_configs import TrainingSetup
from twinkle_core.sampling import SamplingParams, sample_seed
from twinkle_core.task import Task
from twinkle_core.tasks.causal_lm import CausalLMTask, last_labelled_span
from twinkle_rl.checks import finite_number, integer
from twinkle_rl.distill_batches import batch_prompts, completion_batch, split_feature

logger = logging.getLogger("twinkle.rl")

#: where a batch's completions come from
SOURCES = ("student", "teacher", "data")
#: the ``causal_lm`` task's data options this task also takes from ``task_options`` (``mode`` must be chat)
DATA_OPTIONS = ("max_length", "mode", "truncation", "template", "columns")
#: the batch key (and ``InputFeature.extra`` key) of each row's index in the training data: seeds its samples
ROW_INDEX = "row_index"


class TeacherTask(Task):
    """The teacher's task: a causal LM whose logits pass through; it reads no data of its own."""

    name: ClassVar[str] = "teacher"
    default_loss: ClassVar[str] = "cross_entropy"
    model_kind: ClassVar[str] = "causal_lm"

    def load_dataset(self, path: str, tokenizer: Any, **data_options: Any) -> Any:
        raise ConfigError("the teacher task only runs the gkd task's teacher forward; it reads no data set")

    def collate(self, features: list[Any]) -> dict[str, Any]:
        raise ConfigError("the teacher task only runs the gkd task's teacher forward; it collates nothing")


def vocabulary_size(model: Any) -> int | None:
    """The vocabulary (logit) size of ``model``'s exported config, or ``None`` when the model has no such config."""
    config = model.export_config()
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return int(size) if size is not None else None


def _logits(outputs: Any) -> torch.Tensor:
    return outputs["logits"] if isinstance(outputs, dict) else outputs.logits


class GKDTask(CausalLMTask):
    name: ClassVar[str] = "gkd"
    default_loss: ClassVar[str] = "gkd"
    provides: ClassVar[frozenset[str]] = frozenset({"teacher_logits"})
    console_keys: ClassVar[tuple[str, ...]] = ("divergence_mean", "on_policy_fraction")

    @classmethod
    def check_recipe(cls, recipe: Any) -> list[str]:
        problems = super().check_recipe(recipe)
        if not recipe.task_options.get("teacher"):
            problems.append("task_options.teacher: the gkd task distils from a teacher model; set it to a model id "
                            "or directory with the student's vocabulary (e.g. a trained causal_lm run's final/)")
        if recipe.data.mode == "pretrain":
            problems.append("data.mode: the gkd task reads chat rows (messages ending with an assistant answer); "
                            "remove data.mode: pretrain")
        if recipe.data.packing:
            problems.append("data.packing: the gkd task makes its own rows of prompt + completion; remove it")
        return problems

    def __init__(self, *, teacher: str | None = None, lmbda: float = 0.5, seq_kd: bool = False,
                 max_new_tokens: int = 128, temperature: float = 0.9, sampler: dict[str, Any] | None = None,
                 seed: int = 0, **options: Any) -> None:
        if not teacher or not isinstance(teacher, str):
            raise ConfigError("task_options.teacher: the gkd task needs a teacher model id or directory (with the "
                              f"student's vocabulary), got {teacher!r}")
        unknown = sorted(set(options) - set(DATA_OPTIONS))
        if unknown:  # the causal_lm task would ignore them: a misspelt lmbda must not train with the default
            raise ConfigError(f"task_options got unknown option(s) {unknown} for the gkd task; known: teacher, lmbda, "
                              f"seq_kd, max_new_tokens, temperature, sampler, seed, {', '.join(DATA_OPTIONS)}")
        super().__init__(**options)
        self.teacher_source = teacher
        self.lmbda = finite_number("task_options.lmbda", lmbda, low=0.0, high=1.0)
        self.seq_kd = bool(seq_kd)
        self.params = SamplingParams(
            temperature=finite_number("task_options.temperature", temperature, low=0.0),
            max_new_tokens=integer("task_options.max_new_tokens", max_new_tokens, low=1))
        self.sampler_spec = dict(sampler or {"name": "hf_generate"})
        self.seed = integer("task_options.seed", seed)
        self.teacher: Any = None
        self.samplers: dict[str, Any] = {}
        self.batches = 0  # data batches trained so far: seeds each batch's choice of completions
        self.counts = {source: 0 for source in SOURCES}
        self.generation_time_s = 0.0

    # ------------------------------------------------------------------ data
    def load_dataset(self, path: Any, tokenizer: Any, *, mode: str | None = None, packing: bool | None = None,
                     streaming: bool | None = None, **data_options: Any) -> list[Any]:
        if mode not in (None, "chat"):
            raise ConfigError(f"data.mode: the gkd task reads chat rows, got mode {mode!r}")
        if packing or streaming:
            raise ConfigError("data.packing / data.streaming: the gkd task makes its own rows of prompt + "
                              "completion; remove them")
        features = [f for f in super().load_dataset(path, tokenizer, mode="chat", **data_options)
                    if last_labelled_span(f.labels) is not None]
        if not features:
            raise ConfigError(f"{path}: no row has an assistant answer left to distil (after data.max_length)")
        for index, feature in enumerate(features):  # seeds the row's sampled completions, wherever it is dealt
            feature.extra[ROW_INDEX] = index
        return features

    def collate(self, features: list[Any]) -> dict[str, Any]:
        prompts, answers = zip(*(split_feature(f) for f in features), strict=True)
        batch = completion_batch(prompts, answers, pad_token_id=self.pad_token_id)
        if all(ROW_INDEX in f.extra for f in features):
            batch[ROW_INDEX] = torch.tensor([f.extra[ROW_INDEX] for f in features], dtype=torch.long)
        return batch

    # ------------------------------------------------------------------ the teacher
    def prepare_model(self, model: Any) -> None:
        self.require_teacher(model)

    def require_teacher(self, model: Any) -> Any:
        """The frozen teacher, built at first use from ``task_options.teacher`` like ``model`` (a sibling)."""
        if self.teacher is None:
            overrides: dict[str, Any] = {"model_id": self.teacher_source}
            if getattr(model, "init_arguments", {}).get("config") is not None:
                # a student built from a config: the teacher's own config.json says what to build
                overrides["config"] = None
            teacher = model.sibling(task=TeacherTask(), **overrides)
            freeze(teacher)  # before its first forward, where the strategy wraps it
            student_vocab, teacher_vocab = vocabulary_size(model), vocabulary_size(teacher)
            if student_vocab is not None and teacher_vocab is not None and student_vocab != teacher_vocab:
                raise ConfigError(f"task_options.teacher {self.teacher_source!r} has a vocabulary of {teacher_vocab} "
                                  f"tokens, the student {student_vocab}: distillation compares their next-token "
                                  f"distributions, so both need the same tokenizer; pick a teacher of the "
                                  f"student's family or a student with the teacher's tokenizer")
            self.teacher = teacher
            logger.info("gkd task: teacher %s (vocabulary %s), lmbda=%s, seq_kd=%s", self.teacher_source,
                        teacher_vocab, self.lmbda, self.seq_kd)
        return self.teacher

    def teacher_logits(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """``[B, T, V]`` float32 on the CPU: the teacher's logits of the batch's ids (no gradient)."""
        teacher = self.require_teacher(model)
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        with torch.no_grad():
            return _logits(teacher.forward_only(inputs=inputs)).detach().float().cpu()

    def prepare_batch(self, model: Any, batch: dict[str, Any]) -> dict[str, Any]:
        if "teacher_logits" in batch:
            return batch
        return {**batch, "teacher_logits": self.teacher_logits(model, batch)}

    # ------------------------------------------------------------------ completions
    def source_of_batch(self, index: int) -> str:
        """Where batch ``index``'s completions come from (TRL: student with probability lmbda, else teacher with
        seq_kd, else data); the same on every rank and in a resumed run."""
        draw = random.Random(sample_seed(self.seed, index)).random()
        if draw < self.lmbda:
            return "student"
        return "teacher" if self.seq_kd else "data"

    def _sampler(self, source: str, model: Any) -> Any:
        if source not in self.samplers:
            from twinkle_core.plugins import get_plugins

            if self.template is None:
                raise ConfigError("the gkd task needs load_dataset(path, tokenizer) before training")
            spec = dict(self.sampler_spec) if source == "student" else {"name": "hf_generate"}
            sampler = get_plugins().load("sampler", spec.pop("name", "hf_generate"))(**spec)
            bound = model if source == "student" else self.require_teacher(model)
            adapters = list(TrainingSetup.of(model).adapters) if source == "student" else []
            if len(adapters) > 1:
                raise ConfigError(f"the gkd task trains one adapter; the model has several {adapters}")
            sampler.bind(bound, self.template.tokenizer, adapter_name=adapters[0] if adapters else None)
            if source == "student":  # a push sampler's copy starts from the current weights
                sampler.sync_weights(model, step=TrainingSetup.of(model).step)
            self.samplers[source] = sampler
        return self.samplers[source]

    def sample_completions(self, source: str, model: Any, prompts: list[list[int]], index: int,
                           rows: list[int] | None = None) -> list[list[int]]:
        """One completion of each prompt from ``source`` (student or teacher), seeded by the batch and the row's
        index in the data set (``rows``; default its place in the batch): a row gets the same completion whichever
        rank it is dealt to and wherever in the batch it lies, so 2 ranks sample what one process does."""
        params = SamplingParams(**{**self.params.__dict__, "stop_token_ids": tuple(sorted(self.template.end_of_turn_ids))})
        rows = list(range(len(prompts))) if rows is None else rows
        # the coordinates of twinkle_core.sampling.sample_seed: (batch, prompt index, sample index 0 of n=1)
        seeds = [[sample_seed(self.seed, index, row, 0)] for row in rows]
        started = time.perf_counter()
        groups = self._sampler(source, model).sample(prompts, n=1, params=params, seeds=seeds)
        self.generation_time_s += time.perf_counter() - started
        return [list(group[0].token_ids) for group in groups]

    def next_training_batch(self, model: Any, draw: Any) -> dict[str, Any]:
        batch, index = draw(), self.batches
        self.batches += 1
        source = self.source_of_batch(index)
        self.counts[source] += 1
        if source != "data":
            prompts, rows = batch_prompts(batch), batch.get(ROW_INDEX)
            rows = None if rows is None else [int(r) for r in rows]
            completions = self.sample_completions(source, model, prompts, index, rows)
            batch = completion_batch(prompts, completions, pad_token_id=self.pad_token_id)
            if rows is not None:
                batch[ROW_INDEX] = torch.tensor(rows, dtype=torch.long)
        return self.prepare_batch(model, batch)

    def after_step(self, model: Any, *, step: int) -> None:
        if "student" in self.samplers:
            self.samplers["student"].sync_weights(model, step=step)

    # ------------------------------------------------------------------ state and logs
    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches = int(state.get("batches", 0))

    def step_metrics(self) -> dict[str, float]:
        total = sum(self.counts.values())
        if not total:
            return {}
        metrics = {"on_policy_fraction": self.counts["student"] / total,
                   "teacher_sampled_fraction": self.counts["teacher"] / total,
                   "generation_time_s": self.generation_time_s}
        self.counts = {source: 0 for source in SOURCES}
        self.generation_time_s = 0.0
        return metrics

    def close(self) -> None:
        for sampler in self.samplers.values():
            sampler.close()
        self.samplers = {}


__all__ = ["DATA_OPTIONS", "ROW_INDEX", "SOURCES", "GKDTask", "TeacherTask", "vocabulary_size"]
