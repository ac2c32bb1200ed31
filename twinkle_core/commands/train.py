"""``twinkle train RECIPE.yaml [key.path=value ...]``: validate a recipe, then train (in this process or torchrun).

The recipe is validated (keys, types, plugin names, local files, options and adapter keys) before anything
starts; ``--dry-run`` stops there. With ``--nproc-per-node`` > 1 or ``--nnodes`` > 1 it launches
``torch.distributed.run`` (torchrun), whose workers run ``python -m twinkle_core.cli train RECIPE ...`` without
the launcher flags; otherwise it trains in this process. Heavy modules are imported inside :meth:`run` only.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from twinkle_core.commands import Command
from twinkle_core.errors import ConfigError


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
        parser.add_argument("--dry-run", action="store_true",
                            help="validate the recipe (keys, plugin names, local files, component options, adapter "
                                 "keys, model / strategy / mesh), print it resolved, and exit without training")
        launch = parser.add_argument_group("multi-process launch (torchrun)")
        launch.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, metavar="N",
                            help="processes per node (default 1: train in this process)")
        launch.add_argument("--nnodes", type=int, default=1, metavar="N", help="number of nodes (default 1)")
        launch.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="R",
                            help="rank of this node (default 0)")
        launch.add_argument("--master-addr", "--master_addr", default=None, metavar="ADDR",
                            help="address of the rank-0 node (default 127.0.0.1)")
        launch.add_argument("--master-port", "--master_port", type=int, default=None, metavar="PORT",
                            help="port of the rank-0 node (default: a free port on one node, 29500 on several)")

    def take_unparsed(self, args: argparse.Namespace, unparsed: list[str]) -> list[str]:
        # overrides may also come after options: RECIPE --resume latest a.b=1
        args.overrides = list(args.overrides)
        for item in unparsed:
            if item.startswith("-") or "=" not in item:
                return [item]
            args.overrides.append(item)
        return []

    def run(self, args: argparse.Namespace) -> int:
        from twinkle_core.train.logging import start_startup_timer

        # where the time before the first optimizer step goes: the run's summary has it ("startup")
        timer = start_startup_timer()
        recipe, strategy = validated_recipe(args, timer)
        launching = is_launcher(args)
        if args.dry_run:
            print_dry_run(recipe, strategy, args)
            return 0
        configure_logging()
        if launching:
            return launch(args)
        from twinkle_core.train.loop import train

        summary = train(recipe, resume_weights_only=args.resume_weights_only)
        if int(os.environ.get("RANK", "0")) == 0:
            print_summary(summary)
        return 0


def is_launcher(args: argparse.Namespace) -> bool:
    """Whether this process launches torchrun (more than one process) rather than training itself."""
    return args.nproc_per_node > 1 or args.nnodes > 1


def validated_recipe(args: argparse.Namespace, timer: Any) -> tuple[Any, str]:
    """The recipe with the command line's overrides, validated; and the strategy the job will use."""
    with timer.phase("recipe"):
        from twinkle_core.train.recipe import (
            check_paths,
            load_recipe,
            validate_components,
            validate_plugin_names,
        )

        if args.nproc_per_node < 1 or args.nnodes < 1:
            raise ConfigError("--nproc-per-node and --nnodes must be at least 1")
        if not 0 <= args.node_rank < args.nnodes:
            raise ConfigError(f"--node-rank {args.node_rank} must be in 0..{args.nnodes - 1}")
        recipe = load_recipe(args.recipe, args.overrides)
        if args.resume:
            recipe.train.resume = args.resume
        if args.resume_weights_only and recipe.train.resume:
            raise ConfigError("--resume-weights-only starts a new run from a checkpoint's weights; it cannot be "
                              "combined with --resume / train.resume, which continue a run exactly")
    with timer.phase("plugins"):  # discovery: reads the registry, imports no component
        validate_plugin_names(recipe)
    world_size = args.nproc_per_node * args.nnodes if is_launcher(args) else None
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


def print_dry_run(recipe: Any, strategy: str, args: argparse.Namespace) -> None:
    import yaml

    from twinkle_core.train.recipe import recipe_to_dict

    print(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False).rstrip())
    where = f"{args.nproc_per_node * args.nnodes} processes" if is_launcher(args) else "this process"
    chosen = "" if recipe.strategy.name else " (the default for this job)"
    print(f"# recipe OK; would train in {where} with strategy {strategy!r}{chosen}", file=sys.stderr)


def launch(args: argparse.Namespace) -> int:
    """Run the job under torchrun; 1 when a rank failed (torchrun already printed its error)."""
    from torch.distributed import run as torchrun

    try:
        torchrun.main(torchrun_argv(args, args.overrides))
    except Exception as exc:  # ChildFailedError: torchrun already printed the failing rank's error
        print(f"twinkle: error: distributed training failed: {type(exc).__name__}: "
              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}", file=sys.stderr)
        return 1
    return 0


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


def torchrun_argv(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """Arguments for ``torch.distributed.run.main``: launcher flags, then the worker command."""
    argv = [f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}"]
    if args.nnodes == 1 and args.master_addr is None and args.master_port is None:
        argv.append("--standalone")
    else:
        argv += [f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr or '127.0.0.1'}",
                 f"--master-port={args.master_port or 29500}"]
    argv += ["-m", "twinkle_core.cli", "train", os.path.abspath(args.recipe), *overrides]
    if args.resume:
        argv += ["--resume", args.resume]
    if getattr(args, "resume_weights_only", None):
        argv += ["--resume-weights-only", args.resume_weights_only]
    return argv


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
