"""The ``twinkle`` command.

::

    twinkle --version
    twinkle plugins [--json] [--probe]
    twinkle train RECIPE.yaml [key.path=value ...] [--resume PATH|latest] [--resume-weights-only PATH|latest]
                  [--dry-run] [--overwrite] [--show-warnings] [--runtime torchrun|ray]
                  [--nproc-per-node N] [--nnodes N] [--node-rank R] [--master-addr A] [--master-port P]
                  [--num-workers N] [--ray-address A] [--max-restarts N] ...   # --runtime ray (twinkle-ray)
    twinkle plot logs.jsonl [--output curves.png]
    # with twinkle-backend-hf:
    twinkle chat CHECKPOINT [--prompt TEXT] [--system TEXT] [--temperature T] [--top-p P] [--max-new-tokens N]
    twinkle export CHECKPOINT --output DIR [--merge-lora] [--max-shard-size 2GB] [--push-to-hub REPO_ID]
    twinkle eval CHECKPOINT [DATA] [--output results.json] [--tasks NAME,...]

Every sub-command is a plugin's: the core registers ``plugins``, ``train`` and ``plot``
(:mod:`twinkle_core.commands`) through ``twinkle_register_commands`` like any other distribution, and
``twinkle-backend-hf`` registers ``chat``, ``export`` and ``eval``. A command whose distribution is not
installed says which one to ``pip install``.

``twinkle --help`` and ``twinkle plugins`` import neither torch nor any backend's heavy modules: each command
imports them when it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator

from twinkle_core.catalog import PROVIDERS, install_hint
from twinkle_core.commands import Command

# re-exported: the plugin listing is what `twinkle plugins` prints, and tests and backends read it from here
from twinkle_core.commands.plugins import collect_plugins, format_plugins  # noqa: F401
from twinkle_core.errors import ConfigError, PluginNotFoundError, TwinkleError
from twinkle_core.known_warnings import quiet_known_warnings

PLUGIN_LOGGER = "twinkle.plugins"


def _version() -> str:
    from twinkle_core import __version__

    return __version__


class MissingCommand(Command):
    """A command the installed plugins do not provide (or failed to load): running it raises ``error``."""

    def __init__(self, error: TwinkleError) -> None:
        self.error = error

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("arguments", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def take_unparsed(self, args: argparse.Namespace, unparsed: list[str]) -> list[str]:
        return []

    def run(self, args: argparse.Namespace) -> int:
        raise self.error


# ---------------------------------------------------------------------- commands
def load_commands(plugins: object | None = None) -> dict[str, tuple[str, Command]]:
    """``{name: (one-line help, command)}``: every registered command, then the well-known ones no installed
    plugin provides (they say what to install). A command whose module fails to import is kept as an error."""
    from twinkle_core.plugins import get_plugins

    plugins = plugins if plugins is not None else get_plugins()
    commands: dict[str, tuple[str, Command]] = {}
    for name, entry in plugins.records("command").items():
        try:
            command = plugins.load_record("command", entry.record)()
        except TwinkleError as exc:  # PluginLoadError: the plugin and its distribution are named
            commands[name] = (f"(cannot be loaded: see twinkle {name})", MissingCommand(exc))
            continue
        commands[name] = (entry.record.description, command)
    available = sorted(commands)
    # commands other distributions provide name their ``pip install`` instead of being unknown words
    for (kind, name), _ in PROVIDERS.items():
        if kind == "command" and name not in commands:
            hint = install_hint("command", name)
            commands[name] = (f"(not installed: {hint})",
                              MissingCommand(PluginNotFoundError("command", name, available, hint)))
    return commands


def build_parser(commands: dict[str, tuple[str, Command]] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="twinkle",
        description="Twinkle: plugin-based training of large language models.",
        epilog="Run 'twinkle COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"twinkle {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_line, command) in (commands if commands is not None else load_commands()).items():
        missing = isinstance(command, MissingCommand)
        command.add_arguments(sub.add_parser(name, help=help_line, description=command.description or help_line,
                                             add_help=not missing))
    return parser


@contextlib.contextmanager
def held_plugin_warnings() -> Iterator[list[logging.LogRecord]]:
    """Hold the plugin loader's warnings (a plugin that failed to load) until the command is known: a command
    that lists the failures itself (``twinkle plugins``) drops them, the others print them."""
    held: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    logger, handler = logging.getLogger(PLUGIN_LOGGER), Hold()
    logger.addHandler(handler)
    try:
        yield held
    finally:
        logger.removeHandler(handler)


# ---------------------------------------------------------------------- entry point
def main(argv: list[str] | None = None) -> int:
    try:
        with held_plugin_warnings() as held:
            commands = load_commands()
    except TwinkleError as exc:  # two distributions registering one command name
        print(f"twinkle: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    parser = build_parser(commands)
    args, unparsed = parser.parse_known_args(argv)
    command = commands[args.command][1] if args.command is not None else None
    if command is None or not command.reports_plugin_failures:
        for record in held:
            logging.getLogger(PLUGIN_LOGGER).handle(record)
    if command is None:
        if unparsed:
            parser.error(f"unrecognized arguments: {' '.join(unparsed)}")
        parser.print_help()
        return 0
    rest = command.take_unparsed(args, unparsed)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return run(command, args)


def run(command: Command, args: argparse.Namespace) -> int:
    """Run ``command``, turning Twinkle's errors into a message and an exit status (2: fix the input). Known
    third-party warnings are hidden first (:mod:`twinkle_core.known_warnings`; ``--show-warnings`` where a command
    has it, or ``TWINKLE_SHOW_WARNINGS=1``, shows them)."""
    try:
        quiet_known_warnings(show=bool(getattr(args, "show_warnings", False)))
        return int(command.run(args))
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
