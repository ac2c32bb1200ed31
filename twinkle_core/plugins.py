"""Plugin discovery and lookup.

Plugins are found through the ``twinkle`` entry-point group, loaded once per process on first use
(lazy, cached, thread-safe and re-entrant, so every rank may call it freely), and checked against
the hook specifications. One failure policy applies everywhere:

* a faulty plugin is reported (name, distribution, one-line reason), unregistered and skipped: one
  that fails to import (``SystemExit`` included), implements a hook that does not exist (a misspelled
  ``twinkle_register_*``), asks a hook for arguments its specification lacks, or whose registration
  hook raises;
* a record whose implementation cannot be imported raises :class:`PluginLoadError`, naming the
  plugin, its distribution, the record and the module;
* asking for a name nobody registered raises :class:`PluginNotFoundError`, listing what is
  available and the ``pip install`` that provides it;
* two distributions registering the same kind/name raise :class:`DuplicatePluginError`.

Environment:

* ``TWINKLE_DISABLE_PLUGINS=a,b`` — skip the named entry points;
* ``TWINKLE_DISABLE_PLUGIN_AUTOLOAD=1`` — load no entry points, only the core's built-ins and the
  modules named in ``TWINKLE_PLUGINS=pkg.module,...``.
"""

from __future__ import annotations

import difflib
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
from twinkle_core.errors import DuplicatePluginError, PluginNotFoundError, TwinkleError
from twinkle_core.records import KINDS, PluginRecord

ENTRY_POINT_GROUP = "twinkle"
CORE_PLUGIN_NAME = "twinkle-core"
logger = logging.getLogger("twinkle.plugins")
# what a plugin's own code may raise and still be reported and skipped; KeyboardInterrupt still stops
PLUGIN_FAULTS = (Exception, SystemExit)


class PluginLoadError(TwinkleError, ImportError):
    """A registered record's implementation could not be imported. The message names the plugin."""


