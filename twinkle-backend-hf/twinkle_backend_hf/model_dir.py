"""What is wrong with a local model or tokenizer directory that transformers cannot load, as one error naming the
directory or its ``config.json`` and the fix, instead of transformers' own traceback.

:func:`check_model_directory` runs before a model is loaded from a directory (and ``twinkle train`` / ``--dry-run``
run it through :meth:`TransformersModel.check_model_directory` before anything is built): it reads ``config.json``
as JSON and looks its ``model_type`` up in transformers' table, without running any code of the repository, and
refuses only what transformers would refuse too. :func:`explain_unloadable_tokenizer` wraps loading a tokenizer: a
directory holding no tokenizer file is refused first (transformers fails on it with an unrelated message, or builds an
empty tokenizer from ``config.json`` alone), and a failure its ``config.json`` explains becomes the error naming it.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator
from pathlib import Path

from twinkle_core.errors import ConfigError, SourceError, TwinkleError
from twinkle_core.sources.local import directory_contents, read_model_config

#: how the files of a tokenizer are named (a directory transformers loads a tokenizer from holds one at least)
TOKENIZER_FILE_PREFIXES = ("tokenizer", "vocab", "merges", "spiece", "sentencepiece", "special_tokens_map",
                           "added_tokens", "spm")
TOKENIZER_FILE_SUFFIXES = (".model", ".tiktoken", ".spm")
TOKENIZER_FIX = ("point model.model_id at a complete transformers model directory, or set model.tokenizer to a "
                 "directory (or hf://org/name) holding the tokenizer")


def known_model_types() -> list[str]:
    """The ``model_type`` values this transformers builds (with those registered at run time)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return list(CONFIG_MAPPING.keys())


def _named_like_a_model_type(path: Path, known: list[str]) -> bool:
    """transformers before 5 takes a config.json without ``model_type`` for the architecture named in its path."""
    import transformers

    return int(transformers.__version__.split(".")[0]) < 5 and any(t in str(path) for t in known)


def check_model_directory(path: str | Path) -> None:
    """Raise one :class:`~twinkle_core.errors.TwinkleError` naming the directory or its ``config.json`` when
    transformers cannot load a model from the local directory ``path``: no ``config.json`` (empty, or only weights),
    a damaged one, one without ``model_type``, or a ``model_type`` this transformers does not know. A repository
    with its own code (``auto_map``) is left to transformers, which asks for ``trust_remote_code``."""
    path = Path(path)
    config = read_model_config(path)
    if config is None:  # not a directory, or an adapter directory
        return
    auto_map = config.get("auto_map")
    if isinstance(auto_map, dict) and "AutoConfig" in auto_map:
        return
    file = path / "config.json"
    model_type = config.get("model_type")
    known = known_model_types()
    if model_type is None and not _named_like_a_model_type(path, known):
        raise ConfigError(f"{file} has no model_type, so transformers cannot tell which architecture the model is; "
                          f"add it (e.g. \"model_type\": \"qwen2\", as in the config.json of the model's original "
                          f"repository), or download the model again")
    if model_type is None:
        return
    if not isinstance(model_type, str):
        raise ConfigError(f"{file}: model_type must be a string such as \"qwen2\", got {model_type!r}")
    if model_type not in known:
        raise ConfigError(unknown_model_type_message(file, model_type, known))


def unknown_model_type_message(file: Path, model_type: str, known: list[str]) -> str:
    import transformers

    close = difflib.get_close_matches(model_type, known, n=1)
    typo = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"{file}: model_type {model_type!r} is not an architecture transformers {transformers.__version__} knows. "
            f"If the model is newer than this transformers, upgrade it: pip install --upgrade transformers; if "
            f"model_type is misspelled, correct it in {file.name}{typo}; if the model ships its own modeling code, "
            f"its config.json needs the auto_map entry of its original repository, and running that code needs "
            f"model.trust_remote_code: true in the recipe")


def holds_tokenizer_file(path: str | Path) -> bool:
    """Whether the local directory ``path`` holds a tokenizer file (``tokenizer.json``, ``tokenizer_config.json``,
    ``vocab.*``, ``*.model`` ...); False for a path that is not a directory."""
    path = Path(path)
    return path.is_dir() and any(p.is_file() and (p.name.startswith(TOKENIZER_FILE_PREFIXES) or
                                                  p.name.endswith(TOKENIZER_FILE_SUFFIXES)) for p in path.iterdir())


def check_tokenizer_directory(path: str | Path) -> None:
    """Raise :class:`~twinkle_core.errors.SourceError` naming the local directory ``path`` when it holds no tokenizer
    file at all (``tokenizer.json``, ``tokenizer_config.json``, ``vocab.*``, ``*.model`` ...): transformers then fails
    with an unrelated message, or builds an empty tokenizer from ``config.json`` alone."""
    path = Path(path)
    if not path.is_dir() or holds_tokenizer_file(path):
        return
    contents = directory_contents(path)
    if not contents:
        raise SourceError(f"cannot load a tokenizer from {str(path)!r}: the directory is empty; {TOKENIZER_FIX}")
    raise SourceError(f"cannot load a tokenizer from {str(path)!r}: the directory holds no tokenizer file "
                      f"(tokenizer.json, tokenizer_config.json, vocab.json ...; it holds {contents}); {TOKENIZER_FIX}")


@contextlib.contextmanager
def explain_unloadable_tokenizer(path: str) -> Iterator[None]:
    """Load a tokenizer from ``path`` inside: a directory without any tokenizer file is refused first
    (:func:`check_tokenizer_directory`), and transformers' failure on a ``config.json`` it cannot read is re-raised
    as the error naming that file (:func:`check_model_directory`); any other failure is raised as it is."""
    check_tokenizer_directory(path)
    try:
        yield
    except (OSError, ValueError) as exc:
        problem = None if isinstance(exc, TwinkleError) else config_problem(path)
        if problem is None:
            raise
        raise problem from exc


def config_problem(path: str | Path) -> TwinkleError | None:
    """The error :func:`check_model_directory` raises for the ``config.json`` of the directory ``path``; ``None`` when
    it has none (a tokenizer-only directory) or transformers can read it."""
    if not (Path(path) / "config.json").is_file():
        return None
    try:
        check_model_directory(path)
    except TwinkleError as exc:
        return exc
    return None
