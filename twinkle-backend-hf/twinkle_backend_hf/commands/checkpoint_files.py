"""What a checkpoint directory must hold before transformers or peft read it, checked without loading anything.

``chat``, ``export`` and ``eval`` call :func:`check_loadable` after the marker check and before any weights load,
so that a damaged or unusable directory is one error naming the file and the fix, not a traceback from deep inside
transformers:

- every Hugging Face JSON file there (``config.json``, ``tokenizer.json``, ``model.safetensors.index.json`` ...)
  parses, to a JSON object;
- ``config.json`` names a ``model_type`` this transformers knows, or custom code (``auto_map``) that the user
  allowed to run (``--trust-remote-code`` / ``TWINKLE_TRUST_REMOTE_CODE=1``);
- the weights are safetensors whose headers read and cover their files, every shard an index lists is there, and
  pickled weights (``pytorch_model.bin``, ``adapter_model.bin``) are refused, never unpickled;
- a tokenizer is there (transformers would otherwise build an empty one and chat would answer nothing).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError, TwinkleError

DAMAGED_FIX = ("the checkpoint is damaged (a disk or copy error, or an edit): use another copy or an earlier "
               "OUTPUT_DIR/checkpoint-N, or save it again")
#: the files of a Hugging Face directory that transformers or peft parse as JSON objects
JSON_FILES = ("config.json", "generation_config.json", "adapter_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "model.safetensors.index.json")
#: any of these says a tokenizer was saved here
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
TRUST_FIX = ("read that code, then allow it with --trust-remote-code (or TWINKLE_TRUST_REMOTE_CODE=1 in the "
             "environment)")
CONVERT_FIX = ("Twinkle never unpickles weights (loading a pickle can run any code in it): convert them to "
               "safetensors where you trust the file (model.save_pretrained(DIR, safe_serialization=True), or the "
               "Hugging Face 'convert to safetensors' space) and pass that directory")


class CheckpointDamagedError(TwinkleError, RuntimeError):
    """A checkpoint whose files do not match the sizes and hashes its marker recorded, or do not parse."""


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; a :class:`CheckpointDamagedError` naming it when it is not one."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointDamagedError(f"{path} is not text ({exc.reason} at byte {exc.start}); {DAMAGED_FIX}") from None
    except ValueError as exc:
        raise CheckpointDamagedError(f"{path} is not valid JSON ({exc}); {DAMAGED_FIX}") from None
    except OSError as exc:
        raise CheckpointDamagedError(f"{path} cannot be read ({exc.strerror or exc}); {DAMAGED_FIX}") from None
    if not isinstance(value, dict):
        raise CheckpointDamagedError(f"{path} holds a JSON {type(value).__name__}, not the JSON object it must be; "
                                     f"{DAMAGED_FIX}")
    return value


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``exc`` as ``Type: message`` on one line (an error is one line on the terminal), cut at ``limit``."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_json_files(directory: Path) -> None:
    for name in JSON_FILES:
        if (directory / name).is_file():
            read_json_object(directory / name)


# ---------------------------------------------------------------------- config.json
def check_model_config(directory: Path, *, trusted: bool) -> None:
    """``config.json`` names a model transformers can build: a known ``model_type``, or custom code it may run."""
    from transformers import __version__ as transformers_version
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = directory / "config.json"
    config = read_json_object(path)
    model_type = config.get("model_type")
    known = isinstance(model_type, str) and model_type in CONFIG_MAPPING
    if config.get("auto_map"):
        if trusted:
            return  # the checkpoint's own code builds the config
        if not known:
            raise ConfigError(f"{path} names custom code (auto_map) that must run to load this model, and running "
                              f"a checkpoint's code is off; {TRUST_FIX}")
        note_custom_code(path, f"transformers' own {model_type!r} classes load the model")
    elif not model_type:
        raise ConfigError(f"{path} has no model_type, so transformers cannot tell which model it is: copy config.json "
                          f"again from the model's source (or add its \"model_type\", e.g. \"qwen2\")")
    elif not known:
        raise ConfigError(f"{path}: model_type {model_type!r} is not a model transformers {transformers_version} "
                          f"knows: upgrade it (pip install -U transformers), or correct model_type")
    build_config(directory)


def build_config(directory: Path) -> None:
    """transformers builds the config of ``directory`` (a value of the wrong type fails here, naming the file)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(directory), trust_remote_code=False)
    except (StrictDataclassError, TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"{directory / 'config.json'} cannot be used ({one_line(exc)}): correct it, or copy "
                          f"config.json again from the model's source") from None


def note_custom_code(path: Path, instead: str) -> None:
    print(f"twinkle: {path} names custom code (auto_map) that is not run: {instead} (--trust-remote-code would run "
          f"that code instead)", file=sys.stderr)


