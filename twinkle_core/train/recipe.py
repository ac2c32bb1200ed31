"""Training recipes: a YAML file of nested sections, validated strictly before anything is built.

A recipe names the task, the model and how to train it::

    task: causal_lm
    model:
      class_name: TransformersModel
      model_id: hf://Qwen/Qwen2.5-0.5B
      adapter: {type: lora, r: 8, alpha: 16, target_modules: all-linear}
    strategy: {name: ddp}
    precision: bf16
    data: {train: data/train.jsonl, eval: data/eval.jsonl, max_length: 1024, batch_size: 4}
    optimizer: {name: AdamW, lr: 1.0e-4}
    lr_scheduler: {name: cosine, warmup_ratio: 0.05}
    train: {output_dir: runs/qwen-lora, num_epochs: 1, gradient_accumulation_steps: 4}

Every key is checked: an unknown key or a value of the wrong type is a :class:`ConfigError`
naming the full key path (``train.max_step: unknown key; did you mean train.max_steps?``).
``load_recipe(path, ["optimizer.lr=3e-4", "train.max_steps=10"])`` applies overrides whose values
are parsed as YAML.

Paths (``model.model_id``, ``model.tokenizer``, ``data.train``, ``data.eval``, ``train.output_dir``)
written in a recipe file are relative to that file; paths given as overrides on the command line
are relative to the working directory. URIs with a scheme (``hf://``, ``ms://``) are left alone.

This module imports neither torch nor any backend, so ``twinkle train`` validates a recipe
before it launches anything. :func:`validate_components` then imports the components the recipe
names and checks its free-form ``options`` against their signatures (:mod:`twinkle_core.options`)
and the model / strategy / mesh combination (:mod:`twinkle_core.capabilities`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twinkle_core.data.template import TRUNCATION_SIDES
from twinkle_core.errors import ConfigError, PluginNotFoundError
from twinkle_core.mesh import (
    SPEC_KEYS,
    DeviceMesh,
    default_strategy,
    merge_spec_sizes,
    pop_spec_sizes,
    suggest_spec_key,
)
from twinkle_core.optim import check_optimizer_options
from twinkle_core.options import check_options

__all__ = [
    "DataConfig",
    "LossConfig",
    "LRSchedulerConfig",
    "ModelConfig",
    "OptimizerConfig",
    "Recipe",
    "StrategyConfig",
    "TrainConfig",
    "apply_overrides",
    "load_recipe",
    "parse_override",
    "recipe_from_dict",
    "recipe_to_dict",
    "strategy_name",
    "validate_components",
    "validate_plugin_names",
]

_PATH = {"path": True}
_PATH_ALWAYS = {"path": "always"}


# ---------------------------------------------------------------------- schema
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


# Names other frameworks use, so a misplaced key gets a useful suggestion.
_ALIASES = {
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

# keyword arguments the training loop passes to every model class (see twinkle_core.train.loop)
_CONSTRUCTOR_KEYS_FROM = {
    "model_id": "model.model_id", "config": "model.config", "strategy": "strategy.name",
    "strategy_options": "strategy.options", "mesh": "mesh", "precision": "precision", "task": "task",
    "tokenizer": "model.tokenizer", "trust_remote_code": "model.trust_remote_code",
    "attn_implementation": "model.attn_implementation", "gradient_checkpointing": "model.gradient_checkpointing",
    "seed": "train.seed",
}
_CONSTRUCTOR_KEYS = set(_CONSTRUCTOR_KEYS_FROM)

_MESH_KEYS = tuple(DeviceMesh.__dataclass_fields__)  # the mesh declares its dimensions once
_RECIPE_KEYS = tuple(f.name for f in dataclasses.fields(Recipe))


# ---------------------------------------------------------------------- generic validation
_UNIONS = (typing.Union, types.UnionType)


class _Errors(list):
    def add(self, path: str, message: str) -> None:
        self.append(f"{path}: {message}" if path else message)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _all_paths(cls: type, prefix: str = "") -> list[str]:
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = _join(prefix, f.name)
        out.append(path)
        tp = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            out.extend(_all_paths(tp, path))
    return out


def _suggest(prefix: str, key: str, siblings: list[str]) -> str:
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if close:
        return _join(prefix, close[0])
    alias = _ALIASES.get(key) or next(iter(
        _ALIASES[k] for k in difflib.get_close_matches(key, list(_ALIASES), n=1, cutoff=0.8)), None)
    if alias:
        return alias
    everything = _all_paths(Recipe)
    leaves = {p.rsplit(".", 1)[-1]: p for p in everything}
    close = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.75)
    return leaves[close[0]] if close else ""


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in _UNIONS:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in _UNIONS:
        args = typing.get_args(tp)
        parts = [_describe(a) for a in args if a is not type(None)]
        text = " or ".join(parts)
        return f"{text} or null" if type(None) in args else text
    if dataclasses.is_dataclass(tp) or tp is dict or origin is dict:
        return "a mapping"
    if tp is list or origin is list:
        return "a list"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(tp, str(tp))


def _got(value: Any) -> str:
    name = {str: "string", int: "integer", float: "number", bool: "boolean", list: "list", dict: "mapping",
            type(None): "null"}.get(type(value), type(value).__name__)
    text = repr(value)
    return f"{name} {text if len(text) <= 60 else text[:57] + '...'}"


_MISMATCH = object()  # what a scalar converter returns for a value of the wrong type


def _to_bool(value: Any) -> Any:
    return value if isinstance(value, bool) else _MISMATCH


def _to_int(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return int(value) if isinstance(value, float) and value.is_integer() else _MISMATCH


def _to_float(value: Any) -> Any:
    if isinstance(value, bool):
        return _MISMATCH
    try:  # strings too: YAML 1.1 reads 1e-4 (no dot) as a string
        return float(value) if isinstance(value, (int, float, str)) else _MISMATCH
    except ValueError:
        return _MISMATCH


def _to_str(value: Any) -> Any:
    return value if isinstance(value, str) else _MISMATCH


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def _convert_scalar(value: Any, tp: type, path: str, errors: _Errors) -> Any:
    converted = _SCALARS[tp](value)
    if converted is _MISMATCH:
        quote = " (quote it in YAML)" if tp is str else ""
        errors.add(path, f"expected {_describe(tp)}, got {_got(value)}{quote}")
        return value
    if tp is float and not math.isfinite(converted):  # .nan / .inf train a model into NaN
        errors.add(path, f"must be a finite number, got {converted!r}")
        return value
    return converted


def _convert_union(value: Any, tp: Any, path: str, errors: _Errors) -> Any:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    choices = [a for a in args if a is not type(None)]
    for choice in choices:
        trial = _Errors()
        result = _convert(value, choice, path, trial)
        if not trial:
            return result
    if len(choices) == 1 and not (len(trial) == 1 and trial[0].startswith(f"{path}: expected ")):
        errors.extend(trial)  # the value has the right type; its own items are wrong
    else:
        errors.add(path, f"expected {_describe(tp)}, got {_got(value)}")
    return value


def _convert_mapping(value: Any, tp: Any, path: str, errors: _Errors) -> Any:
    if not isinstance(value, dict):
        errors.add(path, f"expected a mapping, got {_got(value)}")
        return value
    key_tp, value_tp = typing.get_args(tp) or (str, Any)
    out = {}
    for key, item in value.items():
        if key_tp is str and not isinstance(key, str):
            errors.add(_join(path, str(key)), f"keys must be strings, got {_got(key)}")
            continue
        out[key] = _convert(item, value_tp, _join(path, str(key)), errors)
    return out


def _convert_list(value: Any, tp: Any, path: str, errors: _Errors) -> Any:
    if not isinstance(value, (list, tuple)):
        errors.add(path, f"expected a list, got {_got(value)}")
        return value
    (item_tp,) = typing.get_args(tp) or (Any,)
    return [_convert(item, item_tp, f"{path}[{i}]", errors) for i, item in enumerate(value)]


_CONTAINERS = {dict: _convert_mapping, list: _convert_list}


def _convert(value: Any, tp: Any, path: str, errors: _Errors) -> Any:
    """``value`` as the schema type ``tp``; a mismatch is added to ``errors`` (the value is then returned as is)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in _UNIONS:
        return _convert_union(value, tp, path, errors)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, errors)
    if tp in _SCALARS:
        return _convert_scalar(value, tp, path, errors)
    if (origin or tp) in _CONTAINERS:
        return _CONTAINERS[origin or tp](value, tp, path, errors)
    raise TypeError(f"recipe schema uses an unsupported type {tp!r} at {path}")


