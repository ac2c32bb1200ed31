"""Finding and loading what ``twinkle train`` saved, with plain transformers / peft.

A checkpoint is one of:

- a full Hugging Face model directory (``config.json`` + weights), e.g. ``OUTPUT_DIR/final`` of a full
  fine-tune;
- a PEFT adapter directory (``adapter_config.json``) whose base model is recorded in the adapter config
  (``base_model_name_or_path``) or given with ``--base``;
- a Twinkle output directory (``train.output_dir``): its ``final`` checkpoint, else its newest ``checkpoint-N``.

Only this module's functions import torch / transformers / peft, and only when called.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
DAMAGED_FIX = ("the checkpoint is damaged (a disk or copy error, or an edit): use another copy or an earlier "
               "OUTPUT_DIR/checkpoint-N, or save it again")


class CheckpointDamagedError(TwinkleError, RuntimeError):
    """A checkpoint whose files do not match the sizes and hashes its marker recorded."""


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


def _looks_like_hub_id(value: str) -> bool:
    return not value.startswith((".", "/", "~")) and value.count("/") == 1 and not os.path.isabs(value)


def resolve_checkpoint(path: str | os.PathLike[str], base: str | None = None) -> Checkpoint:
    """What ``path`` is; a :class:`ConfigError` naming the fix when it is not a usable checkpoint."""
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
        try:
            recorded = json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{p / 'adapter_config.json'} is not readable JSON ({exc})") from None
        chosen_base = base or recorded
        if not chosen_base:
            raise ConfigError(f"{p} is a PEFT adapter whose adapter_config.json records no base model "
                              f"(base_model_name_or_path); pass the base model directory with --base DIR")
        if not Path(chosen_base).expanduser().is_dir() and not _looks_like_hub_id(chosen_base):
            where = "--base" if base else "adapter_config.json (base_model_name_or_path)"
            raise ConfigError(f"the base model {chosen_base!r} of adapter {p} (from {where}) does not exist; "
                              f"pass the base model directory with --base DIR")
        return Checkpoint(p, "adapter", str(Path(chosen_base).expanduser()) if Path(chosen_base).expanduser().is_dir()
                          else chosen_base)
    if base:
        print(f"twinkle: {p} is a full model; --base is ignored", file=sys.stderr)
    return Checkpoint(p, "full")


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
    print(f"twinkle: {directory}: no Twinkle marker: not verified", file=sys.stderr)


def verify_checkpoint_files(ckpt: Checkpoint) -> None:
    """Verify the checkpoint (and an adapter's local base model) before any of its files is loaded."""
    verify_directory(ckpt.path)
    if ckpt.kind == "adapter" and ckpt.base and Path(ckpt.base).is_dir():
        verify_directory(Path(ckpt.base))


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


def load_tokenizer(ckpt: Checkpoint) -> Any:
    from transformers import AutoTokenizer

    source = ckpt.path
    if ckpt.kind == "adapter" and not any((ckpt.path / f).is_file()
                                          for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        source = ckpt.base  # an adapter saved without its tokenizer: the base's
    with resolve.explain_remote_code_refusal(f"the tokenizer at {source}"):
        return AutoTokenizer.from_pretrained(str(source), trust_remote_code=resolve.trust_remote_code())


def load_model(ckpt: Checkpoint, *, dtype: str | None = "auto", device: str | None = None,
               merge: bool = False) -> Any:
    """The model, in eval mode, on ``device``: a PEFT model for an adapter (merged when ``merge``)."""
    from transformers import AutoModelForCausalLM

    source = ckpt.base if ckpt.kind == "adapter" else str(ckpt.path)
    with resolve.explain_remote_code_refusal(f"the model at {source}"):
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype(dtype),
                                                     trust_remote_code=resolve.trust_remote_code())
    if ckpt.kind == "adapter":
        try:
            from peft import PeftModel
        except ImportError:
            raise ConfigError(f"{ckpt.path} is a PEFT adapter and peft is not installed: pip install peft") from None
        model = PeftModel.from_pretrained(model, str(ckpt.path))
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