def check_tokenizer_code(directory: Path, *, trusted: bool) -> None:
    """A tokenizer naming custom code that may not run: refused when its class is not one transformers has (the
    custom code is needed), else loaded by transformers' own class, saying so."""
    import transformers

    path = directory / "tokenizer_config.json"
    if trusted or not path.is_file():
        return
    config = read_json_object(path)
    if not config.get("auto_map"):
        return
    name = config.get("tokenizer_class")
    if isinstance(name, str) and not any(hasattr(transformers, n) for n in (name, name.removesuffix("Fast"))):
        raise ConfigError(f"{path} names a tokenizer class of its own ({name!r}, auto_map) whose code must run to "
                          f"load it, and running a checkpoint's code is off; {TRUST_FIX}")
    note_custom_code(path, "transformers' own tokenizer class loads the tokenizer's files")


# ---------------------------------------------------------------------- weights
def check_safetensors(path: Path) -> None:
    """The safetensors header of ``path`` reads and its tensors lie within the file (a cut file fails here)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except (SafetensorError, OSError) as exc:
        raise CheckpointDamagedError(f"{path} is not a readable safetensors file ({exc}); {DAMAGED_FIX}") from None


def pickled_files(directory: Path, prefix: str) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.startswith(prefix) and p.suffix in PICKLE_SUFFIXES)


def refuse_pickled(directory: Path, prefix: str, missing: str) -> None:
    """No safetensors weights: refuse pickled ones by name, else say none are there."""
    pickled = pickled_files(directory, prefix)
    if pickled:
        more = f" (and {len(pickled) - 1} more)" if len(pickled) > 1 else ""
        raise ConfigError(f"{pickled[0]}{more} holds pickled PyTorch weights and no safetensors are beside it; "
                          f"{CONVERT_FIX}")
    raise ConfigError(missing)


def check_model_weights(directory: Path) -> None:
    """The full model's safetensors (one file, or an index and every shard it lists) are there and readable."""
    index = directory / SAFE_INDEX
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointDamagedError(f"{index} lists no shards (its 'weight_map' is missing or empty); "
                                         f"{DAMAGED_FIX}")
        for shard in sorted(set(map(str, weight_map.values()))):
            if Path(shard).name != shard:
                raise CheckpointDamagedError(f"{index} lists the shard {shard!r}, which is not a file name in "
                                             f"{directory}; {DAMAGED_FIX}")
            if not (directory / shard).is_file():
                raise CheckpointDamagedError(f"{directory / shard} is missing (listed in {SAFE_INDEX}); {DAMAGED_FIX}")
            check_safetensors(directory / shard)
        return
    if (directory / "model.safetensors").is_file():
        check_safetensors(directory / "model.safetensors")
        return
    refuse_pickled(directory, "pytorch_model", f"{directory} holds config.json but no weights (model.safetensors, or "
                                               f"{SAFE_INDEX} and its shards): copy the weights into it, or pass the "
                                               f"directory that holds them")


def check_adapter(directory: Path) -> None:
    """``adapter_config.json`` names a method peft knows and ``adapter_model.safetensors`` is there and readable."""
    from peft import PeftType
    from peft import __version__ as peft_version

    path = directory / "adapter_config.json"
    peft_type = read_json_object(path).get("peft_type")
    if peft_type is not None and peft_type not in {member.value for member in PeftType}:
        raise ConfigError(f"{path}: peft_type {peft_type!r} is not a method peft {peft_version} knows: upgrade it "
                          f"(pip install -U peft), or correct peft_type")
    weights = directory / "adapter_model.safetensors"
    if weights.is_file():
        check_safetensors(weights)
        return
    refuse_pickled(directory, "adapter_model", f"{directory} holds adapter_config.json but no adapter weights "
                                               f"(adapter_model.safetensors): copy them into it, or pass the directory "
                                               f"that holds them")


def has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def check_full_model(directory: Path, *, trusted: bool, tokenizer: bool) -> None:
    """A full model directory (or an adapter's local base): JSON, config, weights and, when asked, a tokenizer."""
    check_json_files(directory)
    check_model_config(directory, trusted=trusted)
    check_model_weights(directory)
    if tokenizer and not has_tokenizer(directory):
        raise ConfigError(f"{directory} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}): save it with "
                          f"the model (tokenizer.save_pretrained(DIR)) or copy the base model's tokenizer files there")
    if tokenizer:
        check_tokenizer_code(directory, trusted=trusted)


def check_loadable(path: Path, kind: str, base: str | None, *, trusted: bool) -> None:
    """Everything transformers and peft will read for the checkpoint at ``path`` (``kind`` "full" or "adapter",
    an adapter's local ``base`` included) is there and well-formed; raises the error that names the file."""
    if kind == "full":
        check_full_model(path, trusted=trusted, tokenizer=True)
        return
    check_json_files(path)
    check_adapter(path)
    check_tokenizer_code(path, trusted=trusted)
    base_dir = Path(base) if base else None
    if base_dir is None or not base_dir.is_dir():
        return  # a hub id: transformers fetches it, and the loader names what fails
    if not (base_dir / "config.json").is_file():
        raise ConfigError(f"the base model {base_dir} of adapter {path} holds no config.json, so it is not a model "
                          f"directory: pass the base model directory with --base DIR")
    check_full_model(base_dir, trusted=trusted, tokenizer=not has_tokenizer(path))
