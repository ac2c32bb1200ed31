"""The ``twinkle`` command.

::

    twinkle --version
    twinkle plugins [--json] [--probe]
    twinkle chat CHECKPOINT [--prompt TEXT] [--system TEXT] [--temperature T] [--top-p P] [--max-new-tokens N]
    twinkle export CHECKPOINT --output DIR [--merge-lora] [--max-shard-size 2GB] [--push-to-hub REPO_ID]
    twinkle eval CHECKPOINT [DATA] [--output results.json] [--tasks NAME,...]
    twinkle plot logs.jsonl [--output curves.png]
    twinkle train RECIPE.yaml [key.path=value ...] [--resume PATH|latest] [--resume-weights-only PATH|latest]
                  [--dry-run]
                  [--nproc-per-node N] [--nnodes N] [--node-rank R] [--master-addr A] [--master-port P]

``twinkle train`` validates the recipe (keys, types, plugin names, local files, options and adapter keys) before
anything starts; ``--dry-run`` stops there.
With ``--nproc-per-node`` > 1 or ``--nnodes`` > 1 it launches ``torch.distributed.run`` (torchrun),
whose workers run ``python -m twinkle_core.cli train RECIPE ...`` without the launcher flags;
otherwise it trains in this process.

``twinkle --help`` and ``twinkle plugins`` import neither torch nor any backend: heavy modules are
imported inside the ``train`` command only; the same holds for ``chat``, ``export``, ``eval`` and ``plot``
(``twinkle_core/commands/``), which import them when they run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from twinkle_core.errors import ConfigError, PluginNotFoundError, TwinkleError

LAUNCH_FLAGS = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port")


def _version() -> str:
    from twinkle_core import __version__

    return __version__


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="twinkle",
        description="Twinkle: plugin-based training of large language models.",
        epilog="Run 'twinkle COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"twinkle {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p_plugins = sub.add_parser("plugins", help="list installed plugins and what they register",
                               description="List the installed Twinkle plugins (entry-point group 'twinkle'), "
                                           "what each registers, and the plugins that failed to load.")
    p_plugins.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p_plugins.add_argument("--probe", action="store_true",
                           help="also import torch and each accelerator's runtime to tell which one is active")

    p_train = sub.add_parser(
        "train", help="train from a YAML recipe",
        description="Train from a YAML recipe. KEY=VALUE arguments override recipe keys (values are YAML), "
                    "e.g. optimizer.lr=3e-4 train.max_steps=100 model.adapter.r=16.",
    )
    p_train.add_argument("recipe", help="the recipe YAML file")
    p_train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides")
    p_train.add_argument("--resume", metavar="PATH|latest",
                         help="continue from a checkpoint directory, or the newest one under train.output_dir")
    p_train.add_argument("--resume-weights-only", metavar="PATH|latest", default=None,
                         help="start a new run (step 0, fresh optimizer, schedule and data order) from a checkpoint's "
                              "weights (and adapter); works at any world size, batch size or strategy")
    p_train.add_argument("--dry-run", action="store_true",
                         help="validate the recipe (keys, plugin names, local files, component options, adapter "
                              "keys, model / strategy / mesh), print it resolved, and exit without training")
    launch = p_train.add_argument_group("multi-process launch (torchrun)")
    launch.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, metavar="N",
                        help="processes per node (default 1: train in this process)")
    launch.add_argument("--nnodes", type=int, default=1, metavar="N", help="number of nodes (default 1)")
    launch.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="R",
                        help="rank of this node (default 0)")
    launch.add_argument("--master-addr", "--master_addr", default=None, metavar="ADDR",
                        help="address of the rank-0 node (default 127.0.0.1)")
    launch.add_argument("--master-port", "--master_port", type=int, default=None, metavar="PORT",
                        help="port of the rank-0 node (default: a free port on one node, 29500 on several)")
    from twinkle_core import commands  # chat, export, eval, plot: their parsers import nothing heavy

    commands.add_parsers(sub)
    return parser


# ---------------------------------------------------------------------- plugins
def collect_plugins(plugins: Any = None, probe: bool = False) -> dict[str, Any]:
    """What ``twinkle plugins`` shows, as plain data (``probe``: check the accelerators' devices too)."""
    from twinkle_core.accelerator import accelerator_statuses
    from twinkle_core.plugins import PLUGIN_FAULTS, get_plugins
    from twinkle_core.records import KINDS

    plugins = plugins if plugins is not None else get_plugins()
    pm = plugins.pm
    registers: dict[str, dict[str, list[dict[str, str]]]] = {}
    problems: list[str] = []
    # first collect the records: a plugin whose registration hook raises is reported among the
    # failures and unregistered, so the listing below no longer calls it
    for kind in KINDS:
        try:
            plugins.records(kind)
        except TwinkleError as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
        except TypeError as exc:
            problems.append(f"TypeError: {exc}")
    for kind, record_type in KINDS.items():
        hook_name = record_type.register_hook
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            try:
                records = list(impl.function() or ())
            except PLUGIN_FAULTS as exc:  # a plugin's hook raising is reported, not fatal
                problems.append(f"plugin {impl.plugin_name!r}: {hook_name} raised {type(exc).__name__}: {exc}")
                continue
            entries = registers.setdefault(impl.plugin_name, {}).setdefault(kind, [])
            entries.extend({"name": str(getattr(r, "name", r)), "impl": str(getattr(r, "impl", "")),
                            "description": str(getattr(r, "description", ""))} for r in records)
    listed = []
    for name, info in plugins.plugins.items():
        listed.append({"name": name, "distribution": info.distribution, "version": info.version,
                       "module": info.module, "registers": registers.get(name, {})})
    return {
        "plugins": listed,
        "accelerators": accelerator_statuses(plugins, probe=probe),
        "failures": [{"name": f.name, "distribution": f.distribution, "reason": f.reason} for f in plugins.failures],
        "problems": problems,
        "disabled": sorted(plugins.disabled),
        "autoload": plugins.autoload,
    }


def format_plugins(data: dict[str, Any]) -> str:
    rows = [("PLUGIN", "DISTRIBUTION", "VERSION", "REGISTERS")]
    extra_lines: list[list[str]] = [[]]
    for plugin in data["plugins"]:
        kinds = [f"{kind}: {', '.join(e['name'] for e in entries)}"
                 for kind, entries in plugin["registers"].items() if entries]
        rows.append((plugin["name"], plugin["distribution"], plugin["version"], kinds[0] if kinds else "(nothing)"))
        extra_lines.append(kinds[1:])
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    indent = sum(widths) + 3 * 2
    lines = []
    for row, more in zip(rows, extra_lines, strict=True):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:3])) + "  " + row[3])
        lines.extend(" " * indent + text for text in more)
    if data.get("accelerators"):
        lines.append("")
        probed = all(a["status"] != "not probed" for a in data["accelerators"])
        lines.append("accelerators:" if probed else "accelerators (twinkle plugins --probe imports torch to check "
                                                    "the devices):")
        width = max(len(a["name"]) for a in data["accelerators"])
        for acc in data["accelerators"]:
            why = f": {acc['reason']}" if acc["reason"] else ""
            lines.append(f"  {acc['name'].ljust(width)}  {acc['status']}{why}")
    if not data["autoload"]:
        lines.append("")
        lines.append("entry-point autoloading is off (TWINKLE_DISABLE_PLUGIN_AUTOLOAD); only built-ins and "
                     "TWINKLE_PLUGINS modules are loaded")
    if data["disabled"]:
        lines.append("")
        lines.append(f"disabled by TWINKLE_DISABLE_PLUGINS: {', '.join(data['disabled'])}")
    if data["failures"]:
        lines.append("")
        count = len(data["failures"])
        lines.append(f"{count} plugin{'s' if count > 1 else ''} failed to load and {'were' if count > 1 else 'was'} "
                     f"skipped:")
        lines.extend(f"  {f['name']} ({f['distribution']}): {f['reason']}" for f in data["failures"])
    if data["problems"]:
        lines.append("")
        lines.append("problems:")
        lines.extend(f"  {p}" for p in data["problems"])
    return "\n".join(lines)