def _build(cls: type, raw: Any, path: str, errors: _Errors) -> Any:
    if raw is None:
        raw = {}
    if isinstance(raw, str) and "name" in {f.name for f in dataclasses.fields(cls)}:
        raw = {"name": raw}  # the shorthand ``strategy: ddp`` (or ``strategy=accelerate`` on the command line)
    if not isinstance(raw, dict):
        errors.add(path, f"expected a mapping, got {_got(raw)}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in hints:
            key_text = str(key)
            suggestion = _suggest(path, key_text, names)
            hint = f"did you mean {suggestion}?" if suggestion else f"known keys: {', '.join(names)}"
            errors.add(_join(path, key_text), f"unknown key; {hint}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in raw:
            kwargs[f.name] = _convert(raw[f.name], hints[f.name], _join(path, f.name), errors)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # only reachable through a schema bug
        errors.add(path, str(exc))
        return cls()


# ---------------------------------------------------------------------- semantic checks
def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_Rule = tuple[str, Callable[[Any, "Recipe"], bool], str]


def _positive(path: str, *, zero: bool = False) -> _Rule:
    """A rule: the number at ``path``, when set, is > 0 (>= 0 with ``zero``)."""
    return (path, lambda value, recipe: _is_number(value) and (value < 0 or (value == 0 and not zero)),
            f"must be {'>= 0' if zero else '> 0'}, got {{value!r}}")


# (key path, wrong(value at the path, recipe), message; ``{value}`` is the value at the path). They run
# on a recipe whose types are already right.
_RULES: list[_Rule] = [
    ("task", lambda task, r: not task, "must name a task (e.g. causal_lm)"),
    ("model.class_name", lambda name, r: not name, "must not be empty"),
    ("model", lambda m, r: m.model_id is None and m.config is None,
     "set model.model_id (a path, hf://org/name or ms://org/name) or model.config (a transformers config with "
     "model_type)"),
    ("model.config", lambda config, r: config is not None and r.model.model_id is None and "model_type" not in config,
     "must contain model_type (e.g. model_type: qwen2) to build a model from it"),
    ("model.tokenizer", lambda tokenizer, r: tokenizer is None and r.model.model_id is None,
     "is required when the model is built from model.config"),
    ("data.train", lambda train, r: train is None, "is required (the training data file)"),
    _positive("data.batch_size"),
    ("data.max_length", lambda n, r: n is not None and n < 2,
     "must be at least 2 to hold a prompt and an answer, got {value!r}"),
    ("data.mode", lambda mode, r: r.task == "causal_lm" and mode not in (None, "chat", "pretrain"),
     "must be 'chat' or 'pretrain', got {value!r}"),
    *((f"{where}.truncation", lambda side, r: r.task == "causal_lm" and side not in (None, *TRUNCATION_SIDES),
       f"must be one of {', '.join(map(repr, TRUNCATION_SIDES))}, got {{value!r}}")
      for where in ("data.options", "task_options")),
    _positive("optimizer.lr"),
    _positive("optimizer.weight_decay", zero=True),
    _positive("lr_scheduler.warmup_steps", zero=True),
    ("lr_scheduler.warmup_ratio", lambda ratio, r: ratio is not None and not 0.0 <= ratio < 1.0,
     "must be in [0, 1), got {value!r}"),
    ("lr_scheduler", lambda s, r: s.warmup_steps is not None and s.warmup_ratio is not None,
     "set warmup_steps or warmup_ratio, not both"),
    *(_positive(f"train.{key}") for key in ("max_steps", "num_epochs", "gradient_accumulation_steps", "max_grad_norm",
                                             "log_every", "eval_every", "save_every", "save_total_limit")),
    ("train.output_dir", lambda output_dir, r: not output_dir, "must not be empty"),
    ("train.eval_every", lambda every, r: every is not None and r.data.eval is None and r.train.evaluate_options is None,
     "is set but there is nothing to evaluate: set data.eval"),
]


def _step(node: Any, key: str) -> Any:
    return node.get(key) if isinstance(node, dict) else getattr(node, key)


def _at(recipe: Recipe, path: str) -> Any:
    """The value at ``path``; a key missing from an ``options`` mapping is ``None``."""
    return functools.reduce(_step, path.split("."), recipe)


def _fold_spec_sizes(raw: dict[str, Any], errors: _Errors) -> None:
    """The spec's size keys (``tp_size: 2`` at the top level or in ``mesh``; ``tp_size=2`` on the command line)
    become mesh dimensions (``mesh: {tp: 2}``), in place; a contradiction with ``mesh`` is an error."""
    for key in [k for k in raw if k not in _RECIPE_KEYS and k not in SPEC_KEYS and suggest_spec_key(k)]:
        errors.add(str(key), f"unknown key; did you mean {suggest_spec_key(key)}?")
        raw.pop(key)
    try:
        sizes, flag = pop_spec_sizes(raw)
        mesh = raw.get("mesh")
        if isinstance(mesh, dict):
            mesh = dict(mesh)
            inner, inner_flag = pop_spec_sizes(mesh, where="mesh.")
            flag = inner_flag if flag is None else flag
            mesh = merge_spec_sizes(mesh, inner, where="mesh.")
        if flag:
            raise ConfigError("sequence_parallel: true is not a size; give the number of ranks each sequence is "
                              "split over (sequence_parallel: 2 is mesh.sp: 2); Megatron's sequence parallelism "
                              "inside tensor-parallel regions is strategy.options.sequence_parallel: true")
        if sizes or mesh is not raw.get("mesh"):
            if mesh is not None and not isinstance(mesh, dict):
                return  # _build reports the wrong type of mesh
            raw["mesh"] = merge_spec_sizes(mesh, sizes)
    except ConfigError as exc:
        errors.add("", str(exc))


def _check_mesh(mesh: dict[str, int] | None, errors: _Errors) -> None:
    unknown = [key for key in mesh or () if key not in _MESH_KEYS]
    for key in unknown:
        close = difflib.get_close_matches(str(key), [*_MESH_KEYS, *SPEC_KEYS], n=1)
        hint = f"did you mean mesh.{close[0]}?" if close else f"known: {', '.join(_MESH_KEYS)}"
        errors.add(f"mesh.{key}", f"unknown mesh dimension; {hint}")
    if mesh and not unknown:
        try:
            DeviceMesh(**mesh)
        except ConfigError as exc:
            errors.add("", str(exc))


def _check(recipe: Recipe, errors: _Errors) -> None:
    for path, wrong, message in _RULES:
        value = _at(recipe, path)
        if wrong(value, recipe):
            errors.add(path, message.format(value=value))
    for key in sorted(set(recipe.model.options) & _CONSTRUCTOR_KEYS):
        errors.add(f"model.options.{key}", f"is set by the recipe itself; use {_CONSTRUCTOR_KEYS_FROM[key]} instead")
    for key in sorted(set(recipe.model.options) & set(SPEC_KEYS)):
        errors.add(f"model.options.{key}", f"is a mesh size; write {key} at the top level (or mesh.{SPEC_KEYS[key]})")
    _check_mesh(recipe.mesh, errors)


# ---------------------------------------------------------------------- paths and overrides
def _resolve_paths(raw: dict[str, Any], base_dir: Path, cls: type = Recipe) -> None:
    """Make the recipe file's relative paths relative to the file (in place, before validation)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value = raw.get(f.name)
        tp = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            _resolve_paths(value, base_dir, tp)
        elif f.metadata.get("path") and isinstance(value, str):
            raw[f.name] = _resolve_path(value, base_dir, f.metadata["path"] == "always")
        elif f.metadata.get("path") and isinstance(value, list):  # data sources: strings or {path: ...}
            for i, item in enumerate(value):
                if isinstance(item, str):
                    value[i] = _resolve_path(item, base_dir, False)
                elif isinstance(item, dict) and isinstance(item.get("path"), str):
                    item["path"] = _resolve_path(item["path"], base_dir, False)


def _resolve_path(value: str, base_dir: Path, always: bool) -> str:
    if not value or "://" in value:
        return value
    expanded = Path(value).expanduser()
    if expanded.is_absolute():
        return str(expanded)
    candidate = base_dir / expanded
    explicit = value.startswith(("./", "../", ".\\", "..\\"))
    if always or explicit or candidate.exists():
        return os.path.normpath(str(candidate))
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optimizer.lr=3e-4"`` -> ``(["optimizer", "lr"], "3e-4")``; the value is parsed as YAML."""
    import yaml

    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} must look like key.path=value (e.g. train.max_steps=10)")
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"override {text!r}: malformed key path {key!r}")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({exc})") from None
    return parts, parsed


