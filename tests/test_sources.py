"""Model sources: local paths, hf://, ms://, third-party schemes, deadlines and trust_remote_code.

Nothing here touches the network: offline mode is real, everything else patches the hub client.
"""

from __future__ import annotations

import sys
import textwrap
import time
import types

import pytest

from twinkle_core.errors import PluginNotFoundError, SourceError
from twinkle_core.plugins import reset_plugins
from twinkle_core.sources.hub import HuggingFaceSource
from twinkle_core.sources.local import LocalSource
from twinkle_core.sources.modelscope import ModelScopeSource
from twinkle_core.sources.resolve import call_with_deadline, resolve_model, split_revision, trust_remote_code


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    for var in ("TWINKLE_PLUGINS", "TWINKLE_DISABLE_PLUGINS", "TWINKLE_OFFLINE", "HF_HUB_OFFLINE",
                "TWINKLE_TRUST_REMOTE_CODE", "TWINKLE_DOWNLOAD_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_plugins()
    yield
    reset_plugins()


# ---------------------------------------------------------------------- local
def test_local_directory_resolves_to_absolute_path(tmp_path, monkeypatch):
    model = tmp_path / "tiny-model"
    model.mkdir()
    assert resolve_model(str(model)) == str(model.resolve())
    monkeypatch.chdir(tmp_path)
    assert resolve_model("tiny-model") == str(model.resolve())
    assert resolve_model("local://" + str(model)) == str(model.resolve())


def test_missing_local_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(SourceError, match="does not exist") as info:
        resolve_model(str(missing))
    assert str(missing) in str(info.value)


def test_bare_hub_id_suggests_a_scheme(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SourceError) as info:
        LocalSource().resolve("Qwen/Qwen2.5-0.5B")
    assert "hf://Qwen/Qwen2.5-0.5B" in str(info.value) and "ms://Qwen/Qwen2.5-0.5B" in str(info.value)


# ---------------------------------------------------------------------- hf://
def test_hf_offline_fails_fast_with_a_clear_message(monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(SourceError) as info:
        resolve_model("hf://twinkle-tests/definitely-not-a-real-model-4f1c2")
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"took {elapsed:.1f} s"
    message = str(info.value)
    assert "hf://twinkle-tests/definitely-not-a-real-model-4f1c2" in message
    assert "offline" in message and "HF_HUB_OFFLINE" in message


def test_twinkle_offline_also_means_local_files_only(monkeypatch, tmp_path):
    hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("TWINKLE_OFFLINE", "1")
    calls = []

    def fake_snapshot(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path)

    def no_network(*args, **kwargs):  # pragma: no cover - must not be called
        raise AssertionError("offline mode contacted the hub")

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot)
    monkeypatch.setattr(hub.HfApi, "model_info", no_network)
    assert resolve_model("hf://org/model@v1") == str(tmp_path)
    assert calls == [("org/model", {"revision": "v1", "local_files_only": True, "etag_timeout": 30.0})]


def test_hf_download_passes_revision_and_timeouts(monkeypatch, tmp_path):
    hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "7")
    looked_up, downloads = [], []
    monkeypatch.setattr(hub.HfApi, "model_info",
                        lambda self, repo_id, revision=None, timeout=None: looked_up.append((repo_id, revision, timeout)))

    def fake_snapshot(repo_id, **kwargs):
        downloads.append((repo_id, kwargs))
        return str(tmp_path)

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot)
    assert HuggingFaceSource().resolve("hf://org/model", revision="abc123", timeout_s=5) == str(tmp_path)
    assert looked_up == [("org/model", "abc123", 5)]
    assert downloads == [("org/model", {"revision": "abc123", "local_files_only": False, "etag_timeout": 7.0})]


class RepositoryNotFoundError(Exception):
    """Matched by name, like huggingface_hub's (whose constructor needs an HTTP response)."""


class GatedRepoError(RepositoryNotFoundError):
    pass


@pytest.mark.parametrize(("error", "expected"), [
    (RepositoryNotFoundError("404"), "no model 'org/model' on the Hugging Face Hub"),
    (GatedRepoError("403"), "gated model"),
])
def test_hf_unknown_or_gated_model_is_explained(monkeypatch, error, expected):
    hub = pytest.importorskip("huggingface_hub")

    def model_info(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(hub, "snapshot_download", lambda *a, **k: pytest.fail("must not download"))
    with pytest.raises(SourceError, match=expected):
        resolve_model("hf://org/model")


def test_hf_unreachable_uses_the_cache_or_explains(monkeypatch, tmp_path):
    hub = pytest.importorskip("huggingface_hub")

    def model_info(self, *args, **kwargs):
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(hub.HfApi, "model_info", model_info)
    cached = {"hit": True}

    def fake_snapshot(repo_id, local_files_only=False, **kwargs):
        assert local_files_only, "an unreachable hub must not be asked to download"
        if cached["hit"]:
            return str(tmp_path)
        raise FileNotFoundError("Cannot find an appropriate cached snapshot folder")

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot)
    assert resolve_model("hf://org/model") == str(tmp_path)
    cached["hit"] = False
    with pytest.raises(SourceError, match="cannot reach the Hugging Face Hub") as info:
        resolve_model("hf://org/model")
    assert "Name or service not known" in str(info.value)


def test_a_hanging_hub_hits_the_deadline(monkeypatch):
    hub = pytest.importorskip("huggingface_hub")

    def model_info(self, *args, **kwargs):
        time.sleep(30)

    monkeypatch.setattr(hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(hub, "snapshot_download",
                        lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("not cached")))
    start = time.monotonic()
    with pytest.raises(SourceError, match="did not finish within 0.5 s"):
        HuggingFaceSource().resolve("hf://org/model", timeout_s=0.5)
    assert time.monotonic() - start < 5


