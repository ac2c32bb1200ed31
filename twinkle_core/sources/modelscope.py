"""``ms://org/name[@revision]``: models on ModelScope, through the ``modelscope`` package.

``modelscope`` is imported only when an ``ms://`` URI is resolved; without it the error says
``pip install modelscope``. Resolution follows the hub policy (:mod:`twinkle_core.sources.hub_policy`):
offline mode (``TWINKLE_OFFLINE`` / ``HF_HUB_OFFLINE``) uses only the local cache, and the download runs
under the wall-clock deadline ``TWINKLE_DOWNLOAD_TIMEOUT``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twinkle_core.errors import SourceError
from twinkle_core.sources.hub_policy import HubRepository, HubSource, missing_package
from twinkle_core.sources.resolve import call_with_deadline, first_line, supported_kwargs


def modelscope_snapshot(download: Callable[..., Any], repo_id: str, revision: str | None, local_only: bool) -> str:
    """``download(repo_id, ...)`` (a ModelScope ``*snapshot_download``) with only the arguments it accepts."""
    kwargs: dict[str, Any] = {"revision": revision} if revision else {}
    if local_only:
        kwargs["local_files_only"] = True
    return str(download(repo_id, **supported_kwargs(download, **kwargs)))


def _is_network_error(exc: BaseException) -> bool:
    """Connection trouble (worth trying the cache), as opposed to an answer such as "no such model"."""
    if isinstance(exc, SourceError):  # the deadline expired
        return True
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int) and 400 <= status < 500:
        return False
    names = {cls.__name__ for cls in type(exc).__mro__}
    return isinstance(exc, (OSError, TimeoutError)) or bool(names & {"ConnectionError", "Timeout", "ConnectError"})


class ModelScopeModel(HubRepository):
    """A model repository on ModelScope."""

    def __init__(self, uri: str, repo_id: str, revision: str | None, timeout_s: float) -> None:
        super().__init__(uri, repo_id, revision, timeout_s)
        try:
            import modelscope
        except ImportError as exc:
            raise missing_package("ms", "models", "modelscope", exc) from exc
        self.download = getattr(modelscope, "snapshot_download", None)
        if self.download is None:
            from modelscope.hub.snapshot_download import snapshot_download

            self.download = snapshot_download

    def snapshot(self, local_only: bool) -> str:
        return modelscope_snapshot(self.download, self.repo_id, self.revision, local_only)

    def look_up(self) -> None:
        """Look the model up so that unknown ids fail fast; skipped when this modelscope lacks the API."""
        try:
            from modelscope.hub.api import HubApi
        except ImportError:
            return
        get_model = getattr(HubApi(), "get_model", None)
        if get_model is None:
            return
        kwargs = supported_kwargs(get_model, revision=self.revision) if self.revision else {}
        call_with_deadline(lambda: get_model(self.repo_id, **kwargs), self.timeout_s,
                           f"looking up ms://{self.repo_id} on ModelScope")

    def refusal(self, exc: BaseException) -> SourceError | None:
        if _is_network_error(exc):
            return None
        return SourceError(f"{self.uri}: ModelScope could not find model {self.repo_id!r} ({first_line(exc)}); check "
                           f"the spelling, or log in for a private model")

    def offline_error(self, exc: BaseException) -> SourceError:
        if isinstance(exc, SourceError):
            return exc
        return SourceError(f"{self.uri} is not in the local ModelScope cache and offline mode is on "
                           f"(TWINKLE_OFFLINE / HF_HUB_OFFLINE): {first_line(exc)}")

    def unreachable_error(self, exc: BaseException) -> SourceError:
        return SourceError(f"cannot reach ModelScope to resolve {self.uri} and it is not cached locally: {exc}")

    def download_error(self, exc: BaseException) -> SourceError:
        return SourceError(f"downloading {self.uri} from ModelScope failed: {first_line(exc)}")

    def cache_warning(self, exc: BaseException) -> str:
        return f"ModelScope is unreachable; using the cached snapshot of {self.uri}"


class ModelScopeSource(HubSource):
    scheme = "ms"
    repository = ModelScopeModel
