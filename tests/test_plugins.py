"""Plugin discovery: entry points, disabling, explicit modules, failures, duplicates, caching, env flags.

Third-party plugins are simulated without pip: a temporary directory on ``sys.path`` holds
hand-written ``*.dist-info`` metadata (METADATA + entry_points.txt), which ``importlib.metadata``
discovers like an installed distribution; the plugin packages themselves live in tests/*_plugin/.
"""

from __future__ import annotations

import sys
import textwrap
import threading
from pathlib import Path

import pytest

from twinkle_core.envflags import env_flag, env_list
from twinkle_core.errors import DuplicatePluginError, PluginNotFoundError
from twinkle_core.plugins import TwinklePlugins, get_plugins, reset_plugins

TESTS = Path(__file__).resolve().parent
FIXTURE_PLUGINS = {
    # name: (distribution, entry-point name, entry-point value, package directory)
    "fake": ("twinkle-fake-plugin", "fake", "twinkle_fake_plugin.plugin", TESTS / "fake_plugin"),
    "broken": ("twinkle-broken-plugin", "broken", "twinkle_broken_plugin", TESTS / "broken_plugin"),
    "duplicate": ("twinkle-duplicate-plugin", "duplicate", "twinkle_duplicate_plugin", TESTS / "duplicate_plugin"),
}


def loaded(plugins: TwinklePlugins) -> TwinklePlugins:
    """``.plugins`` / ``.failures`` are filled when the registry first loads (lazily)."""
    plugins.pm  # noqa: B018 - triggers loading
    return plugins