def cmd_plugins(args: argparse.Namespace) -> int:
    import logging

    # failures are part of the listing below; do not also print them as stray warnings
    logging.getLogger("twinkle.plugins").addHandler(logging.NullHandler())
    data = collect_plugins(probe=args.probe)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(format_plugins(data))
    return 1 if data["problems"] else 0


# ---------------------------------------------------------------------- train
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


def _configure_logging() -> None:
    import logging

    level_name = os.environ.get("TWINKLE_LOG_LEVEL", "").upper()
    rank = int(os.environ.get("RANK", "0"))
    level = getattr(logging, level_name, None) if level_name else None
    if not isinstance(level, int):
        level = logging.INFO if rank == 0 else logging.WARNING
    prefix = f"[rank {rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    logging.basicConfig(level=level, format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from twinkle_core.train.logging import start_startup_timer

    # where the time before the first optimizer step goes: the run's summary has it ("startup")
    timer = start_startup_timer()
    with timer.phase("recipe"):
        from twinkle_core.train.recipe import (
            check_paths,
            load_recipe,
            recipe_to_dict,
            validate_components,
            validate_plugin_names,
        )

        if args.nproc_per_node < 1 or args.nnodes < 1:
            raise ConfigError("--nproc-per-node and --nnodes must be at least 1")
        if not 0 <= args.node_rank < args.nnodes:
            raise ConfigError(f"--node-rank {args.node_rank} must be in 0..{args.nnodes - 1}")
        recipe = load_recipe(args.recipe, overrides)
        if args.resume:
            recipe.train.resume = args.resume
        if args.resume_weights_only and recipe.train.resume:
            raise ConfigError("--resume-weights-only starts a new run from a checkpoint's weights; it cannot be "
                              "combined with --resume / train.resume, which continue a run exactly")
    with timer.phase("plugins"):  # discovery: reads the registry, imports no component
        validate_plugin_names(recipe)
    with timer.phase("recipe"):
        check_paths(recipe)
        launching = args.nproc_per_node > 1 or args.nnodes > 1
        if recipe.mesh and launching:
            from twinkle_core.mesh import DeviceMesh

            DeviceMesh.for_job(dict(recipe.mesh), args.nproc_per_node * args.nnodes)
    # imports torch and the backend: option typos, a wrong adapter key and an impossible model / strategy / mesh
    # fail here once, instead of on every rank after torchrun started (and a dry run checks all of it)
    with timer.phase("validate"):
        # the world the default strategy is chosen for: the job about to be launched, else this process's WORLD_SIZE
        strategy = validate_components(recipe, world_size=args.nproc_per_node * args.nnodes if launching else None)
    if args.dry_run:
        import yaml

        print(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False).rstrip())
        where = f"{args.nproc_per_node * args.nnodes} processes" if launching else "this process"
        chosen = "" if recipe.strategy.name else " (the default for this job)"
        print(f"# recipe OK; would train in {where} with strategy {strategy!r}{chosen}", file=sys.stderr)
        return 0
    _configure_logging()
    if launching:
        from torch.distributed import run as torchrun

        argv = torchrun_argv(args, overrides)
        try:
            torchrun.main(argv)
        except Exception as exc:  # ChildFailedError: torchrun already printed the failing rank's error
            print(f"twinkle: error: distributed training failed: {type(exc).__name__}: "
                  f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}", file=sys.stderr)
            return 1
        return 0

    from twinkle_core.train.loop import train

    summary = train(recipe, resume_weights_only=args.resume_weights_only)
    if int(os.environ.get("RANK", "0")) == 0:
        metrics = summary.get("train_metrics") or {}
        evals = summary.get("eval_after") or {}
        parts = [f"done at step {summary['steps']}/{summary['num_training_steps']} in {summary['wall_time_s']:.1f} s"]
        if metrics.get("loss") is not None:
            parts.append(f"loss {metrics['loss']:.4g}")
        if evals.get("eval_loss") is not None:
            parts.append(f"eval_loss {evals['eval_loss']:.4g}")
        print("twinkle: " + "; ".join(parts))
        print(f"twinkle: final model: {summary['final_checkpoint']}")
    return 0


# ---------------------------------------------------------------------- entry point
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides: list[str] = []
    if args.command == "train":
        overrides = list(args.overrides)
        for item in extra:  # overrides may also come after options: RECIPE --resume latest a.b=1
            if item.startswith("-") or "=" not in item:
                parser.error(f"unrecognized arguments: {item}")
            overrides.append(item)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "plugins":
            return cmd_plugins(args)
        if args.command != "train":
            from twinkle_core import commands

            return commands.run(args)
        return cmd_train(args, overrides)
    except KeyboardInterrupt:
        print("twinkle: interrupted (an interrupted checkpoint was saved if training had made progress; "
              "continue with --resume latest)", file=sys.stderr)
        return 130
    except (ConfigError, PluginNotFoundError) as exc:
        print(f"twinkle: error: {exc}", file=sys.stderr)
        return 2
    except TwinkleError as exc:
        print(f"twinkle: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
