"""``twinkle plugins [--json] [--probe]``: the installed plugins, what each registers, and those that failed.

It imports neither torch nor any backend (``--probe`` imports torch and each accelerator's runtime).
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from twinkle_core.commands import Command
from twinkle_core.errors import TwinkleError


class PluginsCommand(Command):
    description = ("List the installed Twinkle plugins (entry-point group 'twinkle'), what each registers, and the "
                   "plugins that failed to load.")
    reports_plugin_failures = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
        parser.add_argument("--probe", action="store_true",
                            help="also import torch and each accelerator's runtime to tell which one is active")

    def run(self, args: argparse.Namespace) -> int:
        # failures are part of the listing below; do not also print them as stray warnings
        logging.getLogger("twinkle.plugins").addHandler(logging.NullHandler())
        data = collect_plugins(probe=args.probe)
        print(json.dumps(data, indent=2) if args.json else format_plugins(data))
        return 1 if data["problems"] else 0


def collect_plugins(plugins: Any = None, probe: bool = False) -> dict[str, Any]:
    """What ``twinkle plugins`` shows, as plain data (``probe``: check the accelerators' devices too)."""
    from twinkle_core.accelerator import accelerator_statuses
    from twinkle_core.plugins import get_plugins

    plugins = plugins if plugins is not None else get_plugins()
    # first collect the records: a plugin whose registration hook raises is reported among the
    # failures and unregistered, so the listing below no longer calls it
    problems = _collect_records(plugins)
    registers = _registrations(plugins, problems)
    listed = [{"name": name, "distribution": info.distribution, "version": info.version, "module": info.module,
               "registers": registers.get(name, {})} for name, info in plugins.plugins.items()]
    return {
        "plugins": listed,
        "accelerators": accelerator_statuses(plugins, probe=probe),
        "failures": [{"name": f.name, "distribution": f.distribution, "reason": f.reason} for f in plugins.failures],
        "problems": problems,
        "disabled": sorted(plugins.disabled),
        "autoload": plugins.autoload,
    }


def _collect_records(plugins: Any) -> list[str]:
    from twinkle_core.records import KINDS

    problems: list[str] = []
    for kind in KINDS:
        try:
            plugins.records(kind)
        except TwinkleError as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
        except TypeError as exc:
            problems.append(f"TypeError: {exc}")
    return problems


def _registrations(plugins: Any, problems: list[str]) -> dict[str, dict[str, list[dict[str, str]]]]:
    """``{plugin: {kind: [{name, impl, description}]}}``, each plugin's hooks called again on their own (so a
    duplicate name is listed under both plugins that register it)."""
    from twinkle_core.plugins import PLUGIN_FAULTS
    from twinkle_core.records import KINDS

    registers: dict[str, dict[str, list[dict[str, str]]]] = {}
    for kind, record_type in KINDS.items():
        hook_name = record_type.register_hook
        for impl in getattr(plugins.pm.hook, hook_name).get_hookimpls():
            try:
                records = list(impl.function() or ())
            except PLUGIN_FAULTS as exc:  # a plugin's hook raising is reported, not fatal
                problems.append(f"plugin {impl.plugin_name!r}: {hook_name} raised {type(exc).__name__}: {exc}")
                continue
            entries = registers.setdefault(impl.plugin_name, {}).setdefault(kind, [])
            entries.extend({"name": str(getattr(r, "name", r)), "impl": str(getattr(r, "impl", "")),
                            "description": str(getattr(r, "description", ""))} for r in records)
    return registers


def format_plugins(data: dict[str, Any]) -> str:
    """The text of ``twinkle plugins``: the table of plugins, then the accelerators, settings and failures."""
    return "\n".join([*_plugin_table(data["plugins"]), *_accelerator_lines(data["accelerators"]),
                      *_settings_lines(data), *_failure_lines(data["failures"]), *_problem_lines(data["problems"])])


def _plugin_table(plugins: list[dict[str, Any]]) -> list[str]:
    rows = [("PLUGIN", "DISTRIBUTION", "VERSION", "REGISTERS")]
    extra_lines: list[list[str]] = [[]]
    for plugin in plugins:
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
    return lines


def _accelerator_lines(accelerators: list[dict[str, Any]]) -> list[str]:
    if not accelerators:
        return []
    probed = all(a["status"] != "not probed" for a in accelerators)
    width = max(len(a["name"]) for a in accelerators)
    return ["", "accelerators:" if probed else "accelerators (twinkle plugins --probe imports torch to check the "
                                               "devices):",
            *(f"  {a['name'].ljust(width)}  {a['status']}{': ' + a['reason'] if a['reason'] else ''}"
              for a in accelerators)]


def _settings_lines(data: dict[str, Any]) -> list[str]:
    lines = []
    if not data["autoload"]:
        lines += ["", "entry-point autoloading is off (TWINKLE_DISABLE_PLUGIN_AUTOLOAD); only built-ins and "
                      "TWINKLE_PLUGINS modules are loaded"]
    if data["disabled"]:
        lines += ["", f"disabled by TWINKLE_DISABLE_PLUGINS: {', '.join(data['disabled'])}"]
    return lines


def _failure_lines(failures: list[dict[str, str]]) -> list[str]:
    if not failures:
        return []
    count = len(failures)
    return ["", f"{count} plugin{'s' if count > 1 else ''} failed to load and {'were' if count > 1 else 'was'} "
                f"skipped:",
            *(f"  {f['name']} ({f['distribution']}): {f['reason']}" for f in failures)]


def _problem_lines(problems: list[str]) -> list[str]:
    return ["", "problems:", *(f"  {p}" for p in problems)] if problems else []
