"""``twinkle plot LOGS [--output curves.png]``: the loss curves of a run as a PNG.

``LOGS`` is a run's ``logs.jsonl`` or its output directory. One panel per key: the training value as a line,
its evaluation counterpart (``eval_<key>``) as points on the same panel. By default ``loss`` and, where the
log has them, ``exact_match``, ``reward_mean``, ``accuracy`` and ``completion_length_mean``; ``--keys`` picks.
The drawing is :mod:`twinkle_core.train.curves`, which ``twinkle train`` also uses at the end of a run.

``--output`` is a picture file whose suffix names the format (``.png``, ``.svg``, ``.pdf`` ...), never a directory
or the log itself. Lines of the log that are not JSON objects (one cut by a crash) are skipped; a log with none,
an unknown ``--keys`` value and an output that cannot be written are each one error naming the file and the fix.
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
        parser.add_argument("--output", "-o", metavar="PNG", help="the picture file; its suffix names the format: .png, .svg, .pdf ... "
                                 "(default: curves.png beside the log)")
        parser.add_argument("--keys", metavar="KEY[,KEY]",
                            help=f"values to draw, one panel each (default: those of {', '.join(DEFAULT_KEYS)} the "
                                 f"log has)")
        parser.add_argument("--title", default=None, help="figure title (default: the run directory's name)")

    def run(self, args: argparse.Namespace) -> int:
        return plot(args)


def plot(args: argparse.Namespace) -> int:
    from twinkle_core.train.curves import numeric_keys, plot_curves, read_records

    log_file = checked_log(args.logs)
    if not read_records(log_file):
        raise ConfigError(f"{log_file} holds no log records (it is empty, or no line is a JSON object): pass the "
                          f"{log_file.name} of a run that logged at least one step")
    keys = checked_keys(args.keys, log_file, numeric_keys(log_file))
    output = checked_output(args.output, log_file)
    title = args.title if args.title is not None else log_file.parent.resolve().name
    try:
        path = plot_curves(log_file, keys, output, title=title)
    except OSError as exc:
        raise ConfigError(f"--output {output}: could not write it ({exc.strerror or exc}); choose a writable path") \
            from None
    if path is None:
        raise ConfigError(f"{log_file} holds no finite values of {', '.join(keys)} to draw (only NaN or infinity): "
                          f"pick others with --keys")
    print(f"twinkle: wrote {path}")
    return 0


def checked_log(logs: str) -> Path:
    """The log file ``logs`` names: the file itself, or ``logs.jsonl`` in the run directory it names."""
    from twinkle_core.train.logging import LOG_FILE

    log_file = Path(logs).expanduser()
    if log_file.is_dir():
        log_file = log_file / LOG_FILE
    if not log_file.is_file():
        raise ConfigError(f"{str(log_file)!r}: no such log; pass a run's {LOG_FILE} or its output directory "
                          f"(train.output_dir)")
    return log_file


def checked_keys(keys_arg: str | None, log_file: Path, available: list[str]) -> list[str]:
    """The values to draw: those ``--keys`` names (each one the log has), else the defaults the log has."""
    has = ", ".join(available) or "no numeric values"
    if keys_arg is None:
        keys = [k for k in DEFAULT_KEYS if k in available]
        if not keys:
            raise ConfigError(f"{log_file} has none of {', '.join(DEFAULT_KEYS)}; pick values with --keys (it has "
                              f"{has})")
        return keys
    keys = [k.strip() for k in keys_arg.split(",") if k.strip()]
    if not keys:
        raise ConfigError(f"--keys {keys_arg!r} names no values; write them comma-separated, e.g. --keys loss "
                          f"(the log has {has})")
    missing = [k for k in keys if k not in available]
    if missing:
        raise ConfigError(f"--keys: {log_file} has no {', '.join(map(repr, missing))}; it has {has}")
    return keys


def checked_output(output_arg: str | None, log_file: Path) -> Path:
    """Where the picture goes, checked before drawing: a file (never a directory or the log itself) whose suffix
    names a format matplotlib writes; its directory is made when missing."""
    from twinkle_core.train.curves import CURVES_FILE

    formats = image_formats()  # matplotlib is needed whatever the output
    if not output_arg:
        return log_file.parent / CURVES_FILE
    output = Path(output_arg).expanduser()
    if output.is_dir():
        raise ConfigError(f"--output {output_arg} is a directory; pass a file path such as {output / CURVES_FILE}")
    if output.resolve() == log_file.resolve():
        raise ConfigError(f"--output {output_arg} is the log being drawn; choose another file such as {CURVES_FILE}")
    if output.suffix.lower().lstrip(".") not in formats:
        raise ConfigError(f"--output {output_arg}: name a picture file ending in .png (or one of "
                          f"{', '.join('.' + f for f in formats)})")
    for parent in output.resolve().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"--output {output_arg}: {parent} is a file, not a directory; choose another path")
            break
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--output {output_arg}: could not make {output.parent} ({exc.strerror or exc}); choose a "
                          f"writable path") from None
    return output


def image_formats() -> list[str]:
    """The file formats matplotlib writes (png, svg, pdf, ...)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ConfigError("twinkle plot draws with matplotlib, which is not installed: pip install matplotlib") \
            from None
    return sorted(FigureCanvasBase.get_supported_filetypes())
