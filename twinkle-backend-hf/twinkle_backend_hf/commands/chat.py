"""``twinkle chat CHECKPOINT``: talk to a saved checkpoint in the terminal.

Multi-turn, through the tokenizer's chat template and ``model.generate`` (KV cache); greedy unless
``--temperature`` > 0. ``--prompt TEXT`` answers once and exits. In the interactive mode ``/reset``
forgets the conversation (keeping ``--system``) and ``/exit`` (or Ctrl+D) quits.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from twinkle_backend_hf.commands.checkpoint_loading import add_checkpoint_arguments
from twinkle_core.commands import Command
from twinkle_core.errors import ConfigError


class ChatCommand(Command):
    description = ("Chat with a checkpoint (full model, PEFT adapter or Twinkle output directory) "
                   "using its tokenizer's chat template. Interactive: /reset starts over, /exit "
                   "quits. --prompt answers once and exits.")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("checkpoint", help="checkpoint directory")
        parser.add_argument("--prompt", metavar="TEXT", help="answer this one message, print the answer and exit")
        parser.add_argument("--system", metavar="TEXT", help="system prompt")
        parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
        parser.add_argument("--top-p", type=float, default=1.0,
                            help="nucleus sampling (with --temperature > 0; default 1)")
        parser.add_argument("--max-new-tokens", type=int, default=256, help="answer length limit (default 256)")
        parser.add_argument("--device", help="a torch device such as cpu, cuda:1 or npu:0 (default: the active "
                                             "accelerator's device, see twinkle plugins)")
        add_checkpoint_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        return chat(args)


class ChatSession:
    """A conversation with a loaded model: :meth:`ask` appends the user's turn and the model's answer."""

    def __init__(self, model: Any, tokenizer: Any, *, system: str | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, max_new_tokens: int = 256) -> None:
        from twinkle_backend_hf.commands.checkpoint_loading import (
            generation_kwargs,
            pad_token_id,
            stop_token_ids,
        )

        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the checkpoint's tokenizer has no chat template (tokenizer_config.json "
                              "'chat_template' or chat_template.jinja); save one with the tokenizer to chat")
        self.model, self.tokenizer, self.system = model, tokenizer, system
        stops = stop_token_ids(tokenizer, model)
        self.generate_kwargs = generation_kwargs(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                                 stops=stops, pad_id=pad_token_id(tokenizer, stops))
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, text: str, streamer: Any = None) -> str:
        import torch

        self.messages.append({"role": "user", "content": text})
        inputs = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)
        device = next(self.model.parameters()).device
        inputs = {k: v.to(device) for k, v in inputs.items()}
        with torch.no_grad():
            out = self.model.generate(**inputs, **self.generate_kwargs, streamer=streamer)
        answer = self.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        self.messages.append({"role": "assistant", "content": answer})
        return answer


def interact(session: ChatSession, read: Callable[[str], str] = input, write: Callable[[str], None] = print,
             stream: bool = False) -> None:
    """The interactive loop: one line per user turn; ``/reset``, ``/exit`` (or end of input)."""
    streamer = None
    if stream:
        from transformers import TextStreamer

        streamer = TextStreamer(session.tokenizer, skip_prompt=True, skip_special_tokens=True)
    write("twinkle chat: /reset starts a new conversation, /exit quits")
    while True:
        try:
            line = read(">>> ")
        except EOFError:
            write("")
            return
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            session.reset()
            write("(conversation reset)")
            continue
        answer = session.ask(text, streamer=streamer)
        if streamer is None:
            write(answer)


def chat(args: argparse.Namespace) -> int:
    from twinkle_backend_hf.commands.checkpoint_loading import (
        checked_device,
        generation_kwargs,
        load_model,
        load_tokenizer,
        resolve_checkpoint,
        tokenizer_source,
        verify_checkpoint_files,
    )
    from twinkle_core.threads import configure_threads

    # wrong options and a wrong path fail before any weights load
    generation_kwargs(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                      stops=[], pad_id=0)
    checked_device(args.device)
    ckpt = resolve_checkpoint(args.checkpoint, args.base, trust_remote_code=args.trust_remote_code)
    verify_checkpoint_files(ckpt)  # a damaged file is refused before any of them is loaded
    tokenizer = load_tokenizer(ckpt)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"the tokenizer in {tokenizer_source(ckpt)} has no chat template: save one with it "
                          f"('chat_template' in tokenizer_config.json, or chat_template.jinja) to chat")
    # this process's share of the free cores, unless OMP_NUM_THREADS says otherwise
    configure_threads(say=lambda line: print(f"twinkle: {line}", file=sys.stderr))
    session = ChatSession(load_model(ckpt, dtype=args.dtype, device=args.device), tokenizer, system=args.system,
                          temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
    if args.prompt is not None:
        print(session.ask(args.prompt))
        return 0
    try:
        interact(session, stream=sys.stdout.isatty())
    except KeyboardInterrupt:
        print()
    return 0