def make_site(root: Path, *names: str) -> list[str]:
    """Write dist-info metadata for the named fixture plugins; return the sys.path entries they need."""
    site = root / "site"
    site.mkdir(parents=True, exist_ok=True)
    paths = [str(site)]
    for name in names:
        dist, ep_name, ep_value, package_dir = FIXTURE_PLUGINS[name]
        info = site / f"{dist.replace('-', '_')}-0.1.0.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text(f"[twinkle]\n{ep_name} = {ep_value}\n")
        paths.append(str(package_dir))
    return paths


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    for var in ("TWINKLE_DISABLE_PLUGINS", "TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "TWINKLE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    reset_plugins()
    yield
    reset_plugins()


@pytest.fixture
def with_plugins(tmp_path, monkeypatch):
    def install(*names: str) -> None:
        for path in reversed(make_site(tmp_path, *names)):
            monkeypatch.syspath_prepend(path)
        for module in [m for m in sys.modules if m.startswith(("twinkle_fake_plugin", "twinkle_broken_plugin",
                                                                 "twinkle_duplicate_plugin"))]:
            monkeypatch.delitem(sys.modules, module)
        reset_plugins()

    return install


def test_entry_point_plugin_is_discovered(with_plugins):
    with_plugins("fake")
    plugins = loaded(get_plugins())
    assert "fake" in plugins.plugins
    info = plugins.plugins["fake"]
    assert (info.distribution, info.version) == ("twinkle-fake-plugin", "0.1.0")
    assert "fake_loss" in plugins.names("loss") and "cross_entropy" in plugins.names("loss")
    task_cls = plugins.load("task", "fake_task")
    assert task_cls.default_loss == "fake_loss"


def test_disabled_plugin_is_skipped(with_plugins, monkeypatch):
    with_plugins("fake")
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGINS", "fake, something-else")
    reset_plugins()
    plugins = loaded(get_plugins())
    assert "fake" not in plugins.plugins
    assert "fake_loss" not in plugins.names("loss")
    assert "cross_entropy" in plugins.names("loss")


def test_autoload_off_loads_only_builtins_and_named_modules(with_plugins, monkeypatch):
    with_plugins("fake", "broken")
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("TWINKLE_PLUGINS", "twinkle_fake_plugin.plugin")
    reset_plugins()
    plugins = loaded(get_plugins())
    assert set(plugins.plugins) == {"twinkle-core", "twinkle_fake_plugin.plugin"}
    assert plugins.failures == []  # the broken entry point was never touched
    assert "fake_loss" in plugins.names("loss")
    assert "TransformersModel" not in plugins.names("model")


@pytest.mark.parametrize("value", ["0", "false", "off", "no", ""])
def test_autoload_flag_off_values_keep_autoloading(with_plugins, monkeypatch, value):
    with_plugins("fake")
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", value)
    reset_plugins()
    assert get_plugins().autoload is True
    assert "fake" in loaded(get_plugins()).plugins


def test_missing_backend_names_the_distribution_to_install(monkeypatch):
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_plugins()
    with pytest.raises(PluginNotFoundError) as info:
        get_plugins().load("model", "TransformersModel")
    message = str(info.value)
    assert "TransformersModel" in message
    assert "pip install twinkle-backend-hf" in message
    assert "(none)" in message  # no model is available at all


def test_unknown_name_lists_what_is_available(monkeypatch):
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_plugins()
    with pytest.raises(PluginNotFoundError) as info:
        get_plugins().get("loss", "cross_entrophy")
    message = str(info.value)
    assert "cross_entrophy" in message and "cross_entropy" in message and "gkd" in message
    assert info.value.install_hint is None


def test_broken_plugin_is_reported_and_skipped(with_plugins):
    with_plugins("fake", "broken")
    plugins = loaded(get_plugins())
    assert "broken" not in plugins.plugins
    assert "fake" in plugins.plugins  # the others still load
    (failure,) = plugins.failures
    assert failure.name == "broken"
    assert failure.distribution == "twinkle-broken-plugin"
    assert "ImportError" in failure.reason and "twinkle_missing_dependency" in failure.reason
    assert "skipped" in str(failure)


def test_duplicate_registration_names_both_distributions(with_plugins):
    with_plugins("duplicate")
    plugins = loaded(get_plugins())
    with pytest.raises(DuplicatePluginError) as info:
        plugins.records("loss")
    message = str(info.value)
    assert "cross_entropy" in message
    assert "twinkle-core" in message and "twinkle-duplicate-plugin" in message
    assert "TWINKLE_DISABLE_PLUGINS=duplicate" in message
    assert "single" in plugins.names("strategy")  # other kinds are unaffected


def test_registry_is_cached_and_shared():
    first = get_plugins()
    assert get_plugins() is first
    assert first.records("loss") is first.records("loss")
    reset_plugins()
    assert get_plugins() is not first


def test_registry_is_thread_safe():
    results, errors = [], []

    def worker():
        try:
            plugins = loaded(get_plugins())
            results.append((id(plugins), id(plugins.records("task"))))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1


def test_registry_is_reentrant(tmp_path, monkeypatch):
    """A plugin whose hook consults the registry (another kind) does not deadlock."""
    (tmp_path / "twinkle_reentrant_plugin.py").write_text(textwrap.dedent("""
        from twinkle_core import LossRecord, hookimpl
        from twinkle_core.plugins import get_plugins

        @hookimpl
        def twinkle_register_losses():
            tasks = get_plugins().names("task")
            yield LossRecord("reentrant_" + tasks[0], "twinkle_core.loss.mse:MSELoss")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("TWINKLE_PLUGINS", "twinkle_reentrant_plugin")
    reset_plugins()
    assert "reentrant_causal_lm" in get_plugins().names("loss")


def test_explicit_registry_arguments_override_environment(with_plugins, monkeypatch):
    with_plugins("fake")
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGINS", "fake")
    plugins = loaded(TwinklePlugins(disabled=[]))
    assert "fake" in plugins.plugins


def test_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="unknown plugin kind"):
        get_plugins().records("widget")


@pytest.mark.parametrize(("raw", "expected"), [
    ("1", True), ("true", True), ("ON", True), (" yes ", True),
    ("0", False), ("false", False), ("Off", False), ("no", False), ("", False),
])
def test_env_flag_parsing(monkeypatch, raw, expected):
    monkeypatch.setenv("TWINKLE_TEST_FLAG", raw)
    assert env_flag("TWINKLE_TEST_FLAG") is expected


def test_env_flag_default_and_garbage(monkeypatch):
    monkeypatch.delenv("TWINKLE_TEST_FLAG", raising=False)
    assert env_flag("TWINKLE_TEST_FLAG") is False
    assert env_flag("TWINKLE_TEST_FLAG", True) is True
    monkeypatch.setenv("TWINKLE_TEST_FLAG", "maybe")
    with pytest.raises(ValueError, match="TWINKLE_TEST_FLAG"):
        env_flag("TWINKLE_TEST_FLAG")


def test_env_list(monkeypatch):
    monkeypatch.setenv("TWINKLE_TEST_LIST", " a, b ,,c ")
    assert env_list("TWINKLE_TEST_LIST") == ["a", "b", "c"]


@pytest.mark.parametrize("kind, name, available, meant", [
    ("optimizer", "adamw", ["AdamW", "SGD"], "AdamW"),  # another case
    ("precision", "fp32", ["no", "bf16", "fp16"], "no"),  # other frameworks' names
    ("precision", "bfloat16", ["no", "bf16", "fp16"], "bf16"),
    ("strategy", "fsdp", ["ddp", "native_fsdp", "single"], "native_fsdp"),
    ("loss", "cross_entrophy", ["cross_entropy", "gkd"], "cross_entropy"),  # a typo
    ("loss", "focal", ["cross_entropy", "gkd"], None),
])
def test_an_unknown_name_suggests_the_one_meant(kind, name, available, meant):
    error = PluginNotFoundError(kind, name, available, None)
    assert error.suggestion == meant
    message = str(error)
    assert (f"did you mean {meant!r}?" in message) == (meant is not None)
    plural = {"strategy": "strategies", "loss": "losses"}.get(kind, kind + "s")
    assert f"Available {plural}: " in message  # never "strategys" / "losss"


def test_a_recipe_with_another_frameworks_precision_name_is_told_ours(monkeypatch):
    pytest.importorskip("twinkle_backend_hf")  # the recipe's model class
    from twinkle_core.train.recipe import recipe_from_dict, validate_plugin_names

    reset_plugins()
    recipe = recipe_from_dict({"task": "causal_lm", "model": {"class_name": "TransformersModel", "tokenizer": "tok",
                                                        "config": {"model_type": "qwen2"}},
                               "precision": "fp32", "data": {"train": "x.jsonl"}, "optimizer": {"name": "adamw"}})
    with pytest.raises(PluginNotFoundError, match=r"^precision: no precision named 'fp32' is installed; did you mean 'no'\?"):
        validate_plugin_names(recipe)


def test_a_planned_distribution_is_not_sent_to_pip(monkeypatch):
    from twinkle_core import catalog
    from twinkle_core.catalog import install_hint

    assert install_hint("accelerator", "npu") == "pip install twinkle-backend-npu"
    assert install_hint("task", "vlm") == "pip install twinkle-vlm"
    monkeypatch.setattr(catalog, "PLANNED", frozenset({"twinkle-backend-npu"}))
    error = PluginNotFoundError("accelerator", "npu", ["cpu", "cuda"], install_hint("accelerator", "npu"))
    assert "pip install" not in str(error)
    assert "twinkle-backend-npu is planned but not released" in str(error)
    assert install_hint("strategy", "deepspeed") == "pip install twinkle-backend-hf"
