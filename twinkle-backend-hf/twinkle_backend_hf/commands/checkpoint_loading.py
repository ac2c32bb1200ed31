"""Finding and loading what ``twinkle train`` saved, with plain transformers / peft.

A checkpoint is one of:

- a full Hugging Face model directory (``config.json`` + weights), e.g. ``OUTPUT_DIR/final`` of a full
  fine-tune;
- a PEFT adapter directory (``adapter_config.json``) whose base model is recorded in the adapter config
  (``base_model_name_or_path``: a relative path there is relative to the adapter directory, see
  :mod:`~twinkle_backend_hf.adapter_base`) or given with ``--base``;
- a Twinkle output directory (``train.output_dir``): its ``final`` checkpoint, else its newest ``checkpoint-N``.

Before anything loads, a checkpoint is verified against its Twinkle marker (or said to be unverifiable without
one) and checked for what transformers and peft will read (:mod:`~twinkle_backend_hf.commands.checkpoint_files`:
parsable JSON, a known model type or allowed custom code, readable safetensors, no pickled weights, a tokenizer).
What transformers or peft still refuse while loading (a config value of the wrong type, weights of other shapes, an
adapter for another base, a hub base that is not cached) is one :class:`~twinkle_core.errors.TwinkleError` naming the
file and the fix. Custom code (``auto_map``) runs only with ``--trust-remote-code`` or
``TWINKLE_TRUST_REMOTE_CODE=1``.

Only this module's functions import torch / transformers / peft, and only when called.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_backend_hf.adapter_base import resolve_recorded_base
from twinkle_backend_hf.commands.checkpoint_files import (
    DAMAGED_FIX,
    TRUST_FIX,
    CheckpointDamagedError,
    check_loadable,
    has_tokenizer,
    one_line,
    read_json_object,
)
from twinkle_core import checkpoint
from twinkle_core.checkpoint_layout import CheckpointLayout
from twinkle_core.errors import ConfigError, TwinkleError
from twinkle_core.sources import resolve

WHAT_IS_A_CHECKPOINT = ("pass a directory written by 'twinkle train' (OUTPUT_DIR, OUTPUT_DIR/final or "
                        "OUTPUT_DIR/checkpoint-N), a Hugging Face model directory or a PEFT adapter directory")
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: the marker ``twinkle export`` writes last into its output: every file with its size and sha256 (the format of
#: the training checkpoints' ``twinkle_checkpoint.json``, under its own name so an export is never taken for a
#: resumable training checkpoint)
EXPORT_MARKER = "twinkle_export.json"


class OutputWriteError(TwinkleError, OSError):
    """A command's output could not be written (disk full, no permission); what was there before is unchanged."""


def output_write_error(path: Path, exc: OSError) -> OutputWriteError:
    full = " (the disk is full: free space or choose another disk)" if exc.errno == errno.ENOSPC else ""
    return OutputWriteError(f"could not write {path}: {exc.strerror or exc}{full}; nothing was replaced there; "
                            f"choose a writable location with --output")


def check_parent_writable(output: Path, flag: str = "--output") -> None:
    """A clear error when a directory above ``output`` is a file (mkdir would fail there)."""
    for parent in output.resolve().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{flag} {output}: {parent} is a file, not a directory; choose another path")
            return


@dataclass
class Checkpoint:
    path: Path  # the directory holding config.json or adapter_config.json
    kind: str  # "full" | "adapter"
    base: str | None = None  # the adapter's base model (a directory or a hub id)
    trust_remote_code: bool = False  # whether the checkpoint's own code (config.json auto_map) may run


def _looks_like_hub_id(value: str) -> bool:
    return not value.startswith((".", "/", "~")) and value.count("/") == 1 and not os.path.isabs(value)


