"""The one download policy of hub repositories (:mod:`twinkle_core.sources.hub_policy`), shared by the model
sources (``hf://``, ``ms://``) and the data sets: offline reads only the cache, a look-up comes first, a hub's
refusal is final, network trouble falls back to the cache, and the download runs under its own deadline."""

from __future__ import annotations

import logging

import pytest

from twinkle_core.errors import SourceError
from twinkle_core.sources.hub_policy import HubRepository, HubSource, fetch_snapshot, parse_hub_uri


class Refused(Exception):
    """What a hub answers for a repository that does not exist."""


class ScriptedRepository(HubRepository):
    """A repository whose steps do what the test says, recording the calls."""

    def __init__(self, uri="x://org/name", repo_id="org/name", revision=None, timeout_s=5.0, *,
                 cached="/cache/org/name", look_up=None, download="/download/org/name"):
        super().__init__(uri, repo_id, revision, timeout_s)
        self.cached, self.looked_up, self.download, self.calls = cached, look_up, download, []

    def snapshot(self, local_only):
        self.calls.append("cache" if local_only else "download")
        result = self.cached if local_only else self.download
        if isinstance(result, BaseException):
            raise result
        return result

    def look_up(self):
        self.calls.append("look_up")
        if self.looked_up is not None:
            raise self.looked_up

    def refusal(self, exc):
        return SourceError(f"{self.uri}: no such repository") if isinstance(exc, Refused) else None

    def offline_error(self, exc):
        return SourceError(f"{self.uri} is not cached and offline mode is on ({exc})")

    def unreachable_error(self, exc):
        return SourceError(f"cannot reach the hub for {self.uri} and it is not cached: {exc}")


@pytest.fixture(autouse=True)
def online(monkeypatch):
    monkeypatch.delenv("TWINKLE_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def test_online_looks_up_then_downloads():
    repo = ScriptedRepository()
    assert fetch_snapshot(repo) == "/download/org/name"
    assert repo.calls == ["look_up", "download"]


@pytest.mark.parametrize("flag", ["TWINKLE_OFFLINE", "HF_HUB_OFFLINE"])
def test_offline_reads_only_the_cache(monkeypatch, flag):
    monkeypatch.setenv(flag, "1")
    repo = ScriptedRepository()
    assert fetch_snapshot(repo) == "/cache/org/name" and repo.calls == ["cache"]
    missing = ScriptedRepository(cached=FileNotFoundError("not cached"))
    with pytest.raises(SourceError, match=r"x://org/name is not cached and offline mode is on \(not cached\)"):
        fetch_snapshot(missing)
    assert missing.calls == ["cache"]


def test_a_refusal_is_final_and_network_trouble_uses_the_cache(caplog):
    refused = ScriptedRepository(look_up=Refused("404"))
    with pytest.raises(SourceError, match="no such repository"):
        fetch_snapshot(refused)
    assert refused.calls == ["look_up"]
    unreachable = ScriptedRepository(look_up=ConnectionError("Name or service not known"))
    with caplog.at_level(logging.WARNING, logger="twinkle.sources"):
        assert fetch_snapshot(unreachable) == "/cache/org/name"
    assert unreachable.calls == ["look_up", "cache"] and "using the cached snapshot" in caplog.text
    nothing = ScriptedRepository(look_up=ConnectionError("down"), cached=FileNotFoundError("not cached"))
    with pytest.raises(SourceError, match="cannot reach the hub for x://org/name and it is not cached: down"):
        fetch_snapshot(nothing)


def test_a_failed_download_is_named_or_read_from_the_cache_where_the_repository_says_so():
    with pytest.raises(SourceError, match=r"downloading x://org/name failed: OSError: disk full"):
        fetch_snapshot(ScriptedRepository(download=OSError("disk full")))
    deadline = SourceError("downloading x://org/name did not finish within 1 s")
    with pytest.raises(SourceError) as info:
        fetch_snapshot(ScriptedRepository(download=deadline))
    assert info.value is deadline  # the deadline's own error, unchanged

    class CachedWhenDownloadFails(ScriptedRepository):
        cache_when_download_fails = True

    fallback = CachedWhenDownloadFails(download=OSError("disk full"))
    assert fetch_snapshot(fallback) == "/cache/org/name" and fallback.calls == ["look_up", "download", "cache"]


def test_the_download_runs_under_the_download_deadline(monkeypatch):
    import time

    monkeypatch.setenv("TWINKLE_DOWNLOAD_TIMEOUT", "0.2")

    class Slow(ScriptedRepository):
        def snapshot(self, local_only):
            if not local_only:
                time.sleep(5)
            return super().snapshot(local_only)

    with pytest.raises(SourceError, match=r"downloading x://org/name did not finish within 0.2 s"):
        fetch_snapshot(Slow())


@pytest.mark.parametrize(("uri", "revision", "expected"), [
    ("hf://org/name", None, ("hf", "org/name", None)),
    ("ms://org/name@v1", None, ("ms", "org/name", "v1")),
    ("hf://org/name@v1", "v2", ("hf", "org/name", "v2")),
])
def test_parse_hub_uri(uri, revision, expected):
    assert parse_hub_uri(uri, revision) == expected


@pytest.mark.parametrize("uri", ["hf://", "ms://a/b/c", "hf://org/"])
def test_parse_hub_uri_names_the_expected_form(uri):
    scheme = uri.split("://")[0]
    with pytest.raises(SourceError, match=rf"write it as {scheme}://org/name \(or {scheme}://org/name@revision\)"):
        parse_hub_uri(uri)


def test_a_hub_source_is_a_scheme_and_a_repository_class():
    class ScriptedSource(HubSource):
        scheme = "x"
        repository = ScriptedRepository

    assert ScriptedSource().resolve("x://org/name") == "/download/org/name"
