"""Data set repositories on a hub: ``hf://org/name[@revision]`` and ``ms://org/name[@revision]``.

:func:`resolve_dataset` returns a local directory holding the repository's files (a snapshot of
the data set repository), which :func:`twinkle_core.data.loading.load_records` then reads with
``datasets``. It follows the model sources' policy (:mod:`twinkle_core.sources.hub_policy`): with
``HF_HUB_OFFLINE=1`` / ``TWINKLE_OFFLINE=1`` only the local cache is used, every network call runs
under a wall-clock deadline, and every failure is a :class:`~twinkle_core.errors.SourceError`
naming the id and what to do (download the data set and pass its local path). Unlike a model, a data set
whose download fails is also read from the cache when it is there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ClassVar

from twinkle_core.errors import SourceError
from twinkle_core.sources.base import split_uri
from twinkle_core.sources.hub import import_huggingface_hub
from twinkle_core.sources.hub_policy import HubRepository, fetch_snapshot, missing_package, parse_hub_uri
from twinkle_core.sources.modelscope import modelscope_snapshot
from twinkle_core.sources.resolve import call_with_deadline, first_line, supported_kwargs

_HOW = {
    "hf": "hf download {repo} --repo-type dataset --local-dir DIR",
    "ms": "modelscope download --dataset {repo} --local_dir DIR",
}


def _snapshot_hf(repo_id: str, revision: str | None, local_only: bool, timeout_s: float) -> str:
    hub = import_huggingface_hub("data sets")
    kwargs = supported_kwargs(hub.snapshot_download, repo_type="dataset", revision=revision,
                              local_files_only=local_only, etag_timeout=timeout_s)
    return str(hub.snapshot_download(repo_id, **kwargs))


def _snapshot_ms(repo_id: str, revision: str | None, local_only: bool, timeout_s: float) -> str:
    try:
        from modelscope import dataset_snapshot_download as download
    except ImportError as exc:
        raise missing_package("ms", "data sets", "modelscope", exc) from exc
    return modelscope_snapshot(download, repo_id, revision, local_only)


_SNAPSHOT: dict[str, Callable[[str, str | None, bool, float], str]] = {"hf": _snapshot_hf, "ms": _snapshot_ms}


class HubDataset(HubRepository):
    """A data set repository on the hub of ``scheme`` (``hf`` or ``ms``)."""

    cache_when_download_fails = True
    logger: ClassVar[logging.Logger] = logging.getLogger("twinkle.data")

    def __init__(self, uri: str, scheme: str, repo_id: str, revision: str | None, timeout_s: float) -> None:
        super().__init__(uri, repo_id, revision, timeout_s)
        self.scheme = scheme

    @property
    def label(self) -> str:
        return f"the data set {self.uri}"

    def snapshot(self, local_only: bool) -> str:
        return _SNAPSHOT[self.scheme](self.repo_id, self.revision, local_only, self.timeout_s)

    def look_up(self) -> None:
        if self.scheme != "hf":
            return
        # a bounded look-up first: an unreachable hub fails in seconds, not at the download
        import huggingface_hub as hub

        call_with_deadline(lambda: hub.HfApi().dataset_info(self.repo_id, revision=self.revision,
                                                            timeout=self.timeout_s),
                           self.timeout_s, f"looking up {self.label}")

    def fix(self) -> str:
        """What to do without the hub: the scheme's download command, then the local path in the recipe."""
        command = _HOW.get(self.scheme, "").format(repo=self.repo_id)
        return (f"download it where there is network (`{command}`), copy DIR here and put its local path "
                "(or one of its files) in data.train / data.eval")

    def offline_error(self, exc: BaseException) -> SourceError:
        return SourceError(f"{self.label} is not in the local cache and offline mode is on "
                           f"(HF_HUB_OFFLINE / TWINKLE_OFFLINE): {self.fix()} ({first_line(exc)})")

    def unreachable_error(self, exc: BaseException) -> SourceError:
        return SourceError(f"cannot fetch {self.label} ({first_line(exc)}) and it is not cached locally: {self.fix()}")

    def cache_warning(self, exc: BaseException) -> str:
        return f"could not fetch {self.label} ({first_line(exc)}); using the cached snapshot"


def resolve_dataset(uri: str, revision: str | None = None, timeout_s: float = 30.0) -> str:
    """A local directory holding the data set repository ``uri`` (``hf://`` or ``ms://``)."""
    scheme = split_uri(uri)[0]
    if scheme not in _SNAPSHOT:
        raise SourceError(f"{uri}: unknown data set scheme {scheme!r}; use hf://org/name, ms://org/name or a "
                          "local path")
    _, repo_id, revision = parse_hub_uri(uri, revision)
    return fetch_snapshot(HubDataset(uri, scheme, repo_id, revision, timeout_s))


__all__ = ["HubDataset", "resolve_dataset"]
