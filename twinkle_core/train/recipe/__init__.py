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

This package's ``__init__`` is the public entry point; the work is split over :mod:`.schema` (the sections),
:mod:`.convert` (typed conversion), :mod:`.checks` (semantic rules, with the task's own:
:meth:`twinkle_core.task.Task.check_recipe`), :mod:`.overrides` (paths and overrides) and :mod:`.components`
(checks against the installed plugins). They talk through public names only.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_core.train.recipe.checks import check_recipe, fold_spec_sizes
from twinkle_core.train.recipe.components import check_paths as check_paths  # public, never in __all__
from twinkle_core.train.recipe.components import (
    strategy_name,
    validate_components,
    validate_plugin_names,
)
from twinkle_core.train.recipe.convert import ErrorList, build_section, describe_value
from twinkle_core.train.recipe.overrides import apply_overrides, parse_override, resolve_paths
from twinkle_core.train.recipe.schema import (
    DataConfig,
    LossConfig,
    LRSchedulerConfig,
    ModelConfig,
    OptimizerConfig,
    Recipe,
    StrategyConfig,
    TrainConfig,
)

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


def recipe_from_dict(raw: dict[str, Any] | None, overrides: list[str] | None = None, *,
                     base_dir: str | os.PathLike[str] | None = None) -> Recipe:
    """Validate a plain mapping (paths relative to ``base_dir`` when given) into a :class:`Recipe`."""
    import copy

    raw = copy.deepcopy(raw) if raw is not None else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"a recipe must be a mapping of sections, got {describe_value(raw)}")
    if base_dir is not None:
        resolve_paths(raw, Path(base_dir))
    apply_overrides(raw, overrides)
    errors = ErrorList()
    fold_spec_sizes(raw, errors)
    recipe = build_section(Recipe, raw, "", errors)
    if not errors:
        check_recipe(recipe, errors)
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
        raise ConfigError(f"{file}: a recipe must be a mapping of sections, got {describe_value(raw)}")
    try:
        return recipe_from_dict(raw, overrides, base_dir=file.resolve().parent)
    except ConfigError as exc:
        raise ConfigError(f"{file}: {exc}") from None


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    return dataclasses.asdict(recipe)
