"""A registration hook that yields something other than its kind's record (a string, a dict, a record of another
kind, a record without a name) is a faulty plugin: reported by name, with the hook, what it yielded and what it
must yield, unregistered and skipped, like a plugin that fails to import. Everything else keeps working.

Each case is a real pluggy plugin: a module written to a temporary directory and loaded in-process through
``TWINKLE_PLUGINS`` (entry-point autoloading off), next to the healthy test plugin (tests/fake_plugin).
"""

from __future__ import annotations

import logging
import sys
import textwrap
from pathlib import Path

import pytest

from twinkle_core import cli
from twinkle_core.plugins import get_plugins, reset_plugins

TESTS = Path(__file__).resolve().parent
HEALTHY = "twinkle_fake_plugin.plugin"
PLUGIN = "twinkle_bad_records"

# the body of the plugin's twinkle_register_tasks, and what the failure's reason must mention
CASES = {
    "string": ('    yield "my_task"\n',
               ["yielded 'my_task' (a str)", 'it must yield TaskRecord records, e.g. yield TaskRecord("name", '
                                             '"package.module:Object")']),
    "dict": ('    yield {"name": "my_task", "impl": "pkg.mod:Task"}\n', ["yielded {'name': 'my_task'", "(a dict)"]),
    "other_kind": ('    yield LossRecord("my_loss", "pkg.mod:Loss")\n',
                   ["yielded LossRecord(name='my_loss'", "a LossRecord belongs in twinkle_register_losses"]),
    "returned_string": ('    return "my_task"\n', ["returned 'my_task' (a str) instead of yielding records"]),
    "returned_record": ('    return TaskRecord("my_task", "pkg.mod:Task")\n',
                        ["returned TaskRecord(name='my_task'", "instead of yielding records"]),
    "empty_name": ('    yield TaskRecord("", "pkg.mod:Task")\n', ["TaskRecord with name ''", "non-empty string"]),
    "no_impl": ('    yield TaskRecord("my_task", None)\n', ["TaskRecord 'my_task' with impl None",
                                                          '"package.module:Object"']),
}


def write_plugin(directory: Path, body: str) -> None:
    (directory / f"{PLUGIN}.py").write_text(textwrap.dedent('''
        from twinkle_core import LossRecord, TaskRecord, hookimpl


        @hookimpl
        def twinkle_register_losses():
            yield LossRecord("bad_records_loss", "twinkle_core.loss:Loss")


        @hookimpl
        def twinkle_register_tasks():
        ''') + body)


@pytest.fixture
def use_plugin(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS / "fake_plugin"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("TWINKLE_DISABLE_PLUGINS", raising=False)
    for module in [m for m in sys.modules if m.startswith((PLUGIN, "twinkle_fake_plugin"))]:
        monkeypatch.delitem(sys.modules, module)

    def use(case: str, *more: str):
        write_plugin(tmp_path, CASES[case][0])
        monkeypatch.setenv("TWINKLE_PLUGINS", ",".join([PLUGIN, HEALTHY, *more]))
        reset_plugins()
        return get_plugins()

    yield use
    reset_plugins()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_plugin_yielding_a_non_record_is_reported_and_skipped(use_plugin, case, caplog):
    plugins = use_plugin(case)
    assert "bad_records_loss" in plugins.names("loss")  # its loss hook is fine ...
    with caplog.at_level(logging.WARNING, logger="twinkle.plugins"):
        tasks = plugins.names("task")  # ... until its task hook yields the wrong thing: no TypeError
    assert "causal_lm" in tasks and "fake_task" in tasks and "my_task" not in tasks
    (failure,) = plugins.failures
    assert failure.name == PLUGIN
    for text in ["twinkle_register_tasks", "TaskRecord", *CASES[case][1]]:
        assert text in failure.reason
    assert PLUGIN not in plugins.plugins and HEALTHY in plugins.plugins
    assert "bad_records_loss" not in plugins.names("loss")  # nothing it registered survives
    assert "fake_loss" in plugins.names("loss") and "cross_entropy" in plugins.names("loss")
    assert f"plugin {PLUGIN!r}" in caplog.text and "skipped" in caplog.text


def test_twinkle_plugins_lists_the_plugin_among_the_failures(use_plugin, capsys):
    use_plugin("string")
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "1 plugin failed to load and was skipped" in out
    assert f"  {PLUGIN} ({PLUGIN}): " in out and "yielded 'my_task' (a str)" in out
    assert "problems:" not in out and "fake_task" in out


def test_train_dry_run_carries_on_without_the_plugin(use_plugin, tmp_path, capsys, caplog):
    pytest.importorskip("twinkle_backend_hf")  # the recipe's model class
    use_plugin("dict", "twinkle_backend_hf.plugin")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text("{}\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {model_id: ./m, config: {model_type: qwen2}}\ndata: {train: ./d.jsonl}\n")
    with caplog.at_level(logging.WARNING, logger="twinkle.plugins"):
        assert cli.main(["train", str(recipe), "--dry-run"]) == 0
    assert "recipe OK" in capsys.readouterr().err
    assert f"plugin {PLUGIN!r}" in caplog.text and "twinkle_register_tasks yielded" in caplog.text


def test_a_recipe_naming_the_skipped_plugin_s_task_says_it_is_not_installed(use_plugin):
    from twinkle_core.errors import PluginNotFoundError

    plugins = use_plugin("other_kind")
    with pytest.raises(PluginNotFoundError, match="no task named 'my_task' is installed"):
        plugins.get("task", "my_task")
