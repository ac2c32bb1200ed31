"""``twinkle serve-model CHECKPOINT``: an OpenAI-compatible HTTP server over a checkpoint.

``GET /v1/models``, ``POST /v1/chat/completions`` (messages rendered with the tokenizer's chat template) and
``POST /v1/completions`` (a raw prompt), streamed or not, answered by :mod:`~twinkle_backend_hf.commands.openai_app`.
Answers end at the chat template's end-of-turn token (or EOS), which never appears in the text. One generation
runs at a time. Needs FastAPI and uvicorn: ``pip install 'twinkle-backend-hf[serve]'``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from twinkle_backend_hf.commands.checkpoint_loading import add_checkpoint_arguments
from twinkle_core.commands import Command
from twinkle_core.errors import ConfigError

SERVE_EXTRA = "pip install 'twinkle-backend-hf[serve]'"


class ServeModelCommand(Command):
    description = ("Serve a checkpoint (full model, PEFT adapter or Twinkle output directory) over an "
                   "OpenAI-compatible HTTP API: GET /v1/models, POST /v1/chat/completions and POST /v1/completions, "
                   "streamed or not. Answers stop at the chat template's end-of-turn token. Requests are served "
                   "one generation at a time (the others wait). Needs " + SERVE_EXTRA + ".")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("checkpoint", help="checkpoint directory")
        parser.add_argument("--host", default="127.0.0.1",
                            help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for all)")
        parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
        parser.add_argument("--model-name", metavar="NAME",
                            help="the model id clients send and /v1/models lists (default: the checkpoint "
                                 "directory's name)")
        parser.add_argument("--device", help="a torch device such as cpu, cuda:1 or npu:0 (default: the active "
                                             "accelerator's device, see twinkle plugins)")
        add_checkpoint_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        return serve_model(args)


def require_serve_dependencies() -> None:
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"twinkle serve-model needs {' and '.join(missing)}, which are not installed: "
                          f"{SERVE_EXTRA}")


def serve_model(args: argparse.Namespace) -> int:
    from twinkle_backend_hf.commands.checkpoint_loading import (
        checked_device,
        load_model,
        load_tokenizer,
        resolve_checkpoint,
        stop_token_ids,
        verify_checkpoint_files,
    )
    from twinkle_backend_hf.commands.openai_app import ServedModel, create_app
    from twinkle_backend_hf.commands.openai_protocol import now
    from twinkle_backend_hf.commands.text_generation import TextGenerator
    from twinkle_core.threads import configure_threads

    # what is missing or wrong fails before any weights load
    require_serve_dependencies()
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: use a port number between 0 and 65535")
    checked_device(args.device)
    ckpt = resolve_checkpoint(args.checkpoint, args.base, trust_remote_code=args.trust_remote_code)
    verify_checkpoint_files(ckpt)  # a damaged file is refused before any of them is loaded
    tokenizer = load_tokenizer(ckpt)
    name = args.model_name or Path(args.checkpoint).expanduser().resolve().name
    say = lambda line: print(f"twinkle: {line}", file=sys.stderr)  # noqa: E731
    if not getattr(tokenizer, "chat_template", None):
        say("the tokenizer has no chat template: /v1/chat/completions will refuse requests, /v1/completions works")
    configure_threads(say=say)
    model = load_model(ckpt, dtype=args.dtype, device=args.device)
    context = getattr(model.config, "max_position_embeddings", None)
    served = ServedModel(TextGenerator(model, tokenizer, stop_token_ids(tokenizer, model)), name,
                         context if isinstance(context, int) else None, now())

    import uvicorn

    say(f"serving {name!r} at http://{args.host}:{args.port}/v1 (one generation at a time; Ctrl+C stops)")
    uvicorn.run(create_app(served), host=args.host, port=args.port, log_level="info")
    return 0
