"""``twinkle plot LOGS [--output curves.png]``: the loss curves of a run as a PNG.

``LOGS`` is a run's ``logs.jsonl`` or its output directory. One panel per key: the training value as a line,
its evaluation counterpart (``eval_<key>``) as points on the same panel. By default ``loss`` and, where the
log has them, ``exact_match``, ``reward_mean``, ``accuracy`` and ``completion_length_mean``; ``--keys`` picks.
The drawing is :mod:`twinkle_core.train.curves`, which ``twinkle train`` also uses at the end of a run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from twinkle_core.commands import Command
from twinkle_core.errors import ConfigError

DEFAULT_KEYS = ("loss", "exact_match", "reward_mean", "accuracy", "completion_length_mean")


class PlotCommand(Command):
    description = "Draw the curves of a run's logs.jsonl as a PNG."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("logs", help="logs.jsonl, or the run's output directory holding it")
        parser.add_argument("--output", "-o", metavar="PNG", help="where to write (default: curves.png beside the log)")
        parser.add_argument("--keys", metavar="KEY[,KEY]",
                            help=f"values to draw, one panel each (default: those of {', '.join(DEFAULT_KEYS)} the "
                                 f"log has)")
        parser.add_argument("--title", default=None, help="figure title (default: the run directory's name)")

    def run(self, args: argparse.Namespace) -> int:
        return plot(args)


def plot(args: argparse.Namespace) -> int:
    from twinkle_core.train.curves import CURVES_FILE, numeric_keys, plot_curves
    from twinkle_core.train.logging import LOG_FILE

    log_file = Path(args.logs).expanduser()
    if log_file.is_dir():
        log_file = log_file / LOG_FILE
    if not log_file.is_file():
        raise ConfigError(f"{args.logs!r}: no such log; pass a run's {LOG_FILE} or its output directory "
                          f"(train.output_dir)")
    available = numeric_keys(log_file)
    if args.keys:
        keys = [k.strip() for k in args.keys.split(",") if k.strip()]
        missing = [k for k in keys if k not in available]
        if missing:
            raise ConfigError(f"--keys: {log_file} has no {', '.join(map(repr, missing))}; it has "
                              f"{', '.join(available) or 'no numeric values'}")
    else:
        keys = [k for k in DEFAULT_KEYS if k in available]
        if not keys:
            raise ConfigError(f"{log_file} has none of {', '.join(DEFAULT_KEYS)}; pick values with --keys "
                              f"(it has {', '.join(available) or 'no numeric values'})")
    output = Path(args.output).expanduser() if args.output else log_file.parent / CURVES_FILE
    if output.parent and not output.parent.exists():
        output.parent.mkdir(parents=True, exist_ok=True)
    title = args.title if args.title is not None else log_file.parent.resolve().name
    try:
        path = plot_curves(log_file, keys, output, title=title)
    except ImportError:
        raise ConfigError("twinkle plot draws with matplotlib, which is not installed: pip install matplotlib") \
            from None
    if path is None:
        raise ConfigError(f"{log_file} holds no finite values of {', '.join(keys)} to draw")
    print(f"twinkle: wrote {path}")
    return 0
