"""``hf://org/name[@revision]``: models on the Hugging Face Hub, through ``huggingface_hub``.

Resolution follows the hub policy (:mod:`twinkle_core.sources.hub_policy`): the repository is looked up
first (bounded by ``timeout_s``), which makes unknown ids, gated repositories and an unreachable hub fail
in seconds, then the snapshot is downloaded under the download deadline (``TWINKLE_DOWNLOAD_TIMEOUT``). With
``HF_HUB_OFFLINE=1`` (or ``TWINKLE_OFFLINE=1``) only the local cache is used. When the hub cannot be reached,
a cached snapshot is used if there is one.
"""

from __future__ import annotations

import os
from typing import Any

from twinkle_core.errors import SourceError
from twinkle_core.sources.hub_policy import HubRepository, HubSource, missing_package
from twinkle_core.sources.resolve import call_with_deadline, first_line, supported_kwargs


def import_huggingface_hub(kind: str) -> Any:
    """The ``huggingface_hub`` module, or the error naming ``pip install`` for ``hf://`` ``kind`` ("models")."""
    try:
        import huggingface_hub
    except ImportError as exc:
        raise missing_package("hf", kind, "huggingface_hub", exc) from exc
    return huggingface_hub


def _is(exc: BaseException, *names: str) -> bool:
    return any(cls.__name__ in names for cls in type(exc).__mro__)


class HuggingFaceModel(HubRepository):
    """A model repository on the Hugging Face Hub."""

    def __init__(self, uri: str, repo_id: str, revision: str | None, timeout_s: float) -> None:
        super().__init__(uri, repo_id, revision, timeout_s)
        self.hub = import_huggingface_hub("models")
        self.etag_timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or timeout_s)

    def snapshot(self, local_only: bool) -> str:
        kwargs = supported_kwargs(self.hub.snapshot_download, revision=self.revision, local_files_only=local_only,
                                  etag_timeout=self.etag_timeout)
        return str(self.hub.snapshot_download(self.repo_id, **kwargs))

    def look_up(self) -> None:
        call_with_deadline(
            lambda: self.hub.HfApi().model_info(self.repo_id, revision=self.revision, timeout=self.timeout_s),
            self.timeout_s, f"looking up {self.uri} on the Hugging Face Hub")

    def refusal(self, exc: BaseException) -> SourceError | None:
        """A clear error for failures that retrying or the cache cannot fix; ``None`` for network trouble."""
        uri, repo_id = self.uri, self.repo_id
        if _is(exc, "GatedRepoError"):
            return SourceError(f"{uri} is a gated model: request access on https://huggingface.co/{repo_id} and "
                               f"log in (`hf auth login` or HF_TOKEN)")
        if _is(exc, "RepositoryNotFoundError"):
            return SourceError(f"{uri}: no model {repo_id!r} on the Hugging Face Hub (check the spelling; a private "
                               f"model needs `hf auth login` or HF_TOKEN)")
        if _is(exc, "RevisionNotFoundError"):
            return SourceError(f"{uri}: revision {self.revision!r} does not exist")
        if _is(exc, "HFValidationError"):
            return SourceError(f"{uri}: invalid repository id ({first_line(exc)})")
        return None

    def offline_error(self, exc: BaseException) -> SourceError:
        if isinstance(exc, SourceError):
            return exc
        return SourceError(
            f"{self.uri} is not in the local Hugging Face cache and offline mode is on "
            f"(HF_HUB_OFFLINE / TWINKLE_OFFLINE); download it first (`hf download {self.repo_id}`) or "
            f"unset the offline variable ({first_line(exc)})"
        )

    def unreachable_error(self, exc: BaseException) -> SourceError:
        reason = str(exc) if isinstance(exc, SourceError) else first_line(exc)
        return SourceError(
            f"cannot reach the Hugging Face Hub to resolve {self.uri} and it is not cached locally: {reason}. "
            f"Check the network or HF_ENDPOINT, or copy the model to a local directory and use its path"
        )

    def download_error(self, exc: BaseException) -> SourceError:
        return self.refusal(exc) or SourceError(f"downloading {self.uri} failed: {first_line(exc)}")

    def cache_warning(self, exc: BaseException) -> str:
        return f"the Hugging Face Hub is unreachable ({first_line(exc)}); using the cached snapshot of {self.uri}"


class HuggingFaceSource(HubSource):
    scheme = "hf"
    repository = HuggingFaceModel
