"""``ms://org/name[@revision]``: models on ModelScope, through the ``modelscope`` package.

``modelscope`` is imported only when an ``ms://`` URI is resolved; without it the error says
``pip install modelscope``. Offline mode (``TWINKLE_OFFLINE`` / ``HF_HUB_OFFLINE``) uses only the
local cache. The download runs under the wall-clock deadline ``TWINKLE_DOWNLOAD_TIMEOUT``.
"""

from __future__ import annotations

import logging
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


def _import_modelscope() -> Any:
    try:
        import modelscope
    except ImportError as exc:
        raise SourceError(f"ms:// models need the modelscope package: pip install modelscope "
                          f"({first_line(exc)})") from exc
    return modelscope


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


def _probe(modelscope: Any, model_id: str, revision: str | None, timeout_s: float) -> None:
    """Look the model up so that unknown ids fail fast; skipped when this modelscope lacks the API."""
    try:
        from modelscope.hub.api import HubApi
    except ImportError:
        return
    get_model = getattr(HubApi(), "get_model", None)
    if get_model is None:
        return
    kwargs = supported_kwargs(get_model, revision=revision) if revision else {}
    call_with_deadline(lambda: get_model(model_id, **kwargs), timeout_s, f"looking up ms://{model_id} on ModelScope")


class ModelScopeSource(ModelSource):
    scheme = "ms"

    def resolve(self, uri: str, *, revision: str | None = None, timeout_s: float = 30.0) -> str:
        model_id, revision = split_revision(split_uri(uri)[1], revision)
        check_repo_id(uri, model_id, "ms://org/name (or ms://org/name@revision)")
        ms = _import_modelscope()
        download = getattr(ms, "snapshot_download", None)
        if download is None:
            from modelscope.hub.snapshot_download import snapshot_download as download

        def snapshot(local_only: bool) -> str:
            kwargs: dict[str, Any] = {"revision": revision} if revision else {}
            if local_only:
                kwargs["local_files_only"] = True
            return str(download(model_id, **supported_kwargs(download, **kwargs)))

        if offline_mode():
            try:
                return call_with_deadline(lambda: snapshot(True), timeout_s, f"reading {uri} from the local cache")
            except SourceError:
                raise
            except Exception as exc:
                raise SourceError(f"{uri} is not in the local ModelScope cache and offline mode is on "
                                  f"(TWINKLE_OFFLINE / HF_HUB_OFFLINE): {first_line(exc)}") from exc
        try:
            _probe(ms, model_id, revision, timeout_s)
        except Exception as exc:
            if not _is_network_error(exc):
                raise SourceError(f"{uri}: ModelScope could not find model {model_id!r} ({first_line(exc)}); check "
                                  f"the spelling, or log in for a private model") from exc
            try:
                path = call_with_deadline(lambda: snapshot(True), timeout_s, f"reading {uri} from the local cache")
            except Exception:
                raise SourceError(f"cannot reach ModelScope to resolve {uri} and it is not cached locally: {exc}") \
                    from exc
            logger.warning("ModelScope is unreachable; using the cached snapshot of %s", uri)
            return path
        try:
            return call_with_deadline(lambda: snapshot(False), download_timeout_s(), f"downloading {uri}")
        except SourceError:
            raise
        except Exception as exc:
            raise SourceError(f"downloading {uri} from ModelScope failed: {first_line(exc)}") from exc