def resolve_checkpoint(path: str | os.PathLike[str], base: str | None = None, *,
                       trust_remote_code: bool | None = None) -> Checkpoint:
    """What ``path`` is; a :class:`ConfigError` naming the fix when it is not a usable checkpoint.
    ``trust_remote_code``: ``--trust-remote-code`` (None: ``TWINKLE_TRUST_REMOTE_CODE`` decides)."""
    trusted = resolve.trust_remote_code(trust_remote_code)
    raw = str(path)
    p = Path(raw).expanduser()
    if not p.exists():
        raise ConfigError(f"checkpoint {raw!r} does not exist; {WHAT_IS_A_CHECKPOINT}")
    if not p.is_dir():
        raise ConfigError(f"checkpoint {raw!r} is a file, not a directory; {WHAT_IS_A_CHECKPOINT}")
    if not (p / "config.json").is_file() and not (p / "adapter_config.json").is_file():
        # a Twinkle output directory: its final checkpoint, else its newest checkpoint-N
        chosen = p / "final" if (p / "final").is_dir() else None
        if chosen is None:
            from twinkle_core.checkpoint import latest_checkpoint

            chosen = latest_checkpoint(p)
        if chosen is None or not ((chosen / "config.json").is_file() or (chosen / "adapter_config.json").is_file()):
            raise ConfigError(f"{raw!r} is not a checkpoint: it holds neither config.json (a full model) nor "
                              f"adapter_config.json (a PEFT adapter), nor a 'final' or 'checkpoint-N' directory; "
                              f"{WHAT_IS_A_CHECKPOINT}")
        print(f"twinkle: using checkpoint {chosen}", file=sys.stderr)
        p = chosen
    if (p / "adapter_config.json").is_file():
        recorded = read_json_object(p / "adapter_config.json").get("base_model_name_or_path")
        # a recorded relative path is relative to the adapter directory (adapter_base): the run folder may move
        chosen_base = base or (resolve_recorded_base(recorded, p) if isinstance(recorded, str) else recorded)
        if not chosen_base:
            raise ConfigError(f"{p} is a PEFT adapter whose adapter_config.json records no base model "
                              f"(base_model_name_or_path); pass the base model directory with --base DIR")
        if not Path(chosen_base).expanduser().is_dir() and not _looks_like_hub_id(chosen_base):
            where = "--base" if base else "adapter_config.json (base_model_name_or_path)"
            raise ConfigError(f"the base model {chosen_base!r} of adapter {p} (from {where}) does not exist; "
                              f"pass the base model directory with --base DIR")
        return Checkpoint(p, "adapter", str(Path(chosen_base).expanduser()) if Path(chosen_base).expanduser().is_dir()
                          else chosen_base, trusted)
    if base:
        print(f"twinkle: {p} is a full model; --base is ignored", file=sys.stderr)
    return Checkpoint(p, "full", trust_remote_code=trusted)


# ---------------------------------------------------------------------- verification
def verify_manifest(directory: Path, marker_name: str) -> int | None:
    """Check every file ``directory/marker_name`` lists (the core's :func:`~twinkle_core.checkpoint.verify_files`);
    the number of files checked, None for a marker of an older format that lists no files. Raises
    :class:`CheckpointDamagedError` naming the first missing, short or altered file and the fix."""
    try:
        return checkpoint.verify_files(directory, marker=marker_name)
    except checkpoint.CheckpointError as exc:
        raise CheckpointDamagedError(f"{exc} (listed in {marker_name}); {DAMAGED_FIX}") from None


def verify_directory(directory: Path) -> None:
    """Verify ``directory`` against its Twinkle marker (a training checkpoint's or an export's), printing one line
    either way: what was verified, or that a plain directory without a marker was not."""
    for marker_name in (CheckpointLayout.MARKER, EXPORT_MARKER):
        if (directory / marker_name).is_file():
            count = verify_manifest(directory, marker_name)
            done = (f"{count} files verified against {marker_name}" if count is not None
                    else f"{marker_name} lists no files (an older format): not verified")
            print(f"twinkle: {directory}: {done}", file=sys.stderr)
            return
    print(f"twinkle: {directory}: no Twinkle marker: not verified (without {CheckpointLayout.MARKER} or "
          f"{EXPORT_MARKER} its files cannot be checked against what was saved; they are used as they are)",
          file=sys.stderr)


