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

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError

WHAT_IS_A_CHECKPOINT = ("pass a directory written by 'twinkle train' (OUTPUT_DIR, OUTPUT_DIR/final or "
                        "OUTPUT_DIR/checkpoint-N), a Hugging Face model directory or a PEFT adapter directory")
DTYPES = ("auto", "float32", "bfloat16", "float16")


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


def _trust_remote_code() -> bool:
    from twinkle_core.envflags import env_flag

    return env_flag("TWINKLE_TRUST_REMOTE_CODE")


def load_tokenizer(ckpt: Checkpoint) -> Any:
    from transformers import AutoTokenizer

    source = ckpt.path
    if ckpt.kind == "adapter" and not any((ckpt.path / f).is_file()
                                          for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        source = ckpt.base  # an adapter saved without its tokenizer: the base's
    return AutoTokenizer.from_pretrained(str(source), trust_remote_code=_trust_remote_code())


def load_model(ckpt: Checkpoint, *, dtype: str | None = "auto", device: str | None = None,
               merge: bool = False) -> Any:
    """The model, in eval mode, on ``device``: a PEFT model for an adapter (merged when ``merge``)."""
    from transformers import AutoModelForCausalLM

    trust = _trust_remote_code()
    source = ckpt.base if ckpt.kind == "adapter" else str(ckpt.path)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype(dtype), trust_remote_code=trust)
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
