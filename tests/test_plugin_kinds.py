"""The plugin kinds (declared once, in ``twinkle_core.records``) and the register hook specs never drift."""

from __future__ import annotations

import inspect

import pytest

from twinkle_core import hookspecs
from twinkle_core.cli import collect_plugins
from twinkle_core.plugins import TwinklePlugins
from twinkle_core.records import KINDS, RECORD_TYPES

REGISTER_PREFIX = "twinkle_register_"


def register_hookspecs() -> dict[str, object]:
    """The ``twinkle_register_*`` functions of hookspecs.py that pluggy sees as hook specifications."""
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    return {name: fn for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
            if name.startswith(REGISTER_PREFIX) and hasattr(fn, marker)}


def test_kinds_and_register_hooks_are_unique():
    assert len(KINDS) == len(RECORD_TYPES)
    hooks = [record_type.register_hook for record_type in RECORD_TYPES]
    assert len(set(hooks)) == len(hooks)


@pytest.mark.parametrize("record_type", RECORD_TYPES, ids=lambda r: r.kind)
def test_every_kind_has_a_documented_register_hookspec(record_type):
    spec = register_hookspecs().get(record_type.register_hook)
    assert spec is not None, (f"record kind {record_type.kind!r} names {record_type.register_hook!r}, "
                              f"which hookspecs.py does not specify")
    assert record_type.__name__ in str(inspect.signature(spec).return_annotation), (
        f"{record_type.register_hook} should be annotated to yield {record_type.__name__}")
    assert "Example::" in (spec.__doc__ or ""), f"{record_type.register_hook} needs a docstring with an example"


def test_every_register_hookspec_has_a_record_kind():
    declared = {record_type.register_hook for record_type in RECORD_TYPES}
    orphans = sorted(set(register_hookspecs()) - declared)
    assert not orphans, f"hookspecs.py specifies {orphans} but no record type in twinkle_core.records names them"


def test_plugin_manager_and_cli_list_every_kind():
    plugins = TwinklePlugins(autoload=False, extra_modules=[])
    for kind, record_type in KINDS.items():
        assert hasattr(plugins.pm.hook, record_type.register_hook)
        plugins.records(kind)  # looks the kind up through its hook without error
    registered = collect_plugins(plugins)["plugins"]
    core = next(p for p in registered if p["name"] == "twinkle-core")
    assert set(core["registers"]) <= set(KINDS)
    assert {"strategy", "loss", "metric"} <= set(core["registers"])
