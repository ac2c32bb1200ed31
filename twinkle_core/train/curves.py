"""Training curves as a picture: ``output_dir/curves.png`` from ``logs.jsonl``, written at the end of a run.

One panel per logged value: the training loss, what the task names in ``Task.curve_keys`` (an RL task's
reward mean and accuracy) and, for each of those, its evaluation counterpart (``eval_<key>``) drawn on the
same panel as points. Needs matplotlib (``pip install matplotlib``); without it nothing is drawn and the
run says so once, at debug level, since the numbers are all in ``logs.jsonl`` anyway.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("twinkle.train")

CURVES_FILE = "curves.png"


def read_records(log_file: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of ``log_file``, one a line. A line that is not one (cut by a crash, not valid UTF-8, not an
    object) is skipped: the rest of the log still draws."""
    records = []
    for raw in Path(log_file).read_bytes().splitlines():
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_series(log_file: Path, keys: Sequence[str]) -> dict[str, list[tuple[int, float]]]:
    """``{key: [(step, value), ...]}`` for each key of ``train`` lines and ``eval_<key>`` of ``eval`` lines (a
    record whose ``step`` is not a number is skipped)."""
    series: dict[str, list[tuple[int, float]]] = {}
    wanted = set(keys) | {f"eval_{k}" for k in keys}
    for record in read_records(log_file):
        step = record.get("step", 0)
        if not _is_number(step) or not math.isfinite(step):
            continue
        for key, value in record.items():
            if key in wanted and _is_number(value) and math.isfinite(value):
                series.setdefault(key, []).append((int(step), float(value)))
    return series


def write_curves(output_dir: str | Path, keys: Sequence[str], *, title: str = "") -> Path | None:
    """Draw ``keys`` (and their ``eval_`` counterparts) from ``output_dir/logs.jsonl``; the PNG's path, or None."""
    from twinkle_core.train.logging import LOG_FILE

    log_file = Path(output_dir) / LOG_FILE
    if not log_file.is_file():
        return None
    try:
        return plot_curves(log_file, keys, Path(output_dir) / CURVES_FILE, title=title)
    except ImportError:
        logger.debug("matplotlib is not installed: no %s (pip install matplotlib)", CURVES_FILE)
        return None


def plot_curves(log_file: str | Path, keys: Sequence[str], output: str | Path, *, title: str = "") -> Path | None:
    """Draw ``keys`` (and their ``eval_`` counterparts) from ``log_file`` into the PNG ``output``; its path, or
    None when the log has none of them. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    series = read_series(Path(log_file), keys)
    panels = [k for k in keys if k in series or f"eval_{k}" in series]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], panels, strict=True):
        _draw(ax, key, series)
    axes[-1, 0].set_xlabel("optimizer step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(output)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def numeric_keys(log_file: str | Path) -> list[str]:
    """The numeric values ``log_file`` holds, in first-seen order (``eval_x`` named as ``x``)."""
    seen: dict[str, None] = {}
    for record in read_records(log_file):
        for key, value in record.items():
            if key != "step" and _is_number(value):
                seen.setdefault(key[5:] if key.startswith("eval_") else key, None)
    return list(seen)


def _draw(ax: Any, key: str, series: dict[str, list[tuple[int, float]]]) -> None:
    if key in series:
        steps, values = zip(*series[key], strict=True)
        ax.plot(steps, values, label=f"train {key}", linewidth=1.2)
    if f"eval_{key}" in series:
        steps, values = zip(*series[f"eval_{key}"], strict=True)
        ax.plot(steps, values, "o--", label=f"eval {key}", markersize=4)
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
