"""Semantic checks on a recipe whose types are already right: value ranges, required keys, the mesh, the rules of
the recipe's task (:meth:`twinkle_core.task.Task.check_recipe`) and a local model directory the model class cannot
load (:func:`model_directory_problems`).

Also folds the spec's mesh size keys (``tp_size: 2``) into ``mesh`` before conversion.
"""

from __future__ import annotations

import difflib
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError, TwinkleError
from twinkle_core.mesh import SPEC_KEYS, DeviceMesh, merge_spec_sizes, pop_spec_sizes, suggest_spec_key
from twinkle_core.train.recipe.convert import ErrorList
from twinkle_core.train.recipe.schema import CONSTRUCTOR_KEYS, CONSTRUCTOR_KEYS_FROM, RECIPE_KEYS, Recipe

logger = logging.getLogger("twinkle.train")

_MESH_KEYS = tuple(DeviceMesh.__dataclass_fields__)  # the mesh declares its dimensions once


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_Rule = tuple[str, Callable[[Any, "Recipe"], bool], str]


def _positive(path: str, *, zero: bool = False) -> _Rule:
    """A rule: the number at ``path``, when set, is > 0 (>= 0 with ``zero``)."""
    return (path, lambda value, recipe: _is_number(value) and (value < 0 or (value == 0 and not zero)),
            f"must be {'>= 0' if zero else '> 0'}, got {{value!r}}")


# (key path, wrong(value at the path, recipe), message; ``{value}`` is the value at the path). They run
# on a recipe whose types are already right; the task's own rules come between the data and the training ones.
_MODEL_AND_DATA_RULES: list[_Rule] = [
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
]
_TRAINING_RULES: list[_Rule] = [
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


def fold_spec_sizes(raw: dict[str, Any], errors: ErrorList) -> None:
    """The spec's size keys (``tp_size: 2`` at the top level or in ``mesh``; ``tp_size=2`` on the command line)
    become mesh dimensions (``mesh: {tp: 2}``), in place; a contradiction with ``mesh`` is an error."""
    for key in [k for k in raw if k not in RECIPE_KEYS and k not in SPEC_KEYS and suggest_spec_key(k)]:
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
                return  # build_section reports the wrong type of mesh
            raw["mesh"] = merge_spec_sizes(mesh, sizes)
    except ConfigError as exc:
        errors.add("", str(exc))


def _check_mesh(mesh: dict[str, int] | None, errors: ErrorList) -> None:
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


def task_problems(recipe: Recipe) -> list[str]:
    """What the recipe's task finds wrong with it (:meth:`twinkle_core.task.Task.check_recipe`). A task that is not
    installed or does not load has nothing to say here: :func:`validate_plugin_names` reports it with its key."""
    from twinkle_core.plugins import get_plugins

    try:
        task_cls = get_plugins().load("task", recipe.task)
    except TwinkleError as exc:
        logger.debug("the recipe's task %r cannot check it: %s", recipe.task, exc)
        return []
    return list(task_cls.check_recipe(recipe))


def local_model_directory(model_id: str | None) -> Path | None:
    """The directory ``model.model_id`` names when it is an existing local one (a path or ``local://``), else None."""
    if not model_id:
        return None
    from twinkle_core.sources.base import split_uri

    scheme, raw = split_uri(model_id)
    path = Path(raw).expanduser() if scheme == "local" and raw else None
    return path if path is not None and path.is_dir() else None


def model_directory_problems(recipe: Recipe) -> list[str]:
    """What is wrong with a local ``model.model_id`` directory, found before anything is built: what resolving it
    refuses (weights without ``config.json``, the model one level down), then, when the model is built from the
    directory's own config (no ``model.config``) and the model class can check one, what it finds in the
    ``config.json`` (damaged, no ``model_type``, a ``model_type`` its library does not know). The class's
    ``check_model_directory(path, **model.options)`` reads files only; a directory without ``config.json`` that
    resolution accepts (an empty one, another backend's format) is left to the model class when it is built."""
    path = local_model_directory(recipe.model.model_id)
    if path is None:
        return []
    from twinkle_core.sources.local import check_resolvable

    try:
        check_resolvable(path)
    except TwinkleError as exc:
        return [f"model.model_id: {exc}"]
    if recipe.model.config is not None or not (path / "config.json").is_file():
        return []
    from twinkle_core.plugins import get_plugins

    try:
        model_cls = get_plugins().load("model", recipe.model.class_name)
    except TwinkleError as exc:  # validate_plugin_names reports it with its key
        logger.debug("the recipe's model class %r cannot check its directory: %s", recipe.model.class_name, exc)
        return []
    try:
        model_cls.check_model_directory(str(path), **recipe.model.options)
    except TwinkleError as exc:
        return [f"model.model_id: {exc}"]
    return []


def _apply_rules(rules: list[_Rule], recipe: Recipe, errors: ErrorList) -> None:
    for path, wrong, message in rules:
        value = _at(recipe, path)
        if wrong(value, recipe):
            errors.add(path, message.format(value=value))


def check_recipe(recipe: Recipe, errors: ErrorList) -> None:
    """Add to ``errors`` every semantic problem of ``recipe`` (whose types are right): the general rules, a local model
    directory (:func:`model_directory_problems`), the task's (:func:`task_problems`), ``model.options`` keys the recipe
    sets itself, and the mesh."""
    _apply_rules(_MODEL_AND_DATA_RULES, recipe, errors)
    errors.extend(model_directory_problems(recipe))
    if recipe.task:
        errors.extend(task_problems(recipe))
    _apply_rules(_TRAINING_RULES, recipe, errors)
    for key in sorted(set(recipe.model.options) & CONSTRUCTOR_KEYS):
        errors.add(f"model.options.{key}", f"is set by the recipe itself; use {CONSTRUCTOR_KEYS_FROM[key]} instead")
    for key in sorted(set(recipe.model.options) & set(SPEC_KEYS)):
        errors.add(f"model.options.{key}", f"is a mesh size; write {key} at the top level (or mesh.{SPEC_KEYS[key]})")
    _check_mesh(recipe.mesh, errors)
