"""The commands for after training: ``twinkle chat``, ``export``, ``eval`` and ``plot``.

One module per command, each with ``add_parser(subparsers)`` and ``run(args) -> exit code``. Importing
this package (and building the parser) imports neither torch nor transformers: each command imports them
when it runs.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

# command name -> module under twinkle_core.commands
COMMANDS = {"chat": "chat", "export": "export", "eval": "evaluate", "plot": "plot"}


def add_parsers(sub: Any) -> None:
    for module in COMMANDS.values():
        importlib.import_module(f"twinkle_core.commands.{module}").add_parser(sub)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(f"twinkle_core.commands.{COMMANDS[args.command]}").run(args))
