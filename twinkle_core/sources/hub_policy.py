"""The download policy every hub repository follows, models (``hf://``, ``ms://``) and data sets alike.

:func:`fetch_snapshot` is the one place that decides when the network is used:

1. offline (``TWINKLE_OFFLINE=1`` or ``HF_HUB_OFFLINE=1``): only the local cache, under ``timeout_s``;
2. otherwise the repository is looked up first, under ``timeout_s``, so that unknown ids, gated repositories
   and an unreachable hub fail in seconds. An answer the cache cannot fix (no such repository, no access) is
   an error at once; network trouble falls back to a cached snapshot, with a warning;
3. then the snapshot is downloaded (or reused from the cache) under the download deadline
   ``TWINKLE_DOWNLOAD_TIMEOUT``.

Every failure is a :class:`~twinkle_core.errors.SourceError` that names the repository and what to do. What
differs between hubs and between models and data sets (how to snapshot, how to look up, how the hub answers
"no such repository", the words of each error) is a :class:`HubRepository` subclass; the order of the steps and
the deadlines are not theirs to change.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import ClassVar

from twinkle_core.errors import SourceError
from twinkle_core.sources.base import ModelSource, split_uri
from twinkle_core.sources.resolve import (
    call_with_deadline,
    check_repo_id,
    download_timeout_s,
    first_line,
    offline_mode,
    split_revision,
)


class HubRepository(ABC):
    """One repository on one hub, as :func:`fetch_snapshot` needs it.

    ``uri`` is what the user wrote (``hf://org/name@rev``), ``repo_id`` and ``revision`` its parts, ``timeout_s``
    the limit of a look-up or a cache read. The error hooks receive the exception that ended a step and return
    the :class:`SourceError` to raise (``offline_error`` may return ``exc`` itself: it is then re-raised unchanged).
    """

    #: whether a failed download falls back to the local cache as a failed look-up does
    cache_when_download_fails: ClassVar[bool] = False
    #: the logger the cache fallback's warning goes to
    logger: ClassVar[logging.Logger] = logging.getLogger("twinkle.sources")

    def __init__(self, uri: str, repo_id: str, revision: str | None, timeout_s: float) -> None:
        self.uri, self.repo_id, self.revision, self.timeout_s = uri, repo_id, revision, timeout_s

    @property
    def label(self) -> str:
        """How the steps' deadline errors name the repository (``reading <label> from the local cache ...``)."""
        return self.uri

    @abstractmethod
    def snapshot(self, local_only: bool) -> str:
        """A local directory holding the repository: from the cache only, or downloading what is missing."""

    def look_up(self) -> None:
        """Ask the hub about the repository, bounded by ``timeout_s`` (default: no look-up)."""

    def refusal(self, exc: BaseException) -> SourceError | None:
        """The error for a hub's answer that the cache cannot fix; ``None`` for network trouble (default)."""
        return None

    @abstractmethod
    def offline_error(self, exc: BaseException) -> SourceError:
        """Offline mode is on and the cache could not serve the repository."""

    @abstractmethod
    def unreachable_error(self, exc: BaseException) -> SourceError:
        """The hub could not be reached (``exc``) and the repository is not cached either."""

    def download_error(self, exc: BaseException) -> SourceError:
        """The download failed (after a successful look-up) with ``exc``, which is not a :class:`SourceError` (the
        download deadline's error is raised as it is)."""
        return SourceError(f"downloading {self.label} failed: {first_line(exc)}")

    def cache_warning(self, exc: BaseException) -> str:
        """The warning logged when a cached snapshot stands in for the hub."""
        return f"could not reach the hub for {self.uri} ({first_line(exc)}); using the cached snapshot"


def _cached(repo: HubRepository) -> str:
    return call_with_deadline(lambda: repo.snapshot(True), repo.timeout_s, f"reading {repo.label} from the local cache")


def _from_cache(repo: HubRepository, cause: BaseException) -> str:
    """The cached snapshot standing in for the hub that ``cause`` says cannot be reached."""
    try:
        path = _cached(repo)
    except Exception:
        raise repo.unreachable_error(cause) from cause
    repo.logger.warning("%s", repo.cache_warning(cause))
    return path


def fetch_snapshot(repo: HubRepository) -> str:
    """A local directory holding ``repo``, following the module's policy."""
    if offline_mode():
        try:
            return _cached(repo)
        except Exception as exc:
            error = repo.offline_error(exc)
            if error is exc:
                raise
            raise error from exc
    try:
        repo.look_up()
    except Exception as exc:
        refused = repo.refusal(exc)
        if refused is not None:
            raise refused from exc
        return _from_cache(repo, exc)
    try:
        return call_with_deadline(lambda: repo.snapshot(False), download_timeout_s(), f"downloading {repo.label}")
    except Exception as exc:
        if repo.cache_when_download_fails:
            return _from_cache(repo, exc)
        if isinstance(exc, SourceError):
            raise
        raise repo.download_error(exc) from exc


def parse_hub_uri(uri: str, revision: str | None = None) -> tuple[str, str, str | None]:
    """``"hf://org/name@rev"`` -> ``("hf", "org/name", "rev")`` (an explicit ``revision`` wins); an error naming
    the expected form when the id is not ``org/name``."""
    scheme, rest = split_uri(uri)
    repo_id, revision = split_revision(rest, revision)
    check_repo_id(uri, repo_id, f"{scheme}://org/name (or {scheme}://org/name@revision)")
    return scheme, repo_id, revision


class HubSource(ModelSource):
    """A model source whose URIs name repositories on a hub (``scheme://org/name[@revision]``), fetched by
    :func:`fetch_snapshot`; the subclass says which :class:`HubRepository` knows the hub."""

    repository: ClassVar[type[HubRepository]]

    def resolve(self, uri: str, *, revision: str | None = None, timeout_s: float = 30.0) -> str:
        _, repo_id, revision = parse_hub_uri(uri, revision)
        return fetch_snapshot(self.repository(uri, repo_id, revision, timeout_s))


def missing_package(scheme: str, kind: str, package: str, exc: BaseException) -> SourceError:
    """The error for a hub whose client library is not installed: ``hf:// models need ... pip install ...``."""
    return SourceError(f"{scheme}:// {kind} need the {package} package: pip install {package} ({first_line(exc)})")


__all__ = ["HubRepository", "HubSource", "fetch_snapshot", "missing_package", "parse_hub_uri"]