def apply_overrides(raw: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    for text in overrides or ():
        parts, value = parse_override(text)
        node = raw
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"override {text!r}: {where} is {_got(child)}, not a mapping")
            node = child
        node[parts[-1]] = value
    return raw


# ---------------------------------------------------------------------- entry points
def recipe_from_dict(raw: dict[str, Any] | None, overrides: list[str] | None = None, *,
                     base_dir: str | os.PathLike[str] | None = None) -> Recipe:
    """Validate a plain mapping (paths relative to ``base_dir`` when given) into a :class:`Recipe`."""
    import copy

    raw = copy.deepcopy(raw) if raw is not None else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"a recipe must be a mapping of sections, got {_got(raw)}")
    if base_dir is not None:
        _resolve_paths(raw, Path(base_dir))
    apply_overrides(raw, overrides)
    errors = _Errors()
    _fold_spec_sizes(raw, errors)
    recipe = _build(Recipe, raw, "", errors)
    if not errors:
        _check(recipe, errors)
    if errors:
        raise ConfigError("invalid recipe:\n  " + "\n  ".join(errors) if len(errors) > 1 else errors[0])
    return recipe


def load_recipe(path: str | os.PathLike[str], overrides: list[str] | None = None) -> Recipe:
    """Read, resolve and validate a YAML recipe; ``overrides`` are ``"a.b=value"`` strings."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"recipe {str(path)!r} does not exist" if not file.exists()
                          else f"recipe {str(path)!r} is not a file")
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{file}:{mark.line + 1}" if mark is not None else str(file)
        raise ConfigError(f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: a recipe must be a mapping of sections, got {_got(raw)}")
    try:
        return recipe_from_dict(raw, overrides, base_dir=file.resolve().parent)
    except ConfigError as exc:
        raise ConfigError(f"{file}: {exc}") from None


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    return dataclasses.asdict(recipe)


def validate_plugin_names(recipe: Recipe, plugins: Any = None) -> None:
    """Check that every plugin the recipe names is installed (reads the registry; imports nothing heavy)."""
    if plugins is None:
        from twinkle_core.plugins import get_plugins

        plugins = get_plugins()
    wanted = [
        ("task", "task", recipe.task),
        ("model.class_name", "model", recipe.model.class_name),
        ("strategy.name", "strategy", recipe.strategy.name),
        ("precision", "precision", recipe.precision),
        ("loss.name", "loss", recipe.loss.name),
        ("optimizer.name", "optimizer", recipe.optimizer.name),
        ("lr_scheduler.name", "scheduler", recipe.lr_scheduler.name),
    ]
    for _, kind, _ in wanted:  # a kind registered twice (DuplicatePluginError) is reported first
        plugins.records(kind)
    for key, kind, name in wanted:
        if name is None:
            continue
        try:
            plugins.get(kind, name)
        except PluginNotFoundError as exc:
            exc.args = (f"{key}: {exc}",)
            raise
    from twinkle_core.trackers import check_trackers

    check_trackers(recipe.train.report_to, recipe.train.tracker_options, plugins)


def check_paths(recipe: Recipe) -> None:
    """Refuse local files and directories the recipe names that do not exist, before anything is launched.

    ``data.train`` / ``data.eval`` are files; ``model.model_id`` / ``model.tokenizer`` are checked only when they
    are local paths (absolute, or written ``./`` / ``~``): a bare ``org/name`` is a hub id, resolved later."""
    problems = []
    for key, spec in (("data.train", recipe.data.train), ("data.eval", recipe.data.eval)):
        items = [(key, spec)] if not isinstance(spec, list) else [
            (f"{key}[{i}]", item.get("path") if isinstance(item, dict) else item) for i, item in enumerate(spec)]
        for where, value in items:
            if isinstance(value, str) and "://" not in value and not os.path.exists(os.path.expanduser(value)):
                problems.append(f"{where}: {value!r} does not exist")
    for key, value in (("model.model_id", recipe.model.model_id), ("model.tokenizer", recipe.model.tokenizer)):
        if not isinstance(value, str) or "://" in value:
            continue
        path = Path(value).expanduser()
        if not (path.is_absolute() or value.startswith(("./", "../", "~"))):
            continue
        if not path.exists():
            problems.append(f"{key}: the directory {value!r} does not exist")
    if problems:
        raise ConfigError("invalid recipe:\n  " + "\n  ".join(problems) if len(problems) > 1 else problems[0])


def strategy_name(recipe: Recipe, model_cls: type | None = None, world_size: int | None = None) -> str:
    """``strategy.name``, or the default (:func:`twinkle_core.mesh.default_strategy`) for ``world_size`` ranks."""
    return recipe.strategy.name or default_strategy(model_cls, world_size)


def validate_components(recipe: Recipe, plugins: Any = None, *, world_size: int | None = None) -> str:
    """Check every ``options`` mapping against the component it configures, and that the model class,
    strategy and mesh can work together, before anything is launched or built. Returns the strategy the job
    will use (the recipe's, or the default for ``world_size`` ranks).

    Unlike :func:`validate_plugin_names` this imports the components (torch and the backend) and
    instantiates the task, whose own ``__init__`` validates ``task_options``.
    """
    from twinkle_core.capabilities import check_compatible

    if plugins is None:
        from twinkle_core.plugins import get_plugins

        plugins = get_plugins()
    validate_plugin_names(recipe, plugins)
    task_cls = plugins.load("task", recipe.task)
    check_options(task_cls, recipe.task_options, where="task_options")
    task = task_cls(**recipe.task_options)
    model_cls = plugins.load("model", recipe.model.class_name)
    check_options(model_cls, recipe.model.options, where="model.options", provided=_CONSTRUCTOR_KEYS_FROM)
    if "kernels" in recipe.model.options:  # a kernel name no plugin registers fails before launch
        from twinkle_core.kernels import check_switch

        check_switch(recipe.model.options["kernels"], where="model.options.kernels")
    if recipe.model.adapter:
        try:
            model_cls.check_adapter_config(dict(recipe.model.adapter))
        except ConfigError as exc:
            raise ConfigError(f"model.adapter: {exc}") from None
    strategy = strategy_name(recipe, model_cls, world_size)  # world_size: the ranks the job will have
    try:
        strategy_cls = plugins.load("strategy", strategy)
    except PluginNotFoundError as exc:
        if recipe.strategy.name is None:
            exc.args = (f"strategy: none given, and the default for this job is {strategy!r} "
                        f"(twinkle_core.mesh.default_strategy); set strategy.name, or: {exc}",)
        raise
    check_options(strategy_cls, recipe.strategy.options, where="strategy.options",
                  provided={"mesh": "mesh", "precision": "precision"})
    check_compatible(model_cls, strategy_cls, DeviceMesh(**recipe.mesh) if recipe.mesh else None,
                     strategy_name=strategy)
    _check_loss_options(recipe, task, plugins)
    check_optimizer_options(plugins.load("optimizer", recipe.optimizer.name), recipe.optimizer.options)
    check_options(plugins.load("scheduler", recipe.lr_scheduler.name), recipe.lr_scheduler.options,
                  where="lr_scheduler.options", positional=1,  # the optimizer
                  provided={"num_training_steps": "train.max_steps", "num_warmup_steps": "lr_scheduler.warmup_steps"})
    check_options(task.load_dataset, recipe.data.options, where="data.options", positional=2,  # path, tokenizer
                  provided={key: f"data.{key}" for key in ("max_length", "mode", "packing", "template", "columns")})
    _check_data_spec(recipe, task)
    if recipe.train.evaluate_options is not None:  # after model, dataset, tokenizer
        check_options(task.evaluate, recipe.train.evaluate_options, where="train.evaluate_options", positional=3)
    return strategy


def _check_data_spec(recipe: Recipe, task: Any) -> None:
    """Source lists, ``data.columns`` and ``data.template`` are well-formed and the task takes them."""
    from twinkle_core.data.chat_templates import resolve_chat_template
    from twinkle_core.data.mixing import parse_sources
    from twinkle_core.options import accepted_options

    accepted = accepted_options(task.load_dataset, positional=2)
    for key in ("template", "columns"):
        if getattr(recipe.data, key) is not None and key not in accepted.names and not accepted.open:
            raise ConfigError(f"data.{key}: the task {recipe.task!r} does not take it (its load_dataset has no "
                              f"'{key}' option)")
    for key in ("train", "eval"):
        spec = getattr(recipe.data, key)
        if spec is not None:
            parse_sources(spec, columns=recipe.data.columns, where=f"data.{key}")
            if isinstance(spec, list) and "seed" not in accepted.names and not accepted.open:
                raise ConfigError(f"data.{key}: the task {recipe.task!r} reads one data file; it cannot mix a list "
                                  "of sources")
    if recipe.data.template is not None:
        resolve_chat_template(recipe.data.template)


def _check_loss_options(recipe: Recipe, task: Any, plugins: Any) -> None:
    name = recipe.loss.name or getattr(task, "default_loss", "") or None
    if name is None:
        raise ConfigError(f"loss.name: the task {recipe.task!r} has no default loss; set loss.name")
    loss = plugins.load("loss", name)
    _check_loss_inputs(name, loss, recipe.task, task, plugins)
    if inspect.isclass(loss):
        check_options(loss, recipe.loss.options, where="loss.options")
    elif recipe.loss.options:  # a loss function is used as it is
        raise ConfigError(f"loss.options: the loss {name!r} is a function and takes no options; remove loss.options")


def _check_loss_inputs(loss_name: str, loss: Any, task_name: str, task: Any, plugins: Any) -> None:
    """A loss that reads batch features (``Loss.requires``) needs a task that provides them (``Task.provides``)."""
    missing = set(getattr(loss, "requires", frozenset())) - set(getattr(task, "provides", frozenset()))
    if not missing:
        return
    from twinkle_core.plugins import PluginLoadError

    providers = []
    for name in plugins.names("task"):
        try:
            provided = set(getattr(plugins.load("task", name), "provides", frozenset()))
        except PluginLoadError:  # a broken task plugin must not hide the real problem; `twinkle plugins` reports it
            continue
        if missing <= provided:
            providers.append(name)
    hint = (f"use task: {' or '.join(repr(p) for p in providers)}" if providers
            else "no installed task provides them")
    raise ConfigError(f"loss.name: the loss {loss_name!r} needs batches with {', '.join(sorted(missing))}, which "
                      f"the task {task_name!r} does not produce; {hint}")
