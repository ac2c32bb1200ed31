"""Every ``twinkle`` sub-command comes from a plugin (``twinkle_register_commands``), the core's included.

``chat`` / ``export`` / ``eval`` need transformers and peft and come with twinkle-backend-hf; with twinkle-core
alone they say what to install. Third-party commands register the same way as the core's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from twinkle_core import cli
from twinkle_core.commands import Command
from twinkle_core.plugins import TwinklePlugins, get_plugins, reset_plugins


@pytest.fixture
def registry(monkeypatch, tmp_path):
    """Entry points off (twinkle-core alone), plus the plugin modules named, written under ``tmp_path``."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def use(**modules: str) -> TwinklePlugins:
        for name, source in modules.items():
            (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
            monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "1")
        monkeypatch.setenv("TWINKLE_PLUGINS", ",".join(modules))
        monkeypatch.delenv("TWINKLE_DISABLE_PLUGINS", raising=False)
        reset_plugins()
        return get_plugins()

    yield use
    reset_plugins()


HELLO = """
    import argparse

    from twinkle_core import hookimpl
    from twinkle_core.commands import Command
    from twinkle_core.records import CommandRecord


    class HelloCommand(Command):
        description = "Say hello."

        def add_arguments(self, parser):
            parser.add_argument("--name", default="world")

        def run(self, args):
            print(f"hello {args.name}")
            return 0


    @hookimpl
    def twinkle_register_commands():
        yield CommandRecord("hello", "twinkle_hello_plugin:HelloCommand", "greet someone")
        yield CommandRecord("ghost", "twinkle_ghost_dependency.cli:GhostCommand", "needs a missing library")
"""


def test_the_core_registers_its_commands_like_any_plugin(registry):
    plugins = registry()
    commands = plugins.records("command")
    assert {name: entry.plugin.name for name, entry in commands.items()} == {
        "plugins": "twinkle-core", "train": "twinkle-core", "plot": "twinkle-core", "data": "twinkle-core"}
    for entry in commands.values():
        assert issubclass(plugins.load_record("command", entry.record), Command)


def test_hf_backend_registers_chat_export_eval():
    pytest.importorskip("twinkle_backend_hf")
    from twinkle_backend_hf import plugin

    records = {r.name: r for r in plugin.twinkle_register_commands()}
    assert sorted(records) == ["chat", "eval", "export", "serve-model"]
    for record in records.values():
        assert issubclass(record.load(), Command)


@pytest.mark.parametrize("argv", [["chat", "ckpt", "--prompt", "hi"], ["export", "ckpt", "-o", "out"],
                                  ["eval", "ckpt", "data.jsonl"], ["chat", "--help"]])
def test_core_alone_names_the_distribution_to_install(registry, capsys, argv):
    registry()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"no command named '{argv[0]}' is installed" in err
    assert "Install it with: pip install twinkle-backend-hf" in err and "Traceback" not in err


def test_core_alone_help_lists_the_missing_commands(registry, capsys):
    registry()
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "(not installed: pip install twinkle-backend-hf)" in out
    assert "train from a YAML recipe" in out


def test_a_third_party_command_runs_and_a_broken_one_is_named(registry, capsys):
    registry(twinkle_hello_plugin=HELLO)
    assert cli.main(["hello", "--name", "twinkle"]) == 0
    assert capsys.readouterr().out.strip() == "hello twinkle"
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "greet someone" in out and "ghost" in out  # the broken command does not break the others
    assert cli.main(["ghost"]) == 1
    err = capsys.readouterr().err
    assert "plugin 'twinkle_hello_plugin'" in err and "twinkle_ghost_dependency" in err


def test_unknown_arguments_are_refused(registry, capsys):
    registry(twinkle_hello_plugin=HELLO)
    with pytest.raises(SystemExit) as info:
        cli.main(["hello", "--bogus"])
    assert info.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_plugin_failures_are_printed_once():
    """A plugin that fails to load is a warning on stderr, except for ``twinkle plugins``, which lists it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWINKLE_") and k != "PYTHONPATH"}
    env.update(TWINKLE_DISABLE_PLUGIN_AUTOLOAD="1", TWINKLE_PLUGINS="twinkle_no_such_plugin_module")

    def twinkle(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "twinkle_core.cli", *args], capture_output=True, text=True,
                              env=env, timeout=120)

    listing = twinkle("plugins")
    assert listing.returncode == 0 and "twinkle_no_such_plugin_module" in listing.stdout
    assert "failed to load" not in listing.stderr
    other = twinkle("plot", "/no/such/logs.jsonl")
    assert other.returncode == 2 and "twinkle_no_such_plugin_module" in other.stderr
