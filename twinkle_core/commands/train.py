"""``twinkle train RECIPE.yaml [key.path=value ...]``: validate a recipe, then train (in this process or launched).

The recipe is validated (keys, types, plugin names, local files, options and adapter keys) before anything
starts; ``--dry-run`` stops there. A runtime (:mod:`twinkle_core.launch`, ``--runtime``) decides whether the job
is launched: ``torchrun`` (the default) launches ``torch.distributed.run`` with ``--nproc-per-node`` > 1 or
``--nnodes`` > 1, ``ray`` (twinkle-ray) starts ``--num-workers`` Ray actors; each rank runs
:func:`train_this_process` (torchrun's workers through ``python -m twinkle_core.cli train RECIPE ...`` without the
launcher flags). Otherwise it trains in this process. Heavy modules are imported inside :meth:`run` only.

A new run into a ``train.output_dir`` that holds another run's checkpoints, ``final`` model or log is refused right
after the recipe is read (before the backend is imported or torchrun launched): ``--resume latest`` continues that
run, ``--overwrite`` discards it (:func:`twinkle_core.train.checkpointing.check_start`; the trainer checks again
once it holds the directory's lock).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

from twinkle_core.commands import Command, take_recipe_overrides
from twinkle_core.errors import ConfigError
from twinkle_core.known_warnings import quiet_known_warnings
from twinkle_core.launch import DEFAULT_RUNTIME, TrainJob, select_runtime


class TrainCommand(Command):
    description = ("Train from a YAML recipe. KEY=VALUE arguments override recipe keys (values are YAML), "
                   "e.g. optimizer.lr=3e-4 train.max_steps=100 model.adapter.r=16.")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("recipe", help="the recipe YAML file")
        parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides")
        parser.add_argument("--resume", metavar="PATH|latest",
                            help="continue from a checkpoint directory, or the newest one under train.output_dir")
        parser.add_argument("--resume-weights-only", metavar="PATH|latest", default=None,
                            help="start a new run (step 0, fresh optimizer, schedule and data order) from a "
                                 "checkpoint's weights (and adapter); works at any world size, batch size or strategy")
        parser.add_argument("--overwrite", action="store_true",
                            help="start a new run even though train.output_dir holds another run's checkpoints or "
                                 "logs: its checkpoints, final model and logs are removed (caches and files a run does "
                                 "not write stay); without it such a start is refused (continue that run with --resume "
                                 "latest, or set a new train.output_dir)")
        parser.add_argument("--show-warnings", action="store_true",
                            help="show the third-party warnings Twinkle hides as noise (twinkle_core.known_warnings; "
                                 "also TWINKLE_SHOW_WARNINGS=1)")
        parser.add_argument("--dry-run", action="store_true",
                            help="validate the recipe (keys, plugin names, local files, component options, adapter "
                                 "keys, model / strategy / mesh / number of processes, the loss's inputs, the data "
                                 "rows the task checks, a --resume's optimizer settings) as the real run does, print "
                                 "it resolved, and exit without training")
        parser.add_argument("--runtime", default=DEFAULT_RUNTIME, metavar="NAME",
                            help=f"what starts the job's ranks (default {DEFAULT_RUNTIME}; installed: "
                                 f"{', '.join(sorted(self.runtimes)) or 'none'}). Each runtime's options follow")
        for name, runtime in sorted(self.runtimes.items(), key=lambda item: (item[0] != DEFAULT_RUNTIME, item[0])):
            runtime.add_arguments(parser.add_argument_group(runtime.title or f"runtime {name}"))

    @functools.cached_property
    def loaded_runtimes(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The installed runtimes and those that failed to load (:func:`twinkle_core.launch.load_runtimes`)."""
        from twinkle_core.launch import load_runtimes

        return load_runtimes()

    @property
    def runtimes(self) -> dict[str, Any]:
        return self.loaded_runtimes[0]

    def take_unparsed(self, args: argparse.Namespace, unparsed: list[str]) -> list[str]:
        return take_recipe_overrides(args, unparsed)

    def run(self, args: argparse.Namespace) -> int:
        from twinkle_core.train.logging import start_startup_timer

        # where the time before the first optimizer step goes: the run's summary has it ("startup")
        timer = start_startup_timer()
        runtime = select_runtime(args.runtime, *self.loaded_runtimes)
        args.world_size = runtime.world_size(args)
        recipe, strategy = validated_recipe(args, timer)
        if args.dry_run:
            print_dry_run(recipe, strategy, args)
            return 0
        configure_logging()
        if args.world_size is not None:
            return runtime.launch(train_job(args), args)
        summary = train_in_process(recipe, args)
        if summary is not None:
            print_summary(summary)
        return 0


def train_in_process(recipe: Any, args: argparse.Namespace) -> dict[str, Any] | None:
    """Train this process's rank of the job; the run's summary on rank 0 (``None`` on the others). This process
    computes with the torch threads :func:`twinkle_core.threads.configure_threads` chooses (its share of the
    free cores, unless ``OMP_NUM_THREADS`` says otherwise)."""
    from twinkle_core.threads import threads_for_run
    from twinkle_core.train.loop import train

    with threads_for_run():
        summary = train(recipe, resume_weights_only=args.resume_weights_only, overwrite=args.overwrite)
    return summary if int(os.environ.get("RANK", "0")) == 0 else None


