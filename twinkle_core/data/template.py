"""Turn rows into :class:`InputFeature` with the tokenizer's own chat template.

``mode="chat"`` (SFT): the conversation is rendered with ``tokenizer.apply_chat_template``; every
assistant turn is trained (its content and its end-of-turn token such as ``<|im_end|>``), every
other token has label -100. Assistant spans are found by rendering prefixes: for the assistant
message ``i``, ``render(messages[:i], add_generation_prompt=True)`` must be a prefix of
``render(messages[:i+1])``. When the whole rendering rewrites that turn (a template that drops the
reasoning of earlier assistant turns, such as Qwen3's), the turn as the whole rendering has it is
the longest end of ``render(messages[:i+1])``'s assistant part that the whole rendering continues
with (the rewritten text is what is trained). A template that rewrites the prompts of earlier turns
raises :class:`TemplateError`.

``chat_template``: a Jinja source used instead of the tokenizer's own (see
:mod:`twinkle_core.data.chat_templates` for the built-in names); it is set on the tokenizer, so a
saved tokenizer keeps it.

The text is tokenised segment by segment (prompt parts and assistant parts separately, without
the tokenizer's automatic special tokens), so label spans always fall on token boundaries, and a
prompt is tokenised exactly as it is at inference time. Tokens an assistant segment carries after
its last end-of-turn token (ChatML's trailing ``"\\n"``) are not trained.

``mode="pretrain"``: a row ``{"text": ...}`` is tokenised as-is (with the tokenizer's own BOS, if
it adds one), EOS is appended, and every token is trained.

In both modes ``labels`` are aligned with ``input_ids`` (the loss shifts them) and ``labels[0]`` is
-100, as nothing predicts the first token.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from twinkle_core.data.formats import IGNORE_INDEX, InputFeature, RowError, Trajectory, is_conversation_row
from twinkle_core.errors import ConfigError

#: what happens to a sample longer than ``max_length``: keep its start, keep its end, or refuse it
TRUNCATION_SIDES = ("right", "left", "error")

#: end-of-turn tokens of common chat templates, recognised when they are in the vocabulary
KNOWN_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eom_id|>")


logger = logging.getLogger(__name__)


class TemplateError(RowError):
    """The chat template cannot be used to locate assistant turns for this conversation."""


#: why data cannot be tokenised without a tokenizer, and where to pass one
NO_TOKENIZER = ("no tokenizer was given (tokenizer=None), so the data cannot be tokenised: pass tokenizer= (a "
                "transformers tokenizer, or build the model with TransformersModel(..., tokenizer=<directory or "
                "hf://org/name>) and pass tokenizer=model.tokenizer); in a recipe, set model.tokenizer")


def _no_chat_template(tokenizer: Any) -> str:
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    from twinkle_core.data.chat_templates import template_names

    return (f"the tokenizer {name!r} has no chat template, so it cannot render chat data (data.mode: chat, the "
            f"default); set the recipe key data.template to a chat template name ({', '.join(template_names())}) "
            "or a Jinja file, or set model.tokenizer to a tokenizer that has one (e.g. the model's instruct/chat "
            "version), or use pretrain-format data ({\"text\": ...} rows) with data.mode: pretrain")


class Template:
    def __init__(self, tokenizer: Any, max_length: int | None = None, mode: str = "chat",
                 truncation: str = "right", *, end_of_turn_tokens: Sequence[str] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, chat_template: str | None = None) -> None:
        if mode not in ("chat", "pretrain"):
            raise ConfigError(f"mode must be 'chat' or 'pretrain', got {mode!r}")
        if truncation not in TRUNCATION_SIDES:
            raise ConfigError(f"truncation must be one of {', '.join(map(repr, TRUNCATION_SIDES))}, got {truncation!r}")
        if max_length is not None and max_length < 2:
            raise ConfigError(f"max_length must be at least 2 to hold a prompt and an answer, got {max_length}")
        if tokenizer is None:
            raise ConfigError(NO_TOKENIZER)
        end_of_turn_tokens = list(end_of_turn_tokens or ())
        if chat_template is not None:
            from twinkle_core.data.chat_templates import resolve_chat_template

            source, marker, label = resolve_chat_template(chat_template)
            tokenizer.chat_template = source
            marker = marker or getattr(tokenizer, "eos_token", None)
            if marker and marker in tokenizer.get_vocab():
                end_of_turn_tokens.append(marker)
            elif marker and mode == "chat":
                logger.warning("chat template %r ends assistant turns with %r, which is not a single token of this "
                               "tokenizer: the model learns it as plain text (use the model family's tokenizer)",
                               label, marker)
        if mode == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(_no_chat_template(tokenizer))
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.mode = mode
        self.truncation = truncation
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.end_of_turn_ids = self._end_of_turn_ids(end_of_turn_tokens)

    # ------------------------------------------------------------------ helpers
    def _end_of_turn_ids(self, names: Sequence[str] | None) -> frozenset[int]:
        tok = self.tokenizer
        ids: set[int] = set()
        eos = getattr(tok, "eos_token_id", None)
        if eos is not None:
            ids.add(int(eos))
        vocab = tok.get_vocab()
        for name in (*KNOWN_END_OF_TURN_TOKENS, *(names or ())):
            if name in vocab:
                ids.add(int(vocab[name]))
            elif names and name in names:
                raise ValueError(f"end-of-turn token {name!r} is not in the tokenizer's vocabulary")
        return frozenset(ids)

    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        pad = getattr(tok, "pad_token_id", None)
        if pad is None:
            pad = getattr(tok, "eos_token_id", None)
        if pad is None:
            raise ValueError("the tokenizer has neither a pad_token nor an eos_token; set tokenizer.pad_token")
        return int(pad)

    def _tokenize(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _tokenize_all(self, texts: list[str]) -> list[list[int]]:
        """:meth:`_tokenize` of each text, in one batched call."""
        present = [t for t in texts if t]
        encoded = iter(self.tokenizer(present, add_special_tokens=False)["input_ids"] if present else [])
        return [list(next(encoded)) if t else [] for t in texts]

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False,
               tools: Any = None) -> str:
        """The chat template's text for ``messages``."""
        kwargs = dict(self.chat_template_kwargs)
        if tools is not None:
            kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as exc:  # jinja2 errors, raise_exception() in the template
            if isinstance(exc, RowError):
                raise
            raise TemplateError(f"the chat template cannot render this conversation: {type(exc).__name__}: "
                                f"{exc}") from None
        if not isinstance(text, str):  # pragma: no cover - defensive, depends on transformers
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
        return text

    def _finish(self, input_ids: list[int], labels: list[int], extra: dict[str, Any]) -> InputFeature:
        if self.max_length is not None and len(input_ids) > self.max_length:
            if self.truncation == "error":
                raise RowError(f"sample has {len(input_ids)} tokens, more than max_length={self.max_length} "
                               "(raise max_length or use truncation='right')")
            keep = slice(-self.max_length, None) if self.truncation == "left" else slice(self.max_length)
            input_ids, labels = input_ids[keep], labels[keep]
        if labels:
            labels[0] = IGNORE_INDEX
        return InputFeature(input_ids=input_ids, labels=labels, extra=extra)

    @staticmethod
    def _scalar_extra(extra: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in extra.items() if isinstance(v, (int, float, str, bool))}

    # ------------------------------------------------------------------ public API
    def encode(self, row: dict[str, Any] | Trajectory) -> InputFeature:
        """One row (``{"text"}`` in pretrain mode; ``{"messages"}`` / ``{"conversations"}`` /
        :class:`Trajectory` in chat mode) -> feature. Raises :class:`RowError` for a bad row."""
        if self.mode == "pretrain":
            if isinstance(row, Trajectory) or is_conversation_row(row):
                raise RowError("mode='pretrain' expects {'text': ...} rows; this row is a conversation "
                               "(use mode='chat')")
            if not isinstance(row, dict):
                raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
            if "text" not in row or row["text"] is None:
                raise RowError("row has no 'text' (mode='pretrain')")
            return self.encode_text(row["text"], extra=self._scalar_extra(
                {k: v for k, v in row.items() if k != "text"}))
        if isinstance(row, Trajectory):
            trajectory = row
        else:
            if isinstance(row, dict) and not is_conversation_row(row) and "text" in row:
                raise RowError("row has 'text' but no 'messages'/'conversations'; "
                               "for plain text use mode='pretrain'")
            trajectory = Trajectory.from_dict(row, require_assistant_last=True)
        return self.encode_chat(trajectory)

    def encode_text(self, text: Any, extra: dict[str, Any] | None = None) -> InputFeature:
        if not isinstance(text, str):
            raise RowError(f"'text' must be a string, got {type(text).__name__}")
        if not text:
            raise RowError("'text' is empty")
        ids = list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(int(eos))
        return self._finish(ids, list(ids), extra or {})

    def assistant_spans(self, trajectory: Trajectory) -> tuple[str, list[tuple[int, int]]]:
        """The full rendering and the character spans ``[start, end)`` of every assistant turn."""
        messages = trajectory.to_dicts()
        tools = trajectory.extra.get("tools")
        full = self.render(messages, tools=tools)
        spans: list[tuple[int, int]] = []
        previous_end = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            turn = full if i == len(messages) - 1 else self.render(messages[: i + 1], tools=tools)
            if not full.startswith(prompt):
                raise TemplateError(
                    f"the chat template is not prefix-stable: the prompt for assistant message {i} (the earlier "
                    "turns and the generation prompt) is not how the whole conversation begins (the template "
                    "rewrites past turns)")
            if not turn.startswith(prompt):
                raise TemplateError(
                    f"the chat template is not prefix-stable: rendering messages[:{i}] with "
                    f"add_generation_prompt=True is not a prefix of rendering messages[:{i + 1}]; "
                    "the assistant turn cannot be located (pass a prefix-stable chat template)")
            start = len(prompt)
            if start < previous_end:
                raise TemplateError(f"the chat template is not prefix-stable: assistant message {i} starts "
                                    "inside the previous assistant turn")
            if full.startswith(turn):
                end = len(turn)
            else:  # the whole rendering rewrites this turn (drops its reasoning): keep what it has
                kept = _overlap(turn[start:], full[start:])
                if kept == 0:
                    raise TemplateError(
                        f"the chat template is not prefix-stable: rendering messages[:{i + 1}] is not a prefix "
                        "of the whole conversation, and the whole conversation does not continue with the end of "
                        f"assistant message {i} (the template rewrites earlier turns)")
                end = start + kept
            spans.append((start, end))
            previous_end = end
        return full, spans

    def encode_chat(self, trajectory: Trajectory) -> InputFeature:
        full, spans = self.assistant_spans(trajectory)
        # every piece (context, answer, ..., tail) is tokenised on its own, all in one call to the tokenizer
        bounds = [0, *(edge for span in spans for edge in span), len(full)]
        pieces = iter(self._tokenize_all([full[a:b] for a, b in zip(bounds, bounds[1:])]))
        input_ids: list[int] = []
        labels: list[int] = []
        for _ in spans:
            context = next(pieces)
            input_ids += context
            labels += [IGNORE_INDEX] * len(context)
            answer = next(pieces)
            cut = len(answer)
            for j in range(len(answer) - 1, -1, -1):
                if answer[j] in self.end_of_turn_ids:
                    cut = j + 1
                    break
            input_ids += answer
            labels += answer[:cut] + [IGNORE_INDEX] * (len(answer) - cut)
        tail = next(pieces)
        input_ids += tail
        labels += [IGNORE_INDEX] * len(tail)
        return self._finish(input_ids, labels, self._scalar_extra(trajectory.extra))

    def encode_prompt(self, messages: list[dict[str, Any]] | Trajectory, tools: Any = None) -> list[int]:
        """Token ids of ``messages`` followed by the generation prompt (for inference)."""
        if isinstance(messages, Trajectory):
            tools = tools if tools is not None else messages.extra.get("tools")
            messages = messages.to_dicts()
        return self._tokenize(self.render(messages, add_generation_prompt=True, tools=tools))


def _overlap(a: str, b: str) -> int:
    """The length of the longest end of ``a`` that ``b`` begins with (KMP failure function, linear time)."""
    b = b[: len(a)]
    if not a or not b:
        return 0
    text = [*b, None, *a]  # None never equals a character
    fail = [0] * len(text)
    for j in range(1, len(text)):
        k = fail[j - 1]
        while k and text[j] != text[k]:
            k = fail[k - 1]
        if text[j] == text[k]:
            k += 1
        fail[j] = k
    return fail[-1]


__all__ = ["KNOWN_END_OF_TURN_TOKENS", "TRUNCATION_SIDES", "Template", "TemplateError"]
