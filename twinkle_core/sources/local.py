"""A model directory (or file) on disk: ``/models/qwen``, ``./tiny``, ``local:///models/qwen``.

A directory without ``config.json`` is refused when it is resolved if it holds weights (a
half-copied model) or a subdirectory with ``config.json`` (one level too high, e.g. an output
directory instead of its checkpoint): :func:`check_resolvable`. :func:`check_model_directory` is the full
check, and :func:`read_model_config` reads the directory's ``config.json`` with errors naming the file, for a
backend that loads a transformers model from the directory; an empty directory passes resolution, as
tokenizer-only directories and other backends' formats do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError, SourceError
from twinkle_core.sources.base import ModelSource, split_uri

MODEL_FILES = ("config.json", "adapter_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
#: how many of a directory's entries an error lists
LISTED_ENTRIES = 6


def _nested_models(path: Path) -> list[str]:
    return sorted(str(p.parent) for p in path.glob("*/config.json"))


def directory_contents(path: Path) -> str:
    """``"model.safetensors, tokenizer.json"``: the first entries of the directory ``path`` (subdirectories end in
    ``/``), for an error message; ``""`` when it is empty."""
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    more = f" and {len(entries) - LISTED_ENTRIES} more" if len(entries) > LISTED_ENTRIES else ""
    return ", ".join(entries[:LISTED_ENTRIES]) + more


def check_model_directory(path: str | Path) -> None:
    """Raise :class:`SourceError` naming ``path`` when it is a directory without ``config.json``."""
    path = Path(path)
    if not path.is_dir() or any((path / name).is_file() for name in MODEL_FILES):
        return
    nested = _nested_models(path)
    if nested:
        raise SourceError(f"model directory {str(path)!r} has no config.json. It is in a subdirectory: use {nested[0]}.")
    contents = directory_contents(path)
    missing = (f"has no config.json (it holds {contents}), so it is not a complete model" if contents
               else "is empty: it has no config.json, weights or tokenizer")
    raise SourceError(f"model directory {str(path)!r} {missing}. Point model.model_id at a transformers model "
                      f"directory (config.json, the weights and the tokenizer), or download one with hf://org/name.")


def check_resolvable(path: str | Path) -> None:
    """What resolving the local ``path`` refuses: a directory without ``config.json`` that holds weights or a model
    in a subdirectory (:func:`check_model_directory`). An empty directory and any other directory pass."""
    path = Path(path)
    if path.is_dir() and (any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir()) or _nested_models(path)):
        check_model_directory(path)


def read_model_config(path: str | Path) -> dict[str, Any] | None:
    """The ``config.json`` of the model directory ``path``, parsed; ``None`` when ``path`` is not a directory or is an
    adapter directory (``adapter_config.json`` and no ``config.json``).

    Raises :class:`SourceError` naming the directory when it has neither file (:func:`check_model_directory`) or the
    file cannot be read, and :class:`ConfigError` naming the file when it is not a JSON object."""
    path = Path(path)
    if not path.is_dir():
        return None
    check_model_directory(path)
    file = path / "config.json"
    if not file.is_file():
        return None
    damaged = "the model directory is damaged: copy or download the model again"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{file}: not UTF-8 text (byte {exc.start}); {damaged}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{file}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                          f"{damaged}") from None
    except OSError as exc:
        raise SourceError(f"{file} cannot be read: {exc.strerror or exc}; check its permissions") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: must be a JSON object of settings, got a {type(data).__name__}; {damaged}")
    return data


def check_local_path(raw: str) -> Path:
    """The local model path ``raw`` (a directory or file that exists); a missing one is a :class:`SourceError`,
    which for an ``org/name`` says how to download it from a hub instead. Resolving a local source checks it, and
    ``twinkle train`` / ``--dry-run`` before launching."""
    path = Path(raw).expanduser()
    if not path.exists():
        hint = ""
        if len(raw.split("/")) == 2 and not raw.startswith((".", "/", "~")):
            hint = f" To download it from a hub, write hf://{raw} (Hugging Face) or ms://{raw} (ModelScope)."
        raise SourceError(f"model path {raw!r} does not exist (looked at {path.absolute()}).{hint}")
    return path


class LocalSource(ModelSource):
    scheme = "local"

    def resolve(self, uri: str, *, revision: str | None = None, timeout_s: float = 30.0) -> str:
        _, raw = split_uri(uri)
        if not raw:
            raise SourceError(f"empty model path {uri!r}")
        path = check_local_path(raw)
        if revision:
            raise SourceError(f"a revision ({revision!r}) was given for the local path {raw!r}; local models "
                              f"have no revisions, remove it")
        check_resolvable(path)
        return str(path.resolve())