def train_this_process(argv: list[str]) -> dict[str, Any] | None:
    """Run one rank of a job a runtime launched: ``argv`` is :meth:`TrainJob.worker_argv` (``train RECIPE ...``),
    ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` ... are in the environment. The recipe is validated here again, as
    each torchrun worker does; returns the run's summary on rank 0 (``None`` on the others)."""
    from twinkle_core.train.logging import start_startup_timer

    parser = argparse.ArgumentParser(prog="twinkle train")
    command = TrainCommand()
    command.add_arguments(parser)
    if not argv or argv[0] != "train":
        raise ConfigError(f"a launched rank runs `train RECIPE ...`, got {argv[:1]}")
    args = parser.parse_args(argv[1:])
    args.world_size = None  # this process trains; the runtime that started it already launched the job
    quiet_known_warnings(show=args.show_warnings)  # what twinkle's entry point does in a process it starts
    recipe, _ = validated_recipe(args, start_startup_timer())
    configure_logging()
    return train_in_process(recipe, args)


def train_job(args: argparse.Namespace) -> TrainJob:
    """The job every rank of a launched run executes, from the launching command line."""
    return TrainJob(recipe=args.recipe, overrides=tuple(args.overrides), resume=args.resume,
                    resume_weights_only=args.resume_weights_only, overwrite=bool(getattr(args, "overwrite", False)),
                    show_warnings=bool(getattr(args, "show_warnings", False)))


def validated_recipe(args: argparse.Namespace, timer: Any) -> tuple[Any, str]:
    """The recipe with the command line's overrides, validated; and the strategy the job will use."""
    with timer.phase("recipe"):
        from twinkle_core.train.recipe import (
            check_paths,
            load_recipe,
            validate_components,
            validate_plugin_names,
        )

        recipe = load_recipe(args.recipe, args.overrides)
        if args.resume:
            recipe.train.resume = args.resume
        if args.resume_weights_only and recipe.train.resume:
            raise ConfigError("--resume-weights-only starts a new run from a checkpoint's weights; it cannot be "
                              "combined with --resume / train.resume, which continue a run exactly")
        check_output_dir(recipe, args)
    with timer.phase("plugins"):  # discovery: reads the registry, imports no component
        validate_plugin_names(recipe)
    world_size = args.world_size
    with timer.phase("recipe"):
        check_paths(recipe)
        if recipe.mesh and world_size is not None:
            from twinkle_core.mesh import DeviceMesh

            DeviceMesh.for_job(dict(recipe.mesh), world_size)
    # imports torch and the backend: option typos, a wrong adapter key and an impossible model / strategy / mesh
    # fail here once, instead of on every rank after torchrun started (and a dry run checks all of it)
    with timer.phase("validate"):
        # the world the default strategy is chosen for: the job about to be launched, else this process's WORLD_SIZE
        strategy = validate_components(recipe, world_size=world_size)
    return recipe, strategy


def check_output_dir(recipe: Any, args: argparse.Namespace) -> None:
    """Refuse, before the backend is imported or torchrun launched, a start that would mix two runs in
    ``train.output_dir`` (:func:`~twinkle_core.train.checkpointing.check_start`). While another run holds the
    directory's lock the trainer reports that instead (a run in progress is the more useful news)."""
    import socket
    from pathlib import Path

    from twinkle_core.train.checkpointing import check_resume, check_start
    from twinkle_core.train.run_lock import LOCK_FILE, pid_alive, read_holder

    output_dir = Path(recipe.train.output_dir)
    holder = read_holder(output_dir / LOCK_FILE)
    if isinstance(holder.get("pid"), int) and (holder.get("host") != socket.gethostname() or pid_alive(holder["pid"])):
        return
    check_start(output_dir, resume=recipe.train.resume, weights_only=args.resume_weights_only,
                overwrite=getattr(args, "overwrite", False))
    if int(os.environ.get("RANK", "0")) == 0:  # what the trainer's resume would refuse (one rank verifies the files)
        check_resume(output_dir, recipe.train.resume, recipe.optimizer)


def print_dry_run(recipe: Any, strategy: str, args: argparse.Namespace) -> None:
    import yaml

    from twinkle_core.train.recipe import recipe_to_dict

    print(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False).rstrip())
    where = f"{args.world_size} processes ({args.runtime})" if args.world_size is not None else "this process"
    chosen = "" if recipe.strategy.name else " (the default for this job)"
    print(f"# recipe OK; would train in {where} with strategy {strategy!r}{chosen}", file=sys.stderr)
    from twinkle_core.memory_model import recipe_estimate_lines
    from twinkle_core.plugins import get_plugins

    strategy_class = get_plugins().load("strategy", strategy)  # does it shard the model's state, split the vocab
    for line in recipe_estimate_lines(recipe, strategy_class, args.world_size):  # why a long context needs cp / sp
        print(f"# {line}", file=sys.stderr)


def print_summary(summary: dict[str, Any]) -> None:
    metrics = summary.get("train_metrics") or {}
    evals = summary.get("eval_after") or {}
    parts = [f"done at step {summary['steps']}/{summary['num_training_steps']} in {summary['wall_time_s']:.1f} s"]
    if metrics.get("loss") is not None:
        parts.append(f"loss {metrics['loss']:.4g}")
    if evals.get("eval_loss") is not None:
        parts.append(f"eval_loss {evals['eval_loss']:.4g}")
    print("twinkle: " + "; ".join(parts))
    print(f"twinkle: final model: {summary['final_checkpoint']}")


def configure_logging() -> None:
    import logging

    level_name = os.environ.get("TWINKLE_LOG_LEVEL", "").upper()
    rank = int(os.environ.get("RANK", "0"))
    level = getattr(logging, level_name, None) if level_name else None
    if not isinstance(level, int):
        level = logging.INFO if rank == 0 else logging.WARNING
    prefix = f"[rank {rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    logging.basicConfig(level=level, format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
