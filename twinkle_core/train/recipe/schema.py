"""The recipe schema: one dataclass per section, with its defaults, plus the tables derived from it.

The ``#:`` comments document each key for recipe authors. A field whose metadata has ``path`` is resolved
against the recipe file's directory (``"always"``: even when nothing exists there yet).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from twinkle_core.model.spec import RECIPE_KEYS as SPEC_RECIPE_KEYS

_PATH = {"path": True}
_PATH_ALWAYS = {"path": "always"}


@dataclass
class ModelConfig:
    #: registered model class (``twinkle plugins`` lists them)
    class_name: str = "TransformersModel"
    #: where the weights come from: a local directory, ``hf://org/name`` or ``ms://org/name``
    model_id: str | None = field(default=None, metadata=_PATH)
    #: revision (branch, tag or commit) of a hub model; also ``hf://org/name@revision``
    revision: str | None = None
    #: a transformers config (must contain ``model_type``) to build a randomly initialised model
    config: dict[str, Any] | None = None
    #: tokenizer location (default: ``model_id``)
    tokenizer: str | None = field(default=None, metadata=_PATH)
    #: allow the model repository to run its own code; ``null`` defers to TWINKLE_TRUST_REMOTE_CODE (off)
    trust_remote_code: bool | None = None
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    #: a trainable adapter (e.g. ``{type: lora, r: 8, alpha: 16, target_modules: [q_proj, v_proj]}``)
    adapter: dict[str, Any] | None = None
    #: passed through to the model class as keyword arguments
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class StrategyConfig:
    #: ``null``: :func:`twinkle_core.mesh.default_strategy` decides (``single`` for one process,
    #: ``accelerate`` for more, the model class's own strategy where it has one)
    name: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    #: a file, a data set directory, ``hf://org/name``, or a list of sources (strings or
    #: ``{path, weight, columns, split}``) concatenated, or mixed by weight (``twinkle_core.data.mixing``)
    train: str | list[Any] | None = field(default=None, metadata=_PATH)
    eval: str | list[Any] | None = field(default=None, metadata=_PATH)
    #: ``{source column: target}`` for every source without its own ``columns``
    columns: dict[str, str] | None = None
    #: a chat template: a built-in name (``twinkle_core.data.chat_templates``) or a Jinja file
    template: str | None = field(default=None, metadata=_PATH)
    max_length: int | None = None
    #: ``chat`` (messages, loss on the assistant turns) or ``pretrain`` (plain text)
    mode: str | None = None
    packing: bool | None = None
    #: micro-batch size per data-parallel rank
    batch_size: int = 1
    shuffle: bool = True
    #: shuffling seed (default: ``train.seed``)
    seed: int | None = None
    #: where tokenised data is cached for restarts and other ranks (default ``train.output_dir/data_cache``;
    #: ``false`` disables the cache), for tasks whose ``load_dataset`` takes ``cache_dir``
    cache_dir: str | bool | None = None
    #: ``pretrain`` mode only: read and pack the text lazily into rows of ``max_length`` (needs ``train.max_steps``)
    streaming: bool = False
    #: further keyword arguments for ``task.load_dataset``
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class LossConfig:
    #: registered loss (default: the task's ``default_loss``)
    name: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimizerConfig:
    name: str = "AdamW"
    lr: float = 1e-4
    weight_decay: float = 0.0
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class LRSchedulerConfig:
    name: str = "cosine"
    warmup_steps: int | None = None
    warmup_ratio: float | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainConfig:
    output_dir: str = field(default="outputs", metadata=_PATH_ALWAYS)
    #: optimizer steps; default ``num_epochs`` passes over the training data
    max_steps: int | None = None
    num_epochs: int = 1
    gradient_accumulation_steps: int = 1
    #: ``null`` disables clipping
    max_grad_norm: float | None = 1.0
    seed: int = 42
    log_every: int = 1
    eval_every: int | None = None
    save_every: int | None = None
    #: keep at most this many ``checkpoint-N`` directories (oldest are removed)
    save_total_limit: int | None = None
    eval_before_training: bool = False
    #: ``null``: evaluation is the loss on ``data.eval``; a mapping (even ``{}``) also runs
    #: ``task.evaluate(model, eval_dataset, tokenizer, **evaluate_options)`` and logs its metrics
    evaluate_options: dict[str, Any] | None = None
    #: a checkpoint directory, or ``latest`` (the newest under ``output_dir``); ``twinkle train --resume``
    resume: str | None = None
    #: experiment trackers besides ``logs.jsonl`` (always written): a name or a list (``[tensorboard, wandb]``;
    #: ``twinkle plugins`` lists them); ``null``: TensorBoard when installed; ``[]`` or ``none``: JSONL only
    report_to: list[str] | str | None = None
    #: options per tracker: ``{wandb: {project: my-project, mode: offline}}``
    tracker_options: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Recipe:
    task: str = "causal_lm"
    task_options: dict[str, Any] = field(default_factory=dict)
    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    #: DeviceMesh sizes (``{dp: 2, tp: 2}``); default: the strategy decides
    mesh: dict[str, int] | None = None
    #: ``no``, ``bf16``, ``fp16`` or ``fp8`` (or a plugin's precision)
    precision: str = "no"
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


#: names other frameworks use, so a misplaced key gets a useful suggestion (``lr`` -> ``optimizer.lr``)
ALIASES = {
    "learning_rate": "optimizer.lr",
    "lr": "optimizer.lr",
    "weight_decay": "optimizer.weight_decay",
    "optim": "optimizer.name",
    "per_device_train_batch_size": "data.batch_size",
    "micro_batch_size": "data.batch_size",
    "batch_size": "data.batch_size",
    "max_seq_length": "data.max_length",
    "max_length": "data.max_length",
    "seq_length": "data.max_length",
    "num_train_epochs": "train.num_epochs",
    "epochs": "train.num_epochs",
    "warmup_steps": "lr_scheduler.warmup_steps",
    "warmup_ratio": "lr_scheduler.warmup_ratio",
    "lr_scheduler_type": "lr_scheduler.name",
    "scheduler": "lr_scheduler",
    "gradient_accumulation": "train.gradient_accumulation_steps",
    "logging_steps": "train.log_every",
    "eval_steps": "train.eval_every",
    "save_steps": "train.save_every",
    "model_name_or_path": "model.model_id",
    "model_name": "model.model_id",
    "lora": "model.adapter",
    "peft": "model.adapter",
    "bf16": "precision",
    "fp16": "precision",
    "mixed_precision": "precision",
    "dataset": "data.train",
    "train_file": "data.train",
    "eval_file": "data.eval",
    "resume_from_checkpoint": "train.resume",
    "report_to": "train.report_to",
}

#: keyword arguments the training loop passes to every model class (the fields of
#: :class:`twinkle_core.model.spec.ModelSpec`), with the recipe key each comes from: ``model.options`` may not set them
CONSTRUCTOR_KEYS_FROM = dict(SPEC_RECIPE_KEYS)
CONSTRUCTOR_KEYS = frozenset(CONSTRUCTOR_KEYS_FROM)

#: the top-level sections of a recipe
RECIPE_KEYS = tuple(f.name for f in dataclasses.fields(Recipe))
