"""The tokens an environment adds to a conversation: a ``tool`` message after a model turn, as the chat template
renders it, followed by the generation prompt of the model's next turn.

The tokens of a conversation so far are kept as they were sampled (re-rendering the whole conversation could
tokenise the model's text differently from how it was drawn, and the log-probs would no longer match). What an
observation appends is the template's text for one more message, found by rendering a stand-in conversation with
and without it: the chat templates render a conversation as the concatenation of its messages, so the difference
is the new message's text. After a model turn, what the template writes between the model's end-of-turn token and
the next message (Qwen's ``"\\n"``) belongs to the environment's tokens too.
"""

from __future__ import annotations

from typing import Any

from twinkle_core.data.template import Template
from twinkle_core.errors import ConfigError

_USER = {"role": "user", "content": "Q"}
_ASSISTANT = {"role": "assistant", "content": "A"}


class ChatTurns:
    """Token ids of environment messages for ``tokenizer``'s chat template."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("task_options.environment needs a tokenizer with a chat template (the environment's "
                              "answers are rendered as tool messages); set model.tokenizer to one that has one")
        self.template = Template(tokenizer, mode="chat")
        self.tokenizer = tokenizer
        self.end_of_turn_ids = self.template.end_of_turn_ids
        head = self._render([_USER, _ASSISTANT])
        with_tool = self._render([_USER, _ASSISTANT, {"role": "tool", "content": "\x00"}], True)
        self._after_turn = self._suffix(head, with_tool, "a tool message")
        prompt = self._render([_USER])
        self.generation_prompt = self._suffix(prompt, self._render([_USER], True), "the generation prompt")
        with_user = self._render([_USER, {"role": "user", "content": "\x00"}], True)
        self._after_prompt = self._suffix(prompt, with_user, "a user message")
        # what the template writes after an assistant message's end-of-turn token (Qwen: a newline)
        self._closing = {eot: head[head.rfind(text) + len(text):] if text and text in head else ""
                         for eot in self.end_of_turn_ids for text in [tokenizer.decode([eot])]}

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        return self.template.render(messages, add_generation_prompt=generation_prompt)

    @staticmethod
    def _suffix(shorter: str, longer: str, what: str) -> str:
        if not longer.startswith(shorter):
            raise ConfigError(f"the chat template does not render {what} by appending to the conversation, so an "
                              f"environment's turns cannot be added to sampled tokens; use a template that does "
                              f"(Qwen2/ChatML, Llama 3 ...)")
        return longer[len(shorter):]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def observation_ids(self, observation: str, last_token: int | None) -> list[int]:
        """The ``tool`` message ``observation`` plus the next generation prompt, after a model turn that ended
        with ``last_token``."""
        closing = self._closing.get(last_token, "") if last_token is not None else ""
        return self._encode(closing + self._after_turn.replace("\x00", observation))

    def without_generation_prompt(self, prompt_ids: list[int]) -> list[int]:
        """``prompt_ids`` without the generation prompt they end with (unchanged if they do not)."""
        prompt_end = self._encode(self.generation_prompt)
        if prompt_end and list(prompt_ids[-len(prompt_end):]) == prompt_end:
            return list(prompt_ids[:-len(prompt_end)])
        return list(prompt_ids)

    def opening_ids(self, observation: str) -> list[int]:
        """A user message ``observation`` and the generation prompt, after a prompt without its generation
        prompt (:meth:`without_generation_prompt`): an environment's opening words before the model's first turn."""
        return self._encode(self._after_prompt.replace("\x00", observation))


__all__ = ["ChatTurns"]