def verify_checkpoint_files(ckpt: Checkpoint) -> None:
    """Verify the checkpoint (and an adapter's local base model) before any of its files is loaded: against its
    marker, then that what transformers and peft read is there and well-formed
    (:func:`~twinkle_backend_hf.commands.checkpoint_files.check_loadable`)."""
    verify_directory(ckpt.path)
    if ckpt.kind == "adapter" and ckpt.base and Path(ckpt.base).is_dir():
        verify_directory(Path(ckpt.base))
    check_loadable(ckpt.path, ckpt.kind, ckpt.base, trusted=ckpt.trust_remote_code)


def input_directories(ckpt: Checkpoint) -> list[Path]:
    """The directories a command reads the checkpoint from (an adapter's local base included), resolved."""
    dirs = [ckpt.path.resolve()]
    if ckpt.kind == "adapter" and ckpt.base and Path(ckpt.base).is_dir():
        dirs.append(Path(ckpt.base).resolve())
    return dirs


def is_within(path: Path, directory: Path) -> bool:
    """Whether resolved ``path`` is ``directory`` or lies below it."""
    return path == directory or directory in path.parents


@contextmanager
def atomic_export_directory(final: Path, metadata: dict[str, Any]) -> Iterator[Path]:
    """Yield a staging directory beside ``final`` that replaces ``final`` (whole) once the block succeeds, with
    :data:`EXPORT_MARKER` written last (the core's :func:`~twinkle_core.checkpoint.atomic_directory`); on failure
    the staging directory goes and ``final`` stays as it was. A write error is one :class:`OutputWriteError`."""
    final = final.resolve()
    try:
        with checkpoint.atomic_directory(str(final), is_main=True, metadata=metadata, marker=EXPORT_MARKER) as staging:
            yield Path(staging)
    except OSError as exc:
        raise output_write_error(final, exc) from None
    except checkpoint.CheckpointError as exc:  # the core's "disk full" names a checkpoint; say it of the export
        if not isinstance(exc.__cause__, OSError):
            raise
        raise output_write_error(final, exc.__cause__) from None


def torch_dtype(name: str | None) -> Any:
    import torch

    if name in (None, "auto"):
        return "auto"
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ConfigError(f"--dtype {name!r}: use one of {', '.join(DTYPES)}") from None


def default_device(device: str | None = None) -> str:
    """``device`` when given, else the active accelerator's device (cuda:0, npu:0, ... or cpu)."""
    if device:
        return device
    from twinkle_core.accelerator import current_accelerator

    return str(current_accelerator().device())


def checked_device(device: str | None) -> str | None:
    """``--device`` checked before anything loads: a torch device type this machine has (None: the default)."""
    if not device:
        return None
    import torch

    from twinkle_core.accelerator import current_accelerator

    current_accelerator()  # the active accelerator's plugin registers its device type with torch (npu, ...)
    usage = "use cpu or an accelerator's device such as cuda:1 or npu:0, or leave --device out (the active one)"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"--device {device} is not a torch device; {usage}") from None
    if parsed.type == "cpu":
        return device
    runtime = getattr(torch, parsed.type, None)
    if not callable(getattr(runtime, "is_available", None)):
        raise ConfigError(f"--device {device}: {parsed.type} is not a device a model can run on; {usage}")
    if not runtime.is_available():
        raise ConfigError(f"--device {device}: this machine has no {parsed.type} device; {usage}")
    count = runtime.device_count() if callable(getattr(runtime, "device_count", None)) else None
    if parsed.index is not None and count is not None and parsed.index >= count:
        raise ConfigError(f"--device {device}: this machine has {count} {parsed.type} device(s), numbered from 0; "
                          f"{usage}")
    return device


