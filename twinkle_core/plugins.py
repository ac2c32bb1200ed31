"""Plugin discovery and lookup.

Plugins are found through the ``twinkle`` entry-point group, loaded once per process on first use
(lazy, cached, thread-safe and re-entrant, so every rank may call it freely), and checked against
the hook specifications. One failure policy applies everywhere:

* a plugin that fails to import is reported (name, distribution, one-line reason) and skipped;
* asking for a name nobody registered raises :class:`PluginNotFoundError`, listing what is
  available and the ``pip install`` that provides it;
* two distributions registering the same kind/name raise :class:`DuplicatePluginError`.

Environment:

* ``TWINKLE_DISABLE_PLUGINS=a,b`` — skip the named entry points;
* ``TWINKLE_DISABLE_PLUGIN_AUTOLOAD=1`` — load no entry points, only the core's built-ins and the
  modules named in ``TWINKLE_PLUGINS=pkg.module,...``.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from twinkle_core import hookspecs
from twinkle_core.catalog import install_hint
from twinkle_core.envflags import env_flag, env_list
from twinkle_core.errors import DuplicatePluginError, PluginNotFoundError
from twinkle_core.records import KINDS, PluginRecord

ENTRY_POINT_GROUP = "twinkle"
CORE_PLUGIN_NAME = "twinkle-core"
logger = logging.getLogger("twinkle.plugins")


@dataclass(frozen=True)
class PluginFailure:
    name: str
    distribution: str
    reason: str

    def __str__(self) -> str:
        return f"plugin {self.name!r} from {self.distribution} failed to load and was skipped: {self.reason}"


@dataclass(frozen=True)
class PluginInfo:
    name: str
    distribution: str
    version: str
    module: str


@dataclass(frozen=True)
class Registered:
    """A record together with the plugin that registered it."""

    record: PluginRecord
    plugin: PluginInfo


class TwinklePlugins:
    """The process-wide plugin registry. Use :func:`get_plugins` rather than building one."""

    def __init__(self, *, autoload: bool | None = None, disabled: list[str] | None = None,
                 extra_modules: list[str] | None = None) -> None:
        self.autoload = (not env_flag("TWINKLE_DISABLE_PLUGIN_AUTOLOAD")) if autoload is None else autoload
        self.disabled = set(env_list("TWINKLE_DISABLE_PLUGINS") if disabled is None else disabled)
        self.extra_modules = env_list("TWINKLE_PLUGINS") if extra_modules is None else extra_modules
        self._failures: list[PluginFailure] = []
        self._plugin_info: dict[str, PluginInfo] = {}
        self._pm: pluggy.PluginManager | None = None
        self._records: dict[str, dict[str, Registered]] = {}
        self._lock = threading.RLock()
        self._loading = False

    # ------------------------------------------------------------------ loading
    @property
    def plugins(self) -> dict[str, PluginInfo]:
        """Loaded plugins by name (loads them on first access)."""
        _ = self.pm
        return self._plugin_info

    @property
    def failures(self) -> list[PluginFailure]:
        """Plugins that failed to import and were skipped (loads them on first access)."""
        _ = self.pm
        return self._failures

    @property
    def pm(self) -> pluggy.PluginManager:
        with self._lock:
            if self._pm is None and not self._loading:
                self._load()
            assert self._pm is not None, "plugin manager requested while it is being built"
            return self._pm

    def _load(self) -> None:
        self._loading = True
        try:
            pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
            pm.add_hookspecs(hookspecs)
            self._pm = pm
            from twinkle_core import builtins

            self._register(builtins, PluginInfo(CORE_PLUGIN_NAME, CORE_PLUGIN_NAME, _version("twinkle-core"),
                                                builtins.__name__))
            if self.autoload:
                self._load_entry_points()
            for module_name in self.extra_modules:
                self._load_one(module_name, module_name, "TWINKLE_PLUGINS",
                               lambda m=module_name: importlib.import_module(m))
            pm.check_pending()
        finally:
            self._loading = False

    def _load_entry_points(self) -> None:
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if ep.name in self.disabled:
                logger.info("plugin %r disabled by TWINKLE_DISABLE_PLUGINS", ep.name)
                continue
            dist = ep.dist.name if ep.dist is not None else "unknown distribution"
            self._load_one(ep.name, dist, ep.value, ep.load)

    def _load_one(self, name: str, dist: str, where: str, loader: Any) -> None:
        if name in self._plugin_info:
            return
        try:
            module = loader()
        except Exception as exc:  # reported and skipped: the one failure policy for plugins
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            failure = PluginFailure(name, dist, reason)
            self._failures.append(failure)
            logger.warning("%s", failure)
            return
        self._register(module, PluginInfo(name, dist, _version(dist), getattr(module, "__name__", where)))

    def _register(self, module: Any, info: PluginInfo) -> None:
        assert self._pm is not None
        self._pm.register(module, name=info.name)
        self._plugin_info[info.name] = info

    # ------------------------------------------------------------------ records
    def records(self, kind: str) -> dict[str, Registered]:
        """All registered records of one kind, by name (cached)."""
        if kind not in KINDS:
            raise ValueError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
        with self._lock:
            cached = self._records.get(kind)
            if cached is not None:
                return cached
            found: dict[str, Registered] = {}
            hook = getattr(self.pm.hook, KINDS[kind].register_hook)
            for impl in hook.get_hookimpls():
                info = self._plugin_info.get(impl.plugin_name) or PluginInfo(impl.plugin_name, "unknown", "", "")
                for record in impl.function() or ():
                    self._check_record(kind, record, info)
                    previous = found.get(record.name)
                    if previous is not None:
                        raise DuplicatePluginError(
                            f"{kind} {record.name!r} is registered twice: by {previous.plugin.distribution} "
                            f"(plugin {previous.plugin.name!r}) and by {info.distribution} "
                            f"(plugin {info.name!r}); uninstall one or disable it with "
                            f"TWINKLE_DISABLE_PLUGINS={info.name}"
                        )
                    found[record.name] = Registered(record, info)
            self._records[kind] = found
            return found

    @staticmethod
    def _check_record(kind: str, record: Any, info: PluginInfo) -> None:
        expected = KINDS[kind]
        if not isinstance(record, expected):
            raise TypeError(f"plugin {info.name!r} ({info.distribution}) yielded {record!r} from "
                            f"{expected.register_hook}; expected {expected.__name__} records")

    def names(self, kind: str) -> list[str]:
        return sorted(self.records(kind))

    def get(self, kind: str, name: str) -> PluginRecord:
        entry = self.records(kind).get(name)
        if entry is None:
            raise PluginNotFoundError(kind, name, self.names(kind), install_hint(kind, name))
        return entry.record

    def load(self, kind: str, name: str) -> Any:
        """Import and return the implementation registered as ``kind``/``name``."""
        return self.get(kind, name).load()

    # ------------------------------------------------------------------ selection
    def select_accelerator(self) -> PluginRecord:
        accelerators = {n: r.record for n, r in self.records("accelerator").items()}
        chosen = self.pm.hook.twinkle_select_accelerator(accelerators=accelerators)
        if chosen is None:
            raise PluginNotFoundError("accelerator", "<detected>", list(accelerators), None)
        return chosen

    def select_source(self, uri: str) -> PluginRecord:
        sources = {n: r.record for n, r in self.records("source").items()}
        chosen = self.pm.hook.twinkle_select_source(uri=uri, sources=sources)
        if chosen is None:
            scheme = uri.split("://", 1)[0] if "://" in uri else "local"
            raise PluginNotFoundError("source", scheme, list(sources), install_hint("source", scheme))
        return chosen


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


_plugins: TwinklePlugins | None = None
_plugins_lock = threading.Lock()


def get_plugins() -> TwinklePlugins:
    """The process-wide registry, created on first call."""
    global _plugins
    with _plugins_lock:
        if _plugins is None:
            _plugins = TwinklePlugins()
        return _plugins


def reset_plugins(plugins: TwinklePlugins | None = None) -> None:
    """Forget the cached registry (tests use this after changing the environment)."""
    global _plugins
    with _plugins_lock:
        _plugins = plugins
