"""``twinkle export CHECKPOINT --output DIR``: a plain Hugging Face directory from a checkpoint.

A full model is re-saved (safetensors, sharded by ``--max-shard-size``) with its tokenizer and without
Twinkle's bookkeeping files. A PEFT adapter is merged into its base with ``--merge-lora`` (a plain model
directory that ``AutoModelForCausalLM.from_pretrained`` loads without peft); without it the adapter is
written as a plain PEFT directory. ``--push-to-hub REPO_ID`` uploads the result with ``huggingface_hub``;
it needs a token (``HF_TOKEN`` or the token ``hf auth login`` stored), checked before anything loads.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from twinkle_backend_hf.commands.checkpoint_loading import add_checkpoint_arguments
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
        parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --output directory")
        parser.add_argument("--push-to-hub", metavar="REPO_ID",
                            help="upload the exported directory to this Hugging Face Hub repository (needs HF_TOKEN)")
        parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
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


def export(ckpt: Any, output: Path, *, merge_lora: bool, max_shard_size: str, dtype: str = "auto") -> Path:
    from twinkle_backend_hf.commands.checkpoint_loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(ckpt)
    merge = merge_lora and ckpt.kind == "adapter"
    model = load_model(ckpt, dtype=dtype, device="cpu", merge=merge)
    size: Any = int(max_shard_size) if str(max_shard_size).strip().isdigit() else max_shard_size
    output.mkdir(parents=True, exist_ok=True)
    if ckpt.kind == "full" or merge:
        model.config.use_cache = True  # training turns the KV cache off; the exported model generates with it
        model.save_pretrained(str(output), max_shard_size=size, safe_serialization=True)
    else:
        model.save_pretrained(str(output), safe_serialization=True)  # a PEFT directory: adapter files only
    tokenizer.save_pretrained(str(output))
    return output


def push(folder: Path, repo_id: str, token: str, *, private: bool = False) -> str:
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    url = api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                      commit_message="Upload model exported by twinkle")
    return str(getattr(url, "url", url) or f"https://huggingface.co/{repo_id}")


def export_command(args: argparse.Namespace) -> int:
    from twinkle_backend_hf.commands.checkpoint_loading import resolve_checkpoint

    if not args.output and not args.push_to_hub:
        raise ConfigError("twinkle export needs --output DIR (where to write the model) or --push-to-hub REPO_ID")
    _check_shard_size(args.max_shard_size)
    token = None
    if args.push_to_hub:
        token = hub_token()
        if not token:
            raise ConfigError("--push-to-hub needs a Hugging Face token: set HF_TOKEN (export HF_TOKEN=hf_...) or "
                              "log in once with 'hf auth login'")
    ckpt = resolve_checkpoint(args.checkpoint, args.base)
    if args.merge_lora and ckpt.kind == "full":
        print(f"twinkle: {ckpt.path} is a full model (no adapter): --merge-lora has nothing to merge", file=sys.stderr)
    if ckpt.kind == "adapter" and not args.merge_lora:
        print("twinkle: exporting the adapter as a PEFT directory; add --merge-lora for a standalone model",
              file=sys.stderr)
    tmp = None
    if args.output:
        output = Path(args.output).expanduser()
        if output.resolve() == ckpt.path.resolve():
            raise ConfigError(f"--output {args.output} is the checkpoint itself; choose another directory")
        if output.exists() and (not output.is_dir() or any(output.iterdir())) and not args.overwrite:
            raise ConfigError(f"--output {args.output} exists and is not empty; choose a new directory or add "
                              f"--overwrite")
    else:
        tmp = tempfile.TemporaryDirectory(prefix="twinkle-export-")
        output = Path(tmp.name)
    try:
        export(ckpt, output, merge_lora=args.merge_lora, max_shard_size=args.max_shard_size, dtype=args.dtype)
        if args.output:
            print(f"twinkle: exported {ckpt.path} to {output}")
        if args.push_to_hub:
            url = push(output, args.push_to_hub, token, private=args.private)
            print(f"twinkle: pushed to {url}")
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0
