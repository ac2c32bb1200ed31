"""Checks of a valid recipe against the installed components it names, before anything is launched.

:func:`validate_plugin_names` only reads the plugin registry; :func:`validate_components` imports the
components and checks every ``options`` mapping against their signatures (:mod:`twinkle_core.options`)
and the model / strategy / mesh combination (:mod:`twinkle_core.capabilities`).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError, PluginNotFoundError, SourceError
from twinkle_core.mesh import DeviceMesh, default_strategy
from twinkle_core.optim import check_optimizer_options
from twinkle_core.options import check_options
from twinkle_core.sources.local import check_local_path
from twinkle_core.task import default_loss_name
from twinkle_core.train.recipe.schema import CONSTRUCTOR_KEYS_FROM, Recipe


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

    ``data.train`` / ``data.eval`` are files; ``model.model_id`` / ``model.tokenizer`` without a scheme are local
    paths: a bare ``org/name`` that does not exist is refused as resolving it would be (write ``hf://`` or
    ``ms://`` for a hub id)."""
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
            try:  # a bare name is a local path too: what resolving it says (an org/name: write hf:// or ms://)
                check_local_path(value)
            except SourceError as exc:
                problems.append(f"{key}: {exc}")
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
    from twinkle_core.capabilities import check_compatible, check_model_kind

    if plugins is None:
        from twinkle_core.plugins import get_plugins

        plugins = get_plugins()
    validate_plugin_names(recipe, plugins)
    task_cls = plugins.load("task", recipe.task)
    check_options(task_cls, recipe.task_options, where="task_options")
    task = task_cls(**recipe.task_options)
    model_cls = plugins.load("model", recipe.model.class_name)
    check_options(model_cls, recipe.model.options, where="model.options", provided=CONSTRUCTOR_KEYS_FROM)
    check_kwargs = getattr(model_cls, "check_options", None)  # TwinkleModel.check_options; a bare class has none
    if check_kwargs is not None:  # what its **kwargs take, checked as its constructor does
        check_kwargs(dict(recipe.model.options))
    check_model_kind(model_cls, task)  # a task whose network this backend does not build fails before launch
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
    # the job's size, or this process's WORLD_SIZE (a launched rank): the check the strategy's setup makes
    strategy_cls.check_world_size(world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1")))
    _check_loss_options(recipe, task, plugins)
    check_optimizer_options(plugins.load("optimizer", recipe.optimizer.name), recipe.optimizer.options)
    check_options(plugins.load("scheduler", recipe.lr_scheduler.name), recipe.lr_scheduler.options,
                  where="lr_scheduler.options", positional=1,  # the optimizer
                  provided={"num_training_steps": "train.max_steps", "num_warmup_steps": "lr_scheduler.warmup_steps"})
    check_options(task.load_dataset, recipe.data.options, where="data.options", positional=2,  # path, tokenizer
                  provided={key: f"data.{key}" for key in ("max_length", "mode", "packing", "template", "columns")})
    _check_data_spec(recipe, task)
    _check_data(recipe, task)
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


def _check_data(recipe: Recipe, task: Any) -> None:
    """What the task's ``load_dataset`` would refuse in the data without a tokenizer or model (``Task.check_data``),
    with the options the trainer passes it."""
    from twinkle_core.train.data_options import data_options

    options = data_options(recipe, task, Path(recipe.train.output_dir))
    for spec in (recipe.data.train, recipe.data.eval):
        if spec is not None:
            task.check_data(spec, **options)


def check_loss_inputs(recipe: Recipe, task: Any, plugins: Any) -> None:
    """The recipe's loss reads only batch features ``task`` provides (``Loss.requires`` / ``Task.provides``):
    checked before launch (``--dry-run`` too) and by the trainer once the task exists (``train()`` from Python)."""
    name = recipe.loss.name or default_loss_name(task)
    _check_loss_inputs(name, plugins.load("loss", name), recipe.task, task, plugins)


def _check_loss_options(recipe: Recipe, task: Any, plugins: Any) -> None:
    name = recipe.loss.name or default_loss_name(task)
    loss = plugins.load("loss", name)
    check_loss_inputs(recipe, task, plugins)
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
            else "no installed task provides them: install a task plugin whose Task.provides names them, or "
                 "choose another loss.name")
    raise ConfigError(f"loss.name: the loss {loss_name!r} needs batches with {', '.join(sorted(missing))}, which "
                      f"the task {task_name!r} does not produce; {hint}")
