"""A model directory (or file) on disk: ``/models/qwen``, ``./tiny``, ``local:///models/qwen``.

A directory without ``config.json`` is refused when it is resolved if it holds weights (a
half-copied model) or a subdirectory with ``config.json`` (one level too high, e.g. an output
directory instead of its checkpoint). :func:`check_model_directory` is the full check, for a
backend that loads a transformers model from the directory; an empty directory passes resolution,
as tokenizer-only directories and other backends' formats do.
"""

from __future__ import annotations

from pathlib import Path

from twinkle_core.errors import SourceError
from twinkle_core.sources.base import ModelSource, split_uri

MODEL_FILES = ("config.json", "adapter_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _nested_models(path: Path) -> list[str]:
    return sorted(str(p.parent) for p in path.glob("*/config.json"))


def check_model_directory(path: str | Path) -> None:
    """Raise :class:`SourceError` naming ``path`` when it is a directory without ``config.json``."""
    path = Path(path)
    if not path.is_dir() or any((path / name).is_file() for name in MODEL_FILES):
        return
    nested = _nested_models(path)
    hint = f" It is in a subdirectory: use {nested[0]}." if nested else (
        " Point model.model_id at a transformers model directory (config.json, the weights and the tokenizer),"
        " or download one with hf://org/name.")
    raise SourceError(f"model directory {str(path)!r} has no config.json.{hint}")


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
        if path.is_dir() and (any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir()) or _nested_models(path)):
            check_model_directory(path)
        return str(path.resolve())
