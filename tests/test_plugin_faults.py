"""Faulty plugins are reported and skipped; they never break ``twinkle plugins`` or the other plugins.

Each module under tests/faulty_plugins/ has one fault and is loaded through ``TWINKLE_PLUGINS`` with
entry-point autoloading off, next to a healthy plugin (tests/fake_plugin).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from twinkle_core import cli
from twinkle_core.plugins import PluginHookError, PluginLoadError, get_plugins, reset_plugins

TESTS = Path(__file__).resolve().parent
FAULTY = TESTS / "faulty_plugins"
HEALTHY = "twinkle_fake_plugin.plugin"
FAULTS = {
    # module: (what the reason must mention, ...)
    "twinkle_faulty_misspelled_hook": ("unknown hook 'twinkle_register_model'", "twinkle_register_models"),
    "twinkle_faulty_typo_hook": ("unknown hook 'twinkle_registr_losses'", "twinkle_register_losses"),
    "twinkle_faulty_wrong_args": ("PluginValidationError", "config"),
    "twinkle_faulty_raising_hook": ("twinkle_register_losses raised RuntimeError", "corrupt"),
    "twinkle_faulty_sys_exit": ("SystemExit", "refuses to be imported"),
}


@pytest.fixture
def use_plugins(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS / "fake_plugin"))
    monkeypatch.syspath_prepend(str(FAULTY))
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("TWINKLE_DISABLE_PLUGINS", raising=False)
    for module in [m for m in sys.modules if m.startswith(("twinkle_faulty_", "twinkle_fake_plugin"))]:
        monkeypatch.delitem(sys.modules, module)

    def use(*modules: str):
        monkeypatch.setenv("TWINKLE_PLUGINS", ",".join(modules))
        reset_plugins()
        return get_plugins()

    yield use
    reset_plugins()


@pytest.mark.parametrize("module", sorted(FAULTS))
def test_faulty_plugin_is_reported_and_skipped(use_plugins, module):
    plugins = use_plugins(module, HEALTHY)
    # registration hooks run when their kind is first asked for: a hook that raises shows up then
    assert "fake_loss" in plugins.names("loss") and "cross_entropy" in plugins.names("loss")
    assert "fake_task" in plugins.names("task")
    (failure,) = plugins.failures
    assert failure.name == module
    for text in FAULTS[module]:
        assert text in failure.reason
    assert module not in plugins.plugins and HEALTHY in plugins.plugins
    # nothing the faulty plugin registered survives, whichever kind is asked for first
    assert not {"MisspelledModel"} & set(plugins.names("model"))
    assert not {"typo_task", "raising_task"} & set(plugins.names("task"))
    assert not {"typo_loss", "wrong_args_loss"} & set(plugins.names("loss"))


def test_raising_hook_drops_records_already_listed(use_plugins):
    plugins = use_plugins("twinkle_faulty_raising_hook")
    assert "raising_task" in plugins.names("task")  # its task hook works ...
    assert "cross_entropy" in plugins.names("loss")  # ... until its loss hook raises
    assert "raising_task" not in plugins.names("task")
    assert [f.name for f in plugins.failures] == ["twinkle_faulty_raising_hook"]


@pytest.mark.parametrize("module", sorted(FAULTS))
def test_twinkle_plugins_lists_the_fault_and_exits_0(use_plugins, module, capsys):
    use_plugins(module, HEALTHY)
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "1 plugin failed to load and was skipped" in out
    assert f"  {module} ({module}): " in out
    for text in FAULTS[module]:
        assert text in out
    assert "fake_loss" in out and "problems:" not in out


def test_twinkle_plugins_subprocess_survives_every_fault(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWINKLE_") and k != "PYTHONPATH"}
    env.update(PYTHONPATH=os.pathsep.join([str(FAULTY), str(TESTS / "fake_plugin")]),
               TWINKLE_DISABLE_PLUGIN_AUTOLOAD="1", TWINKLE_PLUGINS=",".join([*sorted(FAULTS), HEALTHY]))
    result = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "plugins", "--json"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert sorted(f["name"] for f in data["failures"]) == sorted(FAULTS)
    assert data["problems"] == []
    assert HEALTHY in {p["name"] for p in data["plugins"]}


def test_record_with_missing_module_names_plugin_record_and_module(use_plugins):
    plugins = use_plugins("twinkle_faulty_missing_module")
    assert plugins.failures == []  # listing it imports nothing
    assert "ghost_loss" in plugins.names("loss")
    with pytest.raises(PluginLoadError) as info:
        plugins.load("loss", "ghost_loss")
    message = str(info.value)
    assert "'twinkle_faulty_missing_module'" in message  # the plugin (and its distribution)
    assert "loss 'ghost_loss'" in message
    assert "twinkle_ghost_dependency.losses" in message and "ModuleNotFoundError" in message
    assert isinstance(info.value, ImportError)  # callers that skip unimportable backends still do


def test_select_hook_that_raises_names_the_plugin(use_plugins, tmp_path, monkeypatch):
    (tmp_path / "twinkle_faulty_selector.py").write_text(
        "from twinkle_core import hookimpl\n\n\n"
        "@hookimpl(tryfirst=True)\n"
        "def twinkle_select_source(uri, sources):\n"
        "    raise KeyError(uri)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins = use_plugins("twinkle_faulty_selector")
    with pytest.raises(PluginHookError, match="plugin 'twinkle_faulty_selector'.*twinkle_select_source"):
        plugins.select_source("hf://org/model")


def test_keyboard_interrupt_is_not_swallowed(use_plugins, tmp_path, monkeypatch):
    (tmp_path / "twinkle_faulty_interrupt.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        use_plugins("twinkle_faulty_interrupt").plugins  # noqa: B018 - loads the registry


def test_train_dry_run_survives_every_fault(tmp_path):
    pytest.importorskip("twinkle_backend_hf")  # the recipe's model class
    recipe = tmp_path / "r.yaml"
    (tmp_path / "m").mkdir()  # a dry run checks the local files too
    (tmp_path / "d").write_text("{}\n")
    recipe.write_text("model: {model_id: ./m}\ndata: {train: ./d}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWINKLE_") and k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(FAULTY), TWINKLE_PLUGINS=",".join(sorted(FAULTS)))
    result = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(recipe), "--dry-run"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "recipe OK" in result.stderr
    for module in FAULTS:
        assert f"plugin {module!r}" in result.stderr and "skipped" in result.stderr