class PluginHookError(TwinkleError, RuntimeError):
    """A plugin's hook raised when called. The message names the plugin and its distribution."""


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
        except PLUGIN_FAULTS as exc:  # reported and skipped: the one failure policy for plugins
            self._fail(PluginFailure(name, dist, _reason(exc)))
            return
        self._register(module, PluginInfo(name, dist, _version(dist), getattr(module, "__name__", where)))

    def _register(self, module: Any, info: PluginInfo) -> None:
        """Register one plugin inside its own failure boundary: a faulty one is reported and skipped."""
        assert self._pm is not None
        if self._pm.is_registered(module):  # e.g. an entry point also named in TWINKLE_PLUGINS
            logger.info("plugin %r: module %s is already registered", info.name, info.module)
            return
        try:
            self._pm.register(module, name=info.name)
            self._check_hook_names(module)
        except (pluggy.PluginValidationError, ValueError) as exc:
            self._fail(PluginFailure(info.name, info.distribution, _reason(exc)), module)
            return
        self._plugin_info[info.name] = info

    def _check_hook_names(self, module: Any) -> None:
        """Reject hooks no specification declares (a misspelled ``twinkle_register_*``)."""
        assert self._pm is not None
        known = [name for name, caller in vars(self._pm.hook).items() if caller.has_spec()]
        for caller in self._pm.get_hookcallers(module) or ():
            optional = all(impl.optionalhook for impl in caller.get_hookimpls() if impl.plugin is module)
            if caller.has_spec() or optional:
                continue
            close = difflib.get_close_matches(caller.name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known hooks: {', '.join(sorted(known))}"
            raise pluggy.PluginValidationError(module, f"unknown hook {caller.name!r}{hint}")

    def _fail(self, failure: PluginFailure, plugin: Any = None) -> None:
        """Record ``failure``, unregister ``plugin`` and drop any records it already contributed."""
        self._failures.append(failure)
        logger.warning("%s", failure)
        self._plugin_info.pop(failure.name, None)
        if plugin is not None and self._pm is not None and self._pm.is_registered(plugin):
            self._pm.unregister(plugin)
        for cached in self._records.values():
            for name in [n for n, entry in cached.items() if entry.plugin.name == failure.name]:
                del cached[name]

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
            hook_name = KINDS[kind].register_hook
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if not self.pm.is_registered(impl.plugin):  # failed in a re-entrant call meanwhile
                    continue
                info = self._plugin_info.get(impl.plugin_name) or PluginInfo(impl.plugin_name, "unknown", "", "")
                for record in self._registered_by(kind, impl, info):
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

    def _registered_by(self, kind: str, impl: Any, info: PluginInfo) -> list[PluginRecord]:
        """The records one plugin's ``twinkle_register_<kind>`` hook yields; none when the hook raises or yields
        anything but records of ``kind`` (the plugin is then reported by name, unregistered and skipped)."""
        hook_name = KINDS[kind].register_hook
        try:
            result = impl.function()
            wrong = result_problem(kind, result)
            produced = [] if wrong or result is None else list(result)
        except PLUGIN_FAULTS as exc:
            self._fail(PluginFailure(info.name, info.distribution, f"{hook_name} raised {_reason(exc)}"), impl.plugin)
            return []
        wrong = wrong or next(filter(None, (record_problem(kind, record) for record in produced)), None)
        if wrong:
            self._fail(PluginFailure(info.name, info.distribution, wrong), impl.plugin)
            return []
        return produced

    def names(self, kind: str) -> list[str]:
        return sorted(self.records(kind))

    def get(self, kind: str, name: str) -> PluginRecord:
        entry = self.records(kind).get(name)
        if entry is None:
            raise PluginNotFoundError(kind, name, self.names(kind), install_hint(kind, name))
        return entry.record

    def load(self, kind: str, name: str) -> Any:
        """Import and return the implementation registered as ``kind``/``name``."""
        return self.load_record(kind, self.get(kind, name))

    def load_record(self, kind: str, record: PluginRecord) -> Any:
        """``record.load()``, with an import failure naming the plugin and distribution that registered it."""
        try:
            return record.load()
        except TwinkleError:
            raise
        except PLUGIN_FAULTS as exc:
            entry = self.records(kind).get(record.name)
            owner = (f"plugin {entry.plugin.name!r} ({entry.plugin.distribution})" if entry is not None
                     and entry.record == record else "its plugin")
            module = record.impl.partition(":")[0]
            raise PluginLoadError(
                f"{kind} {record.name!r} registered by {owner} cannot be loaded: its implementation "
                f"{record.impl!r} (module {module!r}) failed to import: {_reason(exc)}. Reinstall or upgrade "
                f"that distribution, or disable the plugin with TWINKLE_DISABLE_PLUGINS"
            ) from exc

    # ------------------------------------------------------------------ selection
    def select_accelerator(self) -> PluginRecord:
        accelerators = {n: r.record for n, r in self.records("accelerator").items()}
        chosen = self._select("twinkle_select_accelerator", accelerators=accelerators)
        if chosen is None:
            raise PluginNotFoundError("accelerator", "<detected>", list(accelerators), None)
        return chosen

    def select_source(self, uri: str) -> PluginRecord:
        sources = {n: r.record for n, r in self.records("source").items()}
        chosen = self._select("twinkle_select_source", uri=uri, sources=sources)
        if chosen is None:
            scheme = uri.split("://", 1)[0] if "://" in uri else "local"
            raise PluginNotFoundError("source", scheme, list(sources), install_hint("source", scheme))
        return chosen

    def select_default_strategy(self, model_class: type | None, world_size: int) -> str | None:
        """The strategy the plugins choose for ``model_class`` on ``world_size`` processes (``None``: no answer)."""
        return self._select("twinkle_select_default_strategy", model_class=model_class, world_size=world_size)

    def _select(self, hook_name: str, **kwargs: Any) -> Any:
        """Call a ``twinkle_select_*`` hook; a plugin raising in it is named in a :class:`PluginHookError`."""
        caller = getattr(self.pm.hook, hook_name)
        try:
            return caller(**kwargs)
        except PLUGIN_FAULTS as exc:
            if isinstance(exc, TwinkleError):
                raise
            codes = {impl.function.__code__: impl.plugin_name for impl in caller.get_hookimpls()
                     if hasattr(impl.function, "__code__")}
            tb, culprit = exc.__traceback__, None
            while tb is not None and culprit is None:
                culprit = codes.get(tb.tb_frame.f_code)
                tb = tb.tb_next
            info = self._plugin_info.get(culprit) if culprit else None
            who = f"plugin {info.name!r} ({info.distribution})" if info else f"plugin {culprit or '(unknown)'!r}"
            raise PluginHookError(f"{who} raised in {hook_name}: {_reason(exc)}; fix or upgrade it, or disable "
                                  f"it with TWINKLE_DISABLE_PLUGINS") from exc


def _shown(value: Any) -> str:
    """``value`` for a message: its (shortened) repr and its type."""
    text = repr(value)
    text = text if len(text) <= 80 else f"{text[:77]}..."
    return f"{text} (a {type(value).__name__})"


def _expected(kind: str) -> str:
    record_type = KINDS[kind]
    return (f"it must yield {record_type.__name__} records, e.g. yield {record_type.__name__}(\"name\", "
            f"\"package.module:Object\") (from twinkle_core.records)")


def result_problem(kind: str, result: Any) -> str | None:
    """What is wrong with the value a ``twinkle_register_<kind>`` hook returned (``None``: an iterable of items, or
    nothing). A record, a string or a mapping returned rather than yielded is wrong: iterating it gives no records."""
    hook_name = KINDS[kind].register_hook
    if result is None:
        return None
    if isinstance(result, (PluginRecord, str, bytes, dict)) or not hasattr(result, "__iter__"):
        return f"{hook_name} returned {_shown(result)} instead of yielding records; {_expected(kind)}"
    return None


def record_problem(kind: str, record: Any) -> str | None:
    """What is wrong with one item a ``twinkle_register_<kind>`` hook yielded (``None``: a well-formed record)."""
    hook_name = KINDS[kind].register_hook
    if not isinstance(record, KINDS[kind]):
        other = next((t for t in KINDS.values() if type(record) is t), None)
        where = f"; a {other.__name__} belongs in {other.register_hook}" if other is not None else ""
        return f"{hook_name} yielded {_shown(record)}{where}; {_expected(kind)}"
    if not isinstance(record.name, str) or not record.name:
        return f"{hook_name} yielded {type(record).__name__} with name {record.name!r}; the name must be a non-empty string"
    if not isinstance(record.impl, str) or ":" not in record.impl:
        return (f"{hook_name} yielded {type(record).__name__} {record.name!r} with impl {record.impl!r}; impl must be "
                f"a string \"package.module:Object\"")
    return None


def _reason(exc: BaseException) -> str:
    """One line: the exception's type and message (a multi-line message joined with '; ')."""
    if isinstance(exc, SystemExit):
        return f"SystemExit: called sys.exit({exc.code!r})"
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
