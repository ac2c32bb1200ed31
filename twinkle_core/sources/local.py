"""A model directory (or file) on disk: ``/models/qwen``, ``./tiny``, ``local:///models/qwen``."""

from __future__ import annotations

from pathlib import Path

from twinkle_core.errors import SourceError
from twinkle_core.sources.base import ModelSource, split_uri


class LocalSource(ModelSource):
    scheme = "local"

    def resolve(self, uri: str, *, revision: str | None = None, timeout_s: float = 30.0) -> str:
        _, raw = split_uri(uri)
        if not raw:
            raise SourceError(f"empty model path {uri!r}")
        path = Path(raw).expanduser()
        if not path.exists():
            hint = ""
            parts = raw.split("/")
            if len(parts) == 2 and not raw.startswith((".", "/", "~")):
                hint = f" To download it from a hub, write hf://{raw} (Hugging Face) or ms://{raw} (ModelScope)."
            raise SourceError(f"model path {raw!r} does not exist (looked at {path.absolute()}).{hint}")
        if revision:
            raise SourceError(f"a revision ({revision!r}) was given for the local path {raw!r}; local models "
                              f"have no revisions, remove it")
        return str(path.resolve())