def test_a_hanging_download_hits_the_download_deadline(monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("TWINKLE_DOWNLOAD_TIMEOUT", "0.5")
    monkeypatch.setattr(hub.HfApi, "model_info", lambda self, *a, **k: None)
    monkeypatch.setattr(hub, "snapshot_download", lambda *a, **k: time.sleep(30))
    with pytest.raises(SourceError, match="downloading hf://org/model did not finish"):
        resolve_model("hf://org/model")


@pytest.mark.parametrize("uri", ["hf://", "hf://a/b/c", "hf://org/"])
def test_malformed_hf_uri(uri):
    with pytest.raises(SourceError, match="does not name a model"):
        resolve_model(uri)


def test_missing_huggingface_hub_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(SourceError, match="pip install huggingface_hub"):
        resolve_model("hf://org/model")


# ---------------------------------------------------------------------- ms://
def test_missing_modelscope_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "modelscope", None)  # `import modelscope` now raises ImportError
    start = time.monotonic()
    with pytest.raises(SourceError, match="pip install modelscope"):
        resolve_model("ms://Qwen/Qwen2.5-0.5B")
    assert time.monotonic() - start < 5


def test_modelscope_download_and_offline(monkeypatch, tmp_path):
    calls = []
    fake = types.ModuleType("modelscope")

    def snapshot_download(model_id, revision=None, cache_dir=None, local_files_only=False):
        calls.append((model_id, revision, local_files_only))
        return str(tmp_path)

    fake.snapshot_download = snapshot_download
    monkeypatch.setitem(sys.modules, "modelscope", fake)
    assert resolve_model("ms://Qwen/Qwen2.5-0.5B@v1.0") == str(tmp_path)
    assert calls[-1] == ("Qwen/Qwen2.5-0.5B", "v1.0", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert ModelScopeSource().resolve("ms://Qwen/Qwen2.5-0.5B") == str(tmp_path)
    assert calls[-1] == ("Qwen/Qwen2.5-0.5B", None, True)


def test_modelscope_failure_becomes_source_error(monkeypatch):
    fake = types.ModuleType("modelscope")

    def snapshot_download(model_id, revision=None):
        raise ValueError("model does not exist")

    fake.snapshot_download = snapshot_download
    monkeypatch.setitem(sys.modules, "modelscope", fake)
    with pytest.raises(SourceError, match="model does not exist"):
        resolve_model("ms://org/none")


# ---------------------------------------------------------------------- plugins
PLUGIN = textwrap.dedent("""
    from twinkle_core import SourceRecord, hookimpl
    from twinkle_core.sources.base import ModelSource

    class BucketSource(ModelSource):
        scheme = "bucket"
        def resolve(self, uri, *, revision=None, timeout_s=30.0):
            return "/mnt/buckets/" + uri.split("://", 1)[1]

    @hookimpl
    def twinkle_register_sources():
        yield SourceRecord("bucket", "twinkle_bucket_plugin:BucketSource", "bucket://name (test)")

    @hookimpl(tryfirst=True)
    def twinkle_select_source(uri, sources):
        if uri.startswith("bucket://") or uri.startswith("hf://mirrored/"):
            return sources["bucket"]
        return None
""")


def test_third_party_source_claims_its_scheme(tmp_path, monkeypatch):
    (tmp_path / "twinkle_bucket_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TWINKLE_PLUGINS", "twinkle_bucket_plugin")
    reset_plugins()
    assert resolve_model("bucket://weights/qwen") == "/mnt/buckets/weights/qwen"
    # a tryfirst selector may even take over URIs of a built-in scheme
    assert resolve_model("hf://mirrored/model") == "/mnt/buckets/mirrored/model"
    local = tmp_path / "m"
    local.mkdir()
    assert resolve_model(str(local)) == str(local.resolve())  # the rest still goes to the core


def test_unknown_scheme_lists_the_sources():
    with pytest.raises(PluginNotFoundError) as info:
        resolve_model("s3://bucket/model")
    message = str(info.value)
    assert "'s3'" in message and "hf" in message and "ms" in message and "local" in message


# ---------------------------------------------------------------------- helpers
def test_trust_remote_code_is_off_unless_turned_on(monkeypatch):
    assert trust_remote_code(None) is False
    monkeypatch.setenv("TWINKLE_TRUST_REMOTE_CODE", "0")
    assert trust_remote_code(None) is False
    monkeypatch.setenv("TWINKLE_TRUST_REMOTE_CODE", "1")
    assert trust_remote_code(None) is True
    assert trust_remote_code(False) is False  # the recipe wins
    monkeypatch.setenv("TWINKLE_TRUST_REMOTE_CODE", "false")
    assert trust_remote_code(True) is True


def test_split_revision():
    assert split_revision("org/name@main", None) == ("org/name", "main")
    assert split_revision("org/name@main", "v2") == ("org/name", "v2")
    assert split_revision("org/name", None) == ("org/name", None)


def test_call_with_deadline_passes_values_and_errors():
    assert call_with_deadline(lambda: 42, 5, "answering") == 42
    with pytest.raises(KeyError):
        call_with_deadline(lambda: {}["x"], 5, "failing")
    with pytest.raises(SourceError, match="sleeping did not finish within 0.2 s"):
        call_with_deadline(lambda: time.sleep(5), 0.2, "sleeping")
