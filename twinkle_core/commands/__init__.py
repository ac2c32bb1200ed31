"""The ``twinkle`` sub-commands: the contract a command implements, and the core's own commands.

Every command is registered through ``twinkle_register_commands`` with a
:class:`~twinkle_core.records.CommandRecord`, the core's included (``train``, ``plugins``, ``plot``: one module
each here); ``chat``, ``export`` and ``eval`` come with ``twinkle-backend-hf``, which owns transformers and peft.
A command module imports nothing heavy at import time (the parser of every command is built on each call of
``twinkle``, ``twinkle --help`` included): torch and the rest are imported inside :meth:`Command.run`.

A command of your own::

    class ServeCommand(Command):
        description = "Serve a checkpoint over HTTP."

        def add_arguments(self, parser):
            parser.add_argument("checkpoint")

        def run(self, args):
            from my_pkg.server import serve  # heavy imports here

            serve(args.checkpoint)
            return 0
"""

from __future__ import annotations

import argparse
from typing import ClassVar


class Command:
    """A ``twinkle NAME`` sub-command. Subclasses set :attr:`description` and implement :meth:`run`."""

    #: the text of ``twinkle NAME --help`` (the one-line help is the record's ``description``)
    description: ClassVar[str] = ""
    #: whether the command lists plugin load failures itself (``twinkle plugins``), so the CLI does not also
    #: print them as warnings
    reports_plugin_failures: ClassVar[bool] = False

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the command's arguments to its parser (no heavy imports here)."""

    def take_unparsed(self, args: argparse.Namespace, unparsed: list[str]) -> list[str]:
        """Arguments the parser did not recognise; keep those the command understands (on ``args``) and return
        the rest, which are an error. Default: none are understood."""
        return unparsed

    def run(self, args: argparse.Namespace) -> int:
        """Do the work; return the exit status. A :class:`~twinkle_core.errors.ConfigError` exits with 2."""
        raise NotImplementedError(f"{type(self).__name__} does not implement run()")


def take_recipe_overrides(args: argparse.Namespace, unparsed: list[str]) -> list[str]:
    """:meth:`Command.take_unparsed` of a command with recipe overrides (``args.overrides``): ``KEY=VALUE`` items
    may also come after options (``RECIPE --resume latest a.b=1``); the first other item is returned as an error."""
    args.overrides = list(getattr(args, "overrides", []))
    for item in unparsed:
        if item.startswith("-") or "=" not in item:
            return [item]
        args.overrides.append(item)
    return []
