"""``twinkle export CHECKPOINT --output DIR``: a plain Hugging Face directory from a checkpoint.

A full model is re-saved (safetensors, sharded by ``--max-shard-size``) with its tokenizer and without
Twinkle's bookkeeping files. A PEFT adapter is merged into its base with ``--merge-lora`` (a plain model
directory that ``AutoModelForCausalLM.from_pretrained`` loads without peft); without it the adapter is
written as a plain PEFT directory. ``--quantize 4bit|8bit`` writes the (merged) model quantised by bitsandbytes
(:mod:`twinkle_backend_hf.quantization`; gptq / awq are refused, naming their libraries). ``--push-to-hub REPO_ID`` uploads the result with ``huggingface_hub``;
it needs a token (``HF_TOKEN`` or the token ``hf auth login`` stored), checked before anything loads.

The checkpoint is verified against its Twinkle marker first (when it has one). The output is written into
``.DIR.incomplete`` and renamed into place with ``twinkle_export.json`` (every file's size and sha256) written
last, so an interrupted export leaves nothing that looks complete and a damaged one is detected when ``chat``,
``eval`` or ``export`` read it. ``--output`` is never the checkpoint, inside it or above it; an existing non-empty
directory is replaced only with ``--overwrite``, and only when it holds a model (a previous export).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from twinkle_backend_hf.commands.checkpoint_loading import add_checkpoint_arguments
from twinkle_backend_hf.quantization import EXPORT_METHODS
from twinkle_core.commands import Command
from twinkle_core.errors import ConfigError


class ExportCommand(Command):
    description = ("Write a checkpoint as a plain Hugging Face directory: the model (a LoRA "
                   "adapter merged into its base with --merge-lora) and its tokenizer.")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("checkpoint", help="checkpoint directory")
        parser.add_argument("--output", "-o", metavar="DIR", help="where to write (required unless --push-to-hub)")
        parser.add_argument("--merge-lora", action="store_true",
                            help="merge a PEFT (LoRA) adapter into its base and write the merged model")
        parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                            help="largest safetensors shard, e.g. 2GB or 500MB (default 5GB)")
        parser.add_argument("--overwrite", action="store_true",
                            help="replace an existing --output directory that holds a model (a previous export)")
        parser.add_argument("--push-to-hub", metavar="REPO_ID",
                            help="upload the exported directory to this Hugging Face Hub repository (needs HF_TOKEN)")
        parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
        parser.add_argument("--quantize", choices=EXPORT_METHODS,
                            help="write the model quantised: 4bit / 8bit with bitsandbytes (a LoRA adapter is merged "
                                 "first, with --merge-lora); gptq / awq need a CUDA GPU and their own libraries")
        add_checkpoint_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        return export_command(args)


def hub_token() -> str | None:
    """``HF_TOKEN``, else the token huggingface_hub stored (``hf auth login``); None without one."""
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if token:
        return token
    try:
        from huggingface_hub import get_token
    except ImportError:
        return None
    return get_token()


def _check_shard_size(value: str) -> None:
    import re

    if not re.fullmatch(r"\s*\d+(\.\d+)?\s*([KMGT]i?B|B)?\s*", str(value), flags=re.IGNORECASE):
        raise ConfigError(f"--max-shard-size {value!r}: write a size such as 2GB, 500MB or 1000000000")


def export(ckpt: Any, output: Path, *, merge_lora: bool, max_shard_size: str, dtype: str = "auto",
           quantize: str | None = None) -> Path:
    """Write ``ckpt`` to ``output`` (replacing it whole, atomically) with its ``twinkle_export.json`` marker."""
    from twinkle_backend_hf import compat
    from twinkle_backend_hf.commands.checkpoint_loading import (
        atomic_export_directory,
        load_model,
        load_tokenizer,
    )
    from twinkle_backend_hf.generation_config import write_end_of_turn_generation_config
    from twinkle_backend_hf.quantization import save_quantized

    tokenizer = load_tokenizer(ckpt)
    merge = merge_lora and ckpt.kind == "adapter"
    model = load_model(ckpt, dtype=dtype, device="cpu", merge=merge)
    size: Any = int(max_shard_size) if str(max_shard_size).strip().isdigit() else max_shard_size
    metadata = {"kind": "twinkle-export", "source": str(ckpt.path), "base": ckpt.base,
                "content": "adapter" if ckpt.kind == "adapter" and not merge else "model", "quantize": quantize}
    compat.unwrap_without_importing_deepspeed()  # save_pretrained would import DeepSpeed (4.5 s, a warning)
    with atomic_export_directory(output, metadata) as staging:
        if ckpt.kind == "full" or merge:
            model.config.use_cache = True  # training turns the KV cache off; the exported model generates with it
            if quantize:  # bitsandbytes 4bit / 8bit, checked by check_export before anything loaded
                save_quantized(model, str(staging), quantize, max_shard_size=size)
            else:
                model.save_pretrained(str(staging), max_shard_size=size, safe_serialization=True)
            write_end_of_turn_generation_config(staging, model, tokenizer)  # plain generate() stops at end of turn
        else:
            model.save_pretrained(str(staging), safe_serialization=True)  # a PEFT directory: adapter files only
        tokenizer.save_pretrained(str(staging))
    return output


MODEL_FILES = ("config.json", "adapter_config.json", "twinkle_export.json")


def checked_output(args: argparse.Namespace, ckpt: Any) -> Path:
    """The ``--output`` directory, checked before anything loads (see the module docstring for the rules)."""
    from twinkle_backend_hf.commands.checkpoint_loading import (
        check_parent_writable,
        input_directories,
        is_within,
    )

    output = Path(args.output).expanduser()
    resolved = output.resolve()
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output {args.output} is a file; export writes a directory: choose a new directory "
                          f"path")
    sources = input_directories(ckpt)
    named = Path(args.checkpoint).expanduser().resolve()
    for directory in sources + [named]:
        if is_within(directory, resolved):
            raise ConfigError(f"--output {args.output} is or contains the checkpoint {directory} that export reads; "
                              f"choose a directory outside it")
    for directory in sources:
        if is_within(resolved, directory):
            raise ConfigError(f"--output {args.output} lies inside the checkpoint {directory} that export reads; "
                              f"choose a directory outside it")
    if output.is_dir() and any(output.iterdir()):
        if not args.overwrite:
            raise ConfigError(f"--output {args.output} exists and is not empty; choose a new directory or add "
                              f"--overwrite")
        if not any((output / name).is_file() for name in MODEL_FILES):
            raise ConfigError(f"--output {args.output} holds files but no model (none of {', '.join(MODEL_FILES)}), "
                              f"so --overwrite would replace something that is not an export; choose a new "
                              f"directory")
    check_parent_writable(output)
    return output


def push(folder: Path, repo_id: str, token: str, *, private: bool = False) -> str:
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    url = api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                      commit_message="Upload model exported by twinkle")
    return str(getattr(url, "url", url) or f"https://huggingface.co/{repo_id}")


def export_command(args: argparse.Namespace) -> int:
    from twinkle_backend_hf.commands.checkpoint_loading import resolve_checkpoint, verify_checkpoint_files
    from twinkle_backend_hf.quantization import check_export

    if not args.output and not args.push_to_hub:
        raise ConfigError("twinkle export needs --output DIR (where to write the model) or --push-to-hub REPO_ID")
    _check_shard_size(args.max_shard_size)
    token = None
    if args.push_to_hub:
        token = hub_token()
        if not token:
            raise ConfigError("--push-to-hub needs a Hugging Face token: set HF_TOKEN (export HF_TOKEN=hf_...) or "
                              "log in once with 'hf auth login'")
    ckpt = resolve_checkpoint(args.checkpoint, args.base, trust_remote_code=args.trust_remote_code)
    check_export(args.quantize, full_model=ckpt.kind == "full" or args.merge_lora)
    if args.merge_lora and ckpt.kind == "full":
        print(f"twinkle: {ckpt.path} is a full model (no adapter): --merge-lora has nothing to merge", file=sys.stderr)
    if ckpt.kind == "adapter" and not args.merge_lora:
        print("twinkle: exporting the adapter as a PEFT directory; add --merge-lora for a standalone model",
              file=sys.stderr)
    tmp = None
    if args.output:
        output = checked_output(args, ckpt)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="twinkle-export-")
        output = Path(tmp.name) / "export"
    verify_checkpoint_files(ckpt)  # a damaged file is refused before any of them is loaded
    try:
        export(ckpt, output, merge_lora=args.merge_lora, max_shard_size=args.max_shard_size, dtype=args.dtype,
               quantize=args.quantize)
        if args.output:
            print(f"twinkle: exported {ckpt.path} to {output}")
        if args.push_to_hub:
            url = push(output, args.push_to_hub, token, private=args.private)
            print(f"twinkle: pushed to {url}")
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0
