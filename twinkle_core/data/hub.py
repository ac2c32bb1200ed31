"""Data set repositories on a hub: ``hf://org/name[@revision]`` and ``ms://org/name[@revision]``.

:func:`resolve_dataset` returns a local directory holding the repository's files (a snapshot of
the data set repository), which :func:`twinkle_core.data.loading.load_records` then reads with
``datasets``. It follows the model sources' rules (:mod:`twinkle_core.sources.resolve`): with
``HF_HUB_OFFLINE=1`` / ``TWINKLE_OFFLINE=1`` only the local cache is used, every network call runs
under a wall-clock deadline, and every failure is a :class:`~twinkle_core.errors.SourceError`
naming the id and what to do (download the data set and pass its local path).
"""

from __future__ import annotations

import logging
from typing import Any

from twinkle_core.errors import SourceError
from twinkle_core.sources.base import split_uri
from twinkle_core.sources.resolve import (
    call_with_deadline,
    check_repo_id,
    download_timeout_s,
    first_line,
    offline_mode,
    split_revision,
    supported_kwargs,
)

logger = logging.getLogger("twinkle.data")

_HOW = {
    "hf": "hf download {repo} --repo-type dataset --local-dir DIR",
    "ms": "modelscope download --dataset {repo} --local_dir DIR",
}


def _fix(scheme: str, repo_id: str) -> str:
    command = _HOW.get(scheme, "").format(repo=repo_id)
    return (f"download it where there is network (`{command}`), copy DIR here and put its local path "
            "(or one of its files) in data.train / data.eval")


def _snapshot_hf(repo_id: str, revision: str | None, local_only: bool, timeout_s: float) -> str:
    try:
        import huggingface_hub as hub
    except ImportError as exc:
        raise SourceError(f"hf:// data sets need the huggingface_hub package: pip install huggingface_hub "
                          f"({first_line(exc)})") from exc
    kwargs = supported_kwargs(hub.snapshot_download, repo_type="dataset", revision=revision,
                              local_files_only=local_only, etag_timeout=timeout_s)
    return str(hub.snapshot_download(repo_id, **kwargs))


def _snapshot_ms(repo_id: str, revision: str | None, local_only: bool, timeout_s: float) -> str:
    try:
        from modelscope import dataset_snapshot_download as download
    except ImportError as exc:
        raise SourceError(f"ms:// data sets need the modelscope package: pip install modelscope "
                          f"({first_line(exc)})") from exc
    kwargs: dict[str, Any] = {"revision": revision} if revision else {}
    if local_only:
        kwargs["local_files_only"] = True
    return str(download(repo_id, **supported_kwargs(download, **kwargs)))


_SNAPSHOT = {"hf": _snapshot_hf, "ms": _snapshot_ms}


def resolve_dataset(uri: str, revision: str | None = None, timeout_s: float = 30.0) -> str:
    """A local directory holding the data set repository ``uri`` (``hf://`` or ``ms://``)."""
    scheme, rest = split_uri(uri)
    if scheme not in _SNAPSHOT:
        raise SourceError(f"{uri}: unknown data set scheme {scheme!r}; use hf://org/name, ms://org/name or a "
                          "local path")
    repo_id, revision = split_revision(rest, revision)
    check_repo_id(uri, repo_id, f"{scheme}://org/name (or {scheme}://org/name@revision)")
    snapshot = _SNAPSHOT[scheme]

    def cached() -> str:
        return call_with_deadline(lambda: snapshot(repo_id, revision, True, timeout_s), timeout_s,
                                  f"reading the data set {uri} from the local cache")

    if offline_mode():
        try:
            return cached()
        except Exception as exc:
            raise SourceError(f"the data set {uri} is not in the local cache and offline mode is on "
                              f"(HF_HUB_OFFLINE / TWINKLE_OFFLINE): {_fix(scheme, repo_id)} "
                              f"({first_line(exc)})") from exc
    try:
        if scheme == "hf":  # a bounded look-up first: an unreachable hub fails in seconds, not at the download
            import huggingface_hub as hub

            call_with_deadline(lambda: hub.HfApi().dataset_info(repo_id, revision=revision, timeout=timeout_s),
                               timeout_s, f"looking up the data set {uri}")
        return call_with_deadline(lambda: snapshot(repo_id, revision, False, timeout_s), download_timeout_s(),
                                  f"downloading the data set {uri}")
    except Exception as exc:
        try:
            path = cached()
        except Exception:
            raise SourceError(f"cannot fetch the data set {uri} ({first_line(exc)}) and it is not cached "
                              f"locally: {_fix(scheme, repo_id)}") from exc
        logger.warning("could not fetch the data set %s (%s); using the cached snapshot", uri, first_line(exc))
        return path


__all__ = ["resolve_dataset"]