def is_local(source: str | Path) -> bool:
    return Path(source).expanduser().is_dir()


@contextmanager
def remote_code_refused(what: str) -> Iterator[None]:
    """transformers' refusal to run a repository's code ("pass `trust_remote_code=True`", which a command-line
    user cannot do) as a :class:`ConfigError` naming the command's switch."""
    try:
        yield
    except ValueError as exc:
        if "trust_remote_code=True" not in str(exc) or isinstance(exc, TwinkleError):
            raise
        raise ConfigError(f"{what} contains custom code that must run to load it, and running a checkpoint's code "
                          f"is off; {TRUST_FIX}") from None


@contextmanager
def hub_errors(source: str, ckpt: Checkpoint) -> Iterator[None]:
    """An ``OSError`` while transformers reads ``source``: a local directory that cannot be read (damaged), or a
    base model named by a hub id that cannot be fetched (offline, not cached, no such repository)."""
    try:
        yield
    except OSError as exc:
        if is_local(source):
            raise CheckpointDamagedError(f"{source} cannot be read ({one_line(exc)}); {DAMAGED_FIX}") \
                from None
        raise ConfigError(f"the base model {source!r} of adapter {ckpt.path} could not be loaded from the Hugging "
                          f"Face Hub or its cache ({one_line(exc)}): download it once while online, or "
                          f"pass the base model directory with --base DIR") from None


def tokenizer_source(ckpt: Checkpoint) -> str:
    """Where the tokenizer is read: the checkpoint, or an adapter's base when the adapter was saved without one."""
    return str(ckpt.base) if ckpt.kind == "adapter" and not has_tokenizer(ckpt.path) else str(ckpt.path)


def load_tokenizer(ckpt: Checkpoint) -> Any:
    from transformers import AutoTokenizer

    source = tokenizer_source(ckpt)
    with hub_errors(source, ckpt), remote_code_refused(f"the tokenizer at {source}"):
        try:
            return AutoTokenizer.from_pretrained(source, trust_remote_code=ckpt.trust_remote_code)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:  # a file of the wrong shape
            if "trust_remote_code=True" in str(exc) or not is_local(source):
                raise
            raise CheckpointDamagedError(f"the tokenizer files in {source} cannot be loaded "
                                         f"({one_line(exc)}); {DAMAGED_FIX}") from None
        except Exception as exc:
            if type(exc) is not Exception:  # the tokenizers library raises bare Exception for a malformed file
                raise
            raise CheckpointDamagedError(f"{Path(source) / 'tokenizer.json'} cannot be loaded "
                                         f"({one_line(exc)}); {DAMAGED_FIX}") from None


def load_config(source: str, ckpt: Checkpoint) -> Any:
    """The model's config; a config.json transformers refuses is one :class:`ConfigError` naming it."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    with hub_errors(source, ckpt), remote_code_refused(f"the model at {source}"):
        try:
            return AutoConfig.from_pretrained(source, trust_remote_code=ckpt.trust_remote_code)
        except (StrictDataclassError, TypeError, ValueError, KeyError) as exc:
            if "trust_remote_code=True" in str(exc):
                raise
            where = Path(source) / "config.json" if is_local(source) else f"the config.json of {source!r}"
            raise ConfigError(f"{where} cannot be used ({one_line(exc)}): correct it, or copy config.json "
                              f"again from the model's source") from None


def load_weights(source: str, ckpt: Checkpoint, config: Any, dtype: str | None) -> Any:
    """The model with ``source``'s safetensors weights, every tensor of the model loaded from them."""
    from transformers import AutoModelForCausalLM

    with hub_errors(source, ckpt), remote_code_refused(f"the model at {source}"):
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                source, config=config, dtype=torch_dtype(dtype), trust_remote_code=ckpt.trust_remote_code,
                use_safetensors=True, output_loading_info=True)
        except RuntimeError as exc:
            if "size mismatch" not in str(exc) and "ignore_mismatched_sizes" not in str(exc):
                raise
            raise ConfigError(f"the weights in {source} do not have the shapes its config.json gives (transformers' "
                              f"load report above lists them): config.json and the weights come from different "
                              f"models; copy both from the same save") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointDamagedError(f"the weights in {source} lack {missing[0]}{more}, which the model needs; "
                                     f"{DAMAGED_FIX}")
    return model


