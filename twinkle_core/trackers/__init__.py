"""Experiment trackers: where a run's metrics go besides ``output_dir/logs.jsonl`` (which is always written).

A recipe picks them with ``train.report_to`` (a name or a list: ``[tensorboard, wandb]``) and configures each
with ``train.tracker_options`` (``{wandb: {project: my-project, mode: offline}}``). Built in: ``tensorboard``,
``wandb``, ``mlflow`` and ``swanlab``; a plugin adds more through ``twinkle_register_trackers``. Trackers run on
the main process only.

A tracker is a :class:`Tracker` subclass. Its library is imported inside its methods, never at module level, and
named in ``requires`` (``{"wandb": "pip install wandb"}``): a missing library is reported when the recipe is
validated (``twinkle train --dry-run``), before anything is built. A tracker that fails to start is an error before
the first step; one that fails while logging is warned about once and training goes on.

Every train/eval log line goes to the trackers as ``train/<key>`` / ``eval/<key>`` (loss, lr, grad_norm, a loss's
own metrics such as ``rewards/chosen``), at the optimizer step.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError, TwinkleError

logger = logging.getLogger("twinkle.train")

#: ``report_to`` names that mean "no tracker besides the JSONL log" (which is always on)
ALWAYS_ON = "jsonl"
NONE_NAMES = frozenset({"none", "jsonl"})

__all__ = ["Tracker", "TrackerError", "TrackerSet", "check_trackers", "flatten", "open_trackers",
           "tracker_names"]


class TrackerError(TwinkleError, RuntimeError):
    """A tracker could not start (bad options, an unreachable server, a broken install)."""


class Tracker(ABC):
    """One experiment tracker, constructed with its ``train.tracker_options[name]`` as keyword arguments.

    Subclasses implement :meth:`start`, :meth:`log` and :meth:`finish`; the constructor should only store its
    options (and may check them, raising :class:`~twinkle_core.errors.ConfigError`).
    """

    #: the importable modules it needs, with how to install each (checked at validation time)
    requires: Mapping[str, str] = {}

    def __init__(self, **options: Any) -> None:
        self.options = options

    def init_options(self, run_name: str, *, project_env: str, dir_key: str, dir_env: str,
                     default_dir: str) -> dict[str, Any]:
        """The options given (``None`` dropped) completed the way the hosted trackers agree on: the run is named
        after the output directory, the project defaults to ``$project_env`` or ``twinkle``, and the local files go
        to ``default_dir`` unless the option ``dir_key`` or the library's own ``$dir_env`` says otherwise."""
        kwargs = {key: value for key, value in self.options.items() if value is not None}
        kwargs.setdefault("name", run_name)
        kwargs.setdefault("project", os.environ.get(project_env) or "twinkle")
        if dir_key not in kwargs and not os.environ.get(dir_env):
            kwargs[dir_key] = default_dir
        return kwargs

    @abstractmethod
    def start(self, run_config: dict[str, Any], output_dir: str | os.PathLike[str], run_name: str) -> None:
        """Open the run; ``run_config`` is the recipe as a dict (log it as the run's params/config)."""

    @abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record scalar ``metrics`` (``{"train/loss": 2.3, "train/lr": 1e-4}``) at optimizer step ``step``."""

    @abstractmethod
    def finish(self, status: str) -> None:
        """Close the run; ``status`` is ``success``, ``failed`` or ``interrupted``."""


def tracker_names(report_to: str | Iterable[str] | None) -> list[str] | None:
    """The tracker names ``report_to`` asks for (``None``: not set, the default applies). ``jsonl``/``none`` add no
    tracker (the JSONL log is always written)."""
    if report_to is None:
        return None
    items = [report_to] if isinstance(report_to, str) else list(report_to)
    names: list[str] = []
    for item in items:
        name = str(item).strip()
        if name.lower() in NONE_NAMES or not name or name in names:
            continue
        names.append(name)
    return names


def default_trackers() -> list[str]:
    """Without ``report_to``: TensorBoard when it is installed (and ``TWINKLE_TENSORBOARD`` is not 0), as before."""
    from twinkle_core.envflags import env_flag

    if env_flag("TWINKLE_TENSORBOARD", True) and _installed("tensorboard"):
        return ["tensorboard"]
    return []


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _missing_requirements(cls: Any) -> list[str]:
    return [hint or f"pip install {module}" for module, hint in dict(getattr(cls, "requires", {}) or {}).items()
            if not _installed(module)]


def check_trackers(report_to: Any, tracker_options: Mapping[str, Any] | None = None, plugins: Any = None,
                   *, key: str = "train.report_to") -> list[str]:
    """Check that every tracker ``report_to`` names is registered and its library installed, that
    ``tracker_options`` names registered trackers, and that the options of those in use bind to their constructor;
    returns the names of the trackers in use. Imports no tracking library."""
    from twinkle_core.errors import PluginNotFoundError

    if plugins is None:
        from twinkle_core.plugins import get_plugins

        plugins = get_plugins()
    names = tracker_names(report_to)
    if names is None:
        names = default_trackers()
    for name in names:
        try:
            plugins.get("tracker", name)
        except PluginNotFoundError as exc:
            exc.args = (f"{key}: {exc} (jsonl is always written; another tracker needs a plugin that registers it "
                        "through twinkle_register_trackers)",)
            raise
        cls = plugins.load("tracker", name)
        if not (isinstance(cls, type) and issubclass(cls, Tracker)):
            raise ConfigError(f"{key}: the tracker {name!r} ({plugins.get('tracker', name).impl}) is not a "
                              "twinkle_core.trackers.Tracker subclass")
        missing = _missing_requirements(cls)
        if missing:
            raise ConfigError(f"{key}: the tracker {name!r} needs a library that is not installed; install it "
                              f"with: {'; '.join(missing)}")
    for name, options in dict(tracker_options or {}).items():
        where = f"train.tracker_options.{name}"
        if not isinstance(options, Mapping):
            raise ConfigError(f"{where}: expected a mapping of options, got {type(options).__name__}")
        try:
            plugins.get("tracker", name)
        except PluginNotFoundError as exc:
            exc.args = (f"{where}: {exc}",)
            raise
        if name in names:  # options of a tracker not in use are kept but not checked (report_to may be overridden)
            from twinkle_core.options import check_options

            check_options(plugins.load("tracker", name), options, where=where)
    return names


class _Slot:
    def __init__(self, name: str, tracker: Tracker) -> None:
        self.name, self.tracker = name, tracker
        self.failures = 0
        self.calls = 0


class TrackerSet:
    """The started trackers of one run: logging fans out to each; a failure is warned about once per tracker."""

    def __init__(self, slots: list[_Slot] | None = None) -> None:
        self.slots = slots or []

    @property
    def names(self) -> list[str]:
        return [slot.name for slot in self.slots]

    def __bool__(self) -> bool:
        return bool(self.slots)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not metrics:
            return
        for slot in self.slots:
            slot.calls += 1
            try:
                slot.tracker.log(dict(metrics), int(step))
            except Exception as exc:  # a tracker's outage must not stop training
                slot.failures += 1
                if slot.failures == 1:
                    logger.warning("tracker %r failed to log step %d (%s: %s); training goes on, later failures "
                                   "of this tracker are not reported one by one", slot.name, step,
                                   type(exc).__name__, exc)

    def finish(self, status: str) -> None:
        for slot in self.slots:
            if slot.failures:
                logger.warning("tracker %r: %d of %d log calls failed", slot.name, slot.failures, slot.calls)
            try:
                slot.tracker.finish(status)
            except Exception as exc:
                logger.warning("tracker %r failed to finish the run (%s: %s)", slot.name, type(exc).__name__, exc)
        self.slots = []


def open_trackers(report_to: Any, tracker_options: Mapping[str, Any] | None, *, run_config: dict[str, Any],
                  output_dir: str | os.PathLike[str], run_name: str | None = None,
                  plugins: Any = None) -> TrackerSet:
    """Construct and start the trackers ``report_to`` names. A tracker that cannot start raises
    :class:`TrackerError` (the ones already started are finished as ``failed``); when ``report_to`` is not set,
    the default TensorBoard tracker failing to start is only warned about, as before trackers existed."""
    explicit = tracker_names(report_to) is not None
    if tracker_names(report_to) == [] and not tracker_options:
        return TrackerSet()
    if plugins is None:
        from twinkle_core.plugins import get_plugins

        plugins = get_plugins()
    names = check_trackers(report_to, tracker_options, plugins)
    options = dict(tracker_options or {})
    run_name = run_name or Path(output_dir).resolve().name
    started = TrackerSet()
    for name in names:
        cls = plugins.load("tracker", name)
        try:
            tracker = cls(**dict(options.get(name) or {}))
            tracker.start(run_config, output_dir, run_name)
        except Exception as exc:
            if not explicit:
                logger.warning("%s logging disabled: %s: %s", name, type(exc).__name__, exc)
                continue
            started.finish("failed")
            if isinstance(exc, ConfigError):
                raise ConfigError(f"train.tracker_options.{name}: {exc}") from exc
            raise TrackerError(f"the tracker {name!r} (train.report_to) could not start: {type(exc).__name__}: "
                               f"{exc}") from exc
        started.slots.append(_Slot(name, tracker))
    return started


def flatten(config: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (for trackers whose params are flat)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path, sep))
        else:
            out[path] = value
    return out
