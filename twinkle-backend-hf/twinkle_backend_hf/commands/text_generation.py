"""Token-by-token generation for ``twinkle serve-model``: text pieces as they are decoded, and why it finished.

A loop of its own over ``model(...)`` with the KV cache (rather than ``model.generate``) because a server needs
what ``generate`` hides: text as it grows (streaming) without a second thread, stop strings cut out of the text,
and the number of tokens generated. Greedy decoding matches ``model.generate(do_sample=False)``.

Text is handed out only once it can no longer change: a trailing incomplete UTF-8 character (decoded as U+FFFD)
and a tail that could still become a stop string are held back until the next token decides.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

#: decoding an incomplete UTF-8 sequence (a byte-level token) gives this character until the rest arrives
REPLACEMENT_CHARACTER = "\ufffd"


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Piece:
    """New text; the last piece of a generation has ``finish_reason`` ("stop" or "length") and the token count."""
    text: str
    finish_reason: str | None = None
    completion_tokens: int = 0


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the earliest stop string in ``text`` (looked for from ``start``) begins; None without one."""
    found = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
    return min(found) if found else None


def settled_length(text: str, stops: Sequence[str]) -> int:
    """How much of ``text`` the next tokens cannot change: not a trailing incomplete character, nor a tail that is
    the beginning of a stop string."""
    end = len(text.rstrip(REPLACEMENT_CHARACTER))
    for stop in stops:
        for k in range(min(len(stop) - 1, end), 0, -1):
            if text[:end].endswith(stop[:k]):
                end -= k
                break
    return end


def choose_token(logits: Any, options: SamplingOptions, generator: Any) -> int:
    """The next token: the most likely one at temperature 0, else sampled (nucleus ``top_p``) with ``generator``."""
    import torch

    if options.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float().cpu() / options.temperature, dim=-1)
    if options.top_p < 1:
        ordered, order = probs.sort(descending=True)
        # keep the most likely tokens whose mass before them is below top_p (at least the first one)
        ordered[(ordered.cumsum(0) - ordered) >= options.top_p] = 0
        return int(order[torch.multinomial(ordered, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))


class TextGenerator:
    """Generates from a loaded causal LM; ``stop_ids`` end an answer (EOS and the chat template's end of turn) and
    never appear in the text."""

    def __init__(self, model: Any, tokenizer: Any, stop_ids: Sequence[int]) -> None:
        self.model, self.tokenizer, self.stop_ids = model, tokenizer, frozenset(stop_ids)
        self.device = next(model.parameters()).device

    def _forward(self, input_ids: list[int], past: Any) -> tuple[Any, Any]:
        import torch

        # per call: grad mode is thread-local, and a server resumes a streaming generation on any thread
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([input_ids], device=self.device), past_key_values=past,
                             use_cache=True)
        return out.logits[0, -1], out.past_key_values

    def stream(self, prompt_ids: list[int], options: SamplingOptions, generator: Any = None) -> Iterator[Piece]:
        """Pieces of the answer to ``prompt_ids``; the last one says why it finished."""
        logits, past = self._forward(prompt_ids, None)
        tokens: list[int] = []
        emitted = 0
        longest_stop = max((len(s) for s in options.stop), default=0)
        while True:
            token = choose_token(logits, options, generator)
            if token in self.stop_ids:
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                yield Piece(text[emitted:], "stop", len(tokens) + 1)
                return
            tokens.append(token)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            cut = first_stop(text, options.stop, max(0, emitted - longest_stop))
            if cut is not None:
                yield Piece(text[emitted:cut], "stop", len(tokens))
                return
            if len(tokens) >= options.max_tokens:
                yield Piece(text[emitted:], "length", len(tokens))
                return
            settled = settled_length(text, options.stop)
            if settled > emitted:
                yield Piece(text[emitted:settled])
                emitted = settled
            logits, past = self._forward([token], past)

    def complete(self, prompt_ids: list[int], options: SamplingOptions, generator: Any = None) -> Piece:
        """The whole answer as one piece (its finish reason and token count)."""
        pieces = list(self.stream(prompt_ids, options, generator))
        return Piece("".join(p.text for p in pieces), pieces[-1].finish_reason, pieces[-1].completion_tokens)
