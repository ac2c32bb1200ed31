"""``hf://org/name[@revision]``: models on the Hugging Face Hub, through ``huggingface_hub``.

Resolution first looks the repository up (bounded by ``timeout_s``), which makes unknown ids,
gated repositories and an unreachable hub fail in seconds, then downloads the snapshot under the
download deadline (``TWINKLE_DOWNLOAD_TIMEOUT``). With ``HF_HUB_OFFLINE=1`` (or
``TWINKLE_OFFLINE=1``) only the local cache is used. When the hub cannot be reached, a cached
snapshot is used if there is one.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from twinkle_core.errors import SourceError
from twinkle_core.sources.base import ModelSource, split_uri
from twinkle_core.sources.resolve import (
    call_with_deadline,
    check_repo_id,
    download_timeout_s,
    first_line,
    offline_mode,
    split_revision,
    supported_kwargs,
)

logger = logging.getLogger("twinkle.sources")


def _import_hub() -> Any:
    try:
        import huggingface_hub
    except ImportError as exc:
        raise SourceError(f"hf:// models need the huggingface_hub package: pip install huggingface_hub "
                          f"({first_line(exc)})") from exc
    return huggingface_hub


def _is(exc: BaseException, *names: str) -> bool:
    return any(cls.__name__ in names for cls in type(exc).__mro__)


class HuggingFaceSource(ModelSource):
    scheme = "hf"

    def resolve(self, uri: str, *, revision: str | None = None, timeout_s: float = 30.0) -> str:
        repo_id, revision = split_revision(split_uri(uri)[1], revision)
        check_repo_id(uri, repo_id, "hf://org/name (or hf://org/name@revision)")
        hub = _import_hub()
        etag_timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or timeout_s)

        def snapshot(local_only: bool) -> str:
            kwargs = supported_kwargs(hub.snapshot_download, revision=revision, local_files_only=local_only,
                                      etag_timeout=etag_timeout)
            return str(hub.snapshot_download(repo_id, **kwargs))

        if offline_mode():
            try:
                return call_with_deadline(lambda: snapshot(True), timeout_s, f"reading {uri} from the local cache")
            except SourceError:
                raise
            except Exception as exc:
                raise SourceError(
                    f"{uri} is not in the local Hugging Face cache and offline mode is on "
                    f"(HF_HUB_OFFLINE / TWINKLE_OFFLINE); download it first (`hf download {repo_id}`) or "
                    f"unset the offline variable ({first_line(exc)})"
                ) from exc

        # 1. look the repository up: unknown ids and an unreachable hub fail here, fast.
        try:
            call_with_deadline(lambda: hub.HfApi().model_info(repo_id, revision=revision, timeout=timeout_s),
                               timeout_s, f"looking up {uri} on the Hugging Face Hub")
        except Exception as exc:
            explained = self._explain(exc, uri, repo_id, revision)
            if explained is not None:
                raise explained from exc
            # the hub is unreachable: fall back to a cached snapshot if there is one
            try:
                path = call_with_deadline(lambda: snapshot(True), timeout_s, f"reading {uri} from the local cache")
            except Exception:
                reason = str(exc) if isinstance(exc, SourceError) else first_line(exc)
                raise SourceError(
                    f"cannot reach the Hugging Face Hub to resolve {uri} and it is not cached locally: {reason}. "
                    f"Check the network or HF_ENDPOINT, or copy the model to a local directory and use its path"
                ) from exc
            logger.warning("the Hugging Face Hub is unreachable (%s); using the cached snapshot of %s",
                           first_line(exc), uri)
            return path

        # 2. download (or reuse the cache)
        try:
            return call_with_deadline(lambda: snapshot(False), download_timeout_s(), f"downloading {uri}")
        except SourceError:
            raise
        except Exception as exc:
            raise self._explain(exc, uri, repo_id, revision) or SourceError(
                f"downloading {uri} failed: {first_line(exc)}") from exc

    @staticmethod
    def _explain(exc: BaseException, uri: str, repo_id: str, revision: str | None) -> SourceError | None:
        """A clear error for failures that retrying or the cache cannot fix; ``None`` for network trouble."""
        if _is(exc, "GatedRepoError"):
            return SourceError(f"{uri} is a gated model: request access on https://huggingface.co/{repo_id} and "
                               f"log in (`hf auth login` or HF_TOKEN)")
        if _is(exc, "RepositoryNotFoundError"):
            return SourceError(f"{uri}: no model {repo_id!r} on the Hugging Face Hub (check the spelling; a private "
                               f"model needs `hf auth login` or HF_TOKEN)")
        if _is(exc, "RevisionNotFoundError"):
            return SourceError(f"{uri}: revision {revision!r} does not exist")
        if _is(exc, "HFValidationError"):
            return SourceError(f"{uri}: invalid repository id ({first_line(exc)})")
        return None