def load_adapter(model: Any, ckpt: Checkpoint) -> Any:
    """``model`` with the checkpoint's PEFT adapter; an adapter that does not fit it names ``--base``."""
    try:
        from peft import PeftModel
    except ImportError:
        raise ConfigError(f"{ckpt.path} is a PEFT adapter and peft is not installed: pip install peft") from None
    config = ckpt.path / "adapter_config.json"
    try:
        return PeftModel.from_pretrained(model, str(ckpt.path))
    except RuntimeError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line]
        if not lines:
            raise
        raise ConfigError(f"adapter {ckpt.path} does not fit the base model {ckpt.base} ({lines[0]}): it was trained "
                          f"on another base; pass that one with --base DIR") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"adapter {ckpt.path} cannot be applied to the base model {ckpt.base} "
                          f"({one_line(exc)}): pass the base it was trained on with --base DIR, or correct "
                          f"{config}") from None


def load_model(ckpt: Checkpoint, *, dtype: str | None = "auto", device: str | None = None,
               merge: bool = False) -> Any:
    """The model, in eval mode, on ``device``: a PEFT model for an adapter (merged when ``merge``)."""
    source = str(ckpt.base) if ckpt.kind == "adapter" else str(ckpt.path)
    model = load_weights(source, ckpt, load_config(source, ckpt), dtype)
    if ckpt.kind == "adapter":
        model = load_adapter(model, ckpt)
        if merge:
            model = model.merge_and_unload()
    return model.to(default_device(device)).eval()


def stop_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """Token ids that end an answer: the model's / tokenizer's EOS and the chat template's end-of-turn token."""
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v >= 0 and v not in ids:
                ids.append(v)

    add(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    add(tokenizer.eos_token_id)
    if getattr(tokenizer, "chat_template", None):
        marker = "\x00twinkle-answer\x00"
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": marker}], tokenize=False)
        except Exception:  # a template that refuses this conversation: EOS only
            text = ""
        if marker in text:
            after = tokenizer(text.split(marker, 1)[1], add_special_tokens=False)["input_ids"]
            special = set(getattr(tokenizer, "all_special_ids", [])) | set(
                getattr(tokenizer, "added_tokens_decoder", {}) or {})
            if after and after[0] in special:
                add(after[0])
    return ids


def pad_token_id(tokenizer: Any, stops: list[int]) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return stops[0] if stops else 0


def generation_kwargs(*, temperature: float, top_p: float, max_new_tokens: int, stops: list[int],
                      pad_id: int) -> dict[str, Any]:
    """``model.generate`` options: greedy when ``temperature`` is 0, always with the KV cache."""
    if temperature < 0:
        raise ConfigError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "use_cache": True, "pad_token_id": pad_id,
                              "eos_token_id": stops or None}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    return kwargs


def add_checkpoint_arguments(parser: Any, *, dtype_default: str = "auto") -> None:
    parser.add_argument("--base", metavar="DIR",
                        help="the base model of a PEFT adapter (default: base_model_name_or_path in "
                             "adapter_config.json)")
    parser.add_argument("--dtype", choices=DTYPES, default=dtype_default,
                        help=f"weights' dtype (default {dtype_default}: as saved)")
    parser.add_argument("--trust-remote-code", action="store_true", default=None,
                        help="run the checkpoint's own Python code (config.json auto_map); off unless this or "
                             "TWINKLE_TRUST_REMOTE_CODE=1 says so")
