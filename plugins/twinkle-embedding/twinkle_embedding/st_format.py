"""Reading and writing the sentence-transformers layout of a model directory.

A sentence-transformers directory is a transformers checkpoint (weights, ``config.json``, tokenizer)
plus:

* ``modules.json``: the module pipeline, here ``Transformer`` (path ``""``) -> ``Pooling``
  (``1_Pooling``) -> optionally ``Normalize`` (``2_Normalize``);
* ``1_Pooling/config.json``: the pooling mode and the embedding dimension;
* ``sentence_bert_config.json``: the Transformer module's ``max_seq_length`` / ``do_lower_case``;
* ``config_sentence_transformers.json``: prompts (``{"query": "...", "document": "..."}``) and the
  similarity function.

What we write uses the long-standing names (``sentence_transformers.models.Pooling``, the
``pooling_mode_*`` flags), which every sentence-transformers release from 2.x to 6.x loads. What
we read accepts those and the 5.x/6.x forms (``pooling_mode: "mean"``, new module paths).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_embedding.pooling import ST_NAMES

MODULES_FILE = "modules.json"
POOLING_DIR = "1_Pooling"
NORMALIZE_DIR = "2_Normalize"
TRANSFORMER_CONFIG = "sentence_bert_config.json"
ST_CONFIG = "config_sentence_transformers.json"

_LEGACY_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_FROM_ST = {"mean": "mean", "cls": "cls", "lasttoken": "last_token"}


@dataclass
class SentenceTransformersConfig:
    """What a sentence-transformers directory says about how to encode with it."""

    path: str
    pooling: str | None = None
    normalize: bool = False
    dimension: int | None = None
    max_seq_length: int | None = None
    do_lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    similarity_fn_name: str | None = None


def _load_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read this sentence-transformers file ({exc})") from None


def _module_kind(entry: dict[str, Any]) -> str:
    return str(entry.get("type", "")).rsplit(".", 1)[-1]


def _pooling_mode(config: dict[str, Any], where: str) -> str:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for flag, name in _LEGACY_FLAGS.items() if config.get(flag)]
        mode = modes if modes else "mean"
    if isinstance(mode, (list, tuple)):
        if len(mode) != 1:
            raise ConfigError(f"{where}: pooling {list(mode)} concatenates several modes; Twinkle supports one of "
                              f"mean, cls, last_token")
        mode = mode[0]
    if mode not in _FROM_ST:
        raise ConfigError(f"{where}: pooling mode {mode!r} is not supported; Twinkle supports mean, cls and "
                          f"last_token (sentence-transformers' lasttoken)")
    if config.get("include_prompt", True) is False:
        raise ConfigError(f"{where}: include_prompt=false (prompt tokens excluded from pooling) is not supported")
    return _FROM_ST[mode]


def read_sentence_transformers_config(directory: str | os.PathLike[str] | None) -> SentenceTransformersConfig | None:
    """The pooling, normalisation, length and prompts of a sentence-transformers directory, or ``None``
    when ``directory`` has no ``modules.json``. Pipelines Twinkle cannot reproduce (Dense layers,
    several pooling modes, a Transformer in a sub-folder) raise :class:`ConfigError`."""
    if directory is None:
        return None
    directory = os.fspath(directory)
    modules_path = os.path.join(directory, MODULES_FILE)
    if not os.path.isfile(modules_path):
        return None
    modules = _load_json(modules_path)
    if not isinstance(modules, list):
        raise ConfigError(f"{modules_path}: expected a list of modules")
    found = SentenceTransformersConfig(path=directory)
    for entry in sorted(modules, key=lambda e: e.get("idx", 0)):
        kind = _module_kind(entry)
        sub = os.path.join(directory, entry.get("path", "") or "")
        if kind == "Transformer":
            if entry.get("path", ""):
                raise ConfigError(f"{modules_path}: the Transformer module lives in {entry['path']!r}; point "
                                  f"model.model_id at {sub} (its weights) and keep the other files next to it")
        elif kind == "Pooling":
            config_path = os.path.join(sub, "config.json")
            config = _load_json(config_path) if os.path.isfile(config_path) else {}
            found.pooling = _pooling_mode(config, config_path)
            dim = config.get("embedding_dimension", config.get("word_embedding_dimension"))
            found.dimension = int(dim) if dim is not None else None
        elif kind == "Normalize":
            found.normalize = True
        else:
            raise ConfigError(f"{modules_path}: module {entry.get('type')!r} is not supported by the Twinkle "
                              f"embedding task (it supports Transformer -> Pooling -> Normalize)")
    transformer_config = os.path.join(directory, TRANSFORMER_CONFIG)
    if os.path.isfile(transformer_config):
        config = _load_json(transformer_config)
        if config.get("max_seq_length") is not None:
            found.max_seq_length = int(config["max_seq_length"])
        found.do_lower_case = bool(config.get("do_lower_case", False))
    st_config = os.path.join(directory, ST_CONFIG)
    if os.path.isfile(st_config):
        config = _load_json(st_config)
        prompts = config.get("prompts") or {}
        if isinstance(prompts, dict):
            found.prompts = {str(k): str(v) for k, v in prompts.items() if v}
        found.similarity_fn_name = config.get("similarity_fn_name")
    return found


def write_sentence_transformers_config(directory: str | os.PathLike[str], *, pooling: str, normalize: bool,
                                       dimension: int, max_seq_length: int | None = None,
                                       do_lower_case: bool = False, prompts: dict[str, str] | None = None,
                                       similarity_fn_name: str = "cosine") -> list[str]:
    """Write the files that make ``directory`` (a saved transformers model) a sentence-transformers model.

    Returns the paths written.
    """
    directory = os.fspath(directory)
    if pooling not in ST_NAMES:
        raise ConfigError(f"cannot write pooling {pooling!r} for sentence-transformers")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": POOLING_DIR, "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": NORMALIZE_DIR, "type": "sentence_transformers.models.Normalize"})
    pooling_config = {"word_embedding_dimension": int(dimension)}
    pooling_config.update({flag: ST_NAMES[pooling] == name for flag, name in _LEGACY_FLAGS.items()})
    pooling_config["include_prompt"] = True
    transformer_config: dict[str, Any] = {"max_seq_length": max_seq_length, "do_lower_case": bool(do_lower_case)}
    st_config = {
        "__version__": {"twinkle_embedding": _version()},
        "prompts": {k: v for k, v in (prompts or {}).items() if v},
        "default_prompt_name": None,
        "similarity_fn_name": similarity_fn_name,
    }
    written = []

    def dump(relative: str, payload: Any) -> None:
        path = os.path.join(directory, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=2)
            handle.write("\n")
        written.append(path)

    dump(MODULES_FILE, modules)
    dump(os.path.join(POOLING_DIR, "config.json"), pooling_config)
    if normalize:
        os.makedirs(os.path.join(directory, NORMALIZE_DIR), exist_ok=True)
    dump(TRANSFORMER_CONFIG, transformer_config)
    dump(ST_CONFIG, st_config)
    return written


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("twinkle-embedding")
    except Exception:  # not installed as a distribution (tests from a checkout)
        return "0+unknown"
