"""Plain data records: chat messages, trajectories (conversations) and tokenised features.

``from_dict`` constructors validate their input and raise :class:`RowError` (a ``ValueError``)
whose message is a short reason; the loaders wrap it in
:class:`twinkle_core.errors.DataFormatError` with the file name and line number.

Accepted conversation layouts (normalised by :func:`normalize_conversation`):

* OpenAI style: ``{"messages": [{"role": "user", "content": "..."}, ...]}``
* ShareGPT style: ``{"conversations": [{"from": "human", "value": "..."}, ...], "system": "..."}``
  (``human``/``user`` -> ``user``, ``gpt``/``assistant``/``model``/``chatgpt`` -> ``assistant``,
  ``system`` -> ``system``, ``tool``/``function``/``observation`` -> ``tool``)
* Alpaca style: ``{"instruction": "...", "input": "...", "output": "...", "system": "...",
  "history": [["user 1", "assistant 1"], ...]}`` (``input``, ``system`` and ``history`` optional):
  the history pairs become earlier user/assistant turns, then the user turn is ``instruction``
  followed by ``"\n"`` and ``input`` when ``input`` is non-empty, and the assistant turn is ``output``.

An optional top-level ``"system"`` string is prepended as a system message when the
conversation does not already start with one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from twinkle_core.constants import IGNORE_INDEX

ROLES = ("system", "user", "assistant", "tool")

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


class RowError(ValueError):
    """A single row is malformed; the message is the reason (no file or line yet)."""


@dataclass
class Message:
    role: str
    content: str
    #: other keys of the message (``name``, ``tool_call_id`` ...) handed to the chat template as-is
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any, index: int | None = None) -> Message:
        where = f"message {index}" if index is not None else "message"
        if not isinstance(data, dict):
            raise RowError(f"{where} must be an object with 'role' and 'content', got {type(data).__name__}")
        if "role" not in data or data["role"] is None:
            raise RowError(f"{where} has no 'role'")
        role = data["role"]
        if role not in ROLES:
            raise RowError(f"{where} has unknown role {role!r}; expected one of {', '.join(ROLES)}")
        if "content" not in data or data["content"] is None:
            raise RowError(f"{where} ({role}) has no 'content'")
        content = data["content"]
        if not isinstance(content, str):
            raise RowError(f"{where} ({role}) content must be a string, got {type(content).__name__}")
        extra = {k: v for k, v in data.items() if k not in ("role", "content") and v is not None}
        return cls(role=role, content=content, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "content": self.content, **self.extra}


@dataclass
class Trajectory:
    """One conversation plus any other fields of its row (kept in ``extra``)."""

    messages: list[Message]
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, row: Any, *, require_assistant_last: bool = True) -> Trajectory:
        """Validate and normalise a row (OpenAI or ShareGPT layout).

        ``require_assistant_last`` (SFT): the final message must come from the assistant.
        """
        messages, extra = normalize_conversation(row)
        parsed = [Message.from_dict(m, i) for i, m in enumerate(messages)]
        if require_assistant_last and parsed[-1].role != "assistant":
            raise RowError(f"the last message must be from the assistant for SFT, got {parsed[-1].role!r}")
        return cls(messages=parsed, extra=extra)

    def to_dicts(self) -> list[dict[str, Any]]:
        return [m.to_dict() for m in self.messages]


@dataclass
class InputFeature:
    """A tokenised sample. ``labels`` are aligned with ``input_ids`` (not shifted); -100 = no loss.

    ``position_ids`` is set for packed rows only (it restarts at 0 at every packed sequence).
    ``extra`` holds any other per-sample scalars.
    """

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.labels) != len(self.input_ids):
            raise RowError(f"labels has {len(self.labels)} entries but input_ids has {len(self.input_ids)}")
        if self.position_ids is not None and len(self.position_ids) != len(self.input_ids):
            raise RowError(
                f"position_ids has {len(self.position_ids)} entries but input_ids has {len(self.input_ids)}")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_trained_tokens(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE_INDEX)

    @classmethod
    def from_dict(cls, data: Any) -> InputFeature:
        if not isinstance(data, dict):
            raise RowError(f"a feature must be an object, got {type(data).__name__}")
        if "input_ids" not in data:
            raise RowError("feature has no 'input_ids'")
        input_ids = _int_list(data["input_ids"], "input_ids")
        labels = _int_list(data["labels"], "labels") if data.get("labels") is not None else list(input_ids)
        position_ids = (_int_list(data["position_ids"], "position_ids")
                        if data.get("position_ids") is not None else None)
        extra = {k: v for k, v in data.items() if k not in ("input_ids", "labels", "position_ids")}
        for key, value in extra.items():
            if not isinstance(value, (int, float, str, bool)) and value is not None:
                raise RowError(f"extra feature field {key!r} must be a scalar, got {type(value).__name__}")
        return cls(input_ids=input_ids, labels=labels, position_ids=position_ids, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"input_ids": list(self.input_ids), "labels": list(self.labels)}
        if self.position_ids is not None:
            out["position_ids"] = list(self.position_ids)
        out.update(self.extra)
        return out


def _int_list(value: Any, name: str) -> list[int]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise RowError(f"{name!r} must be a list of integers, got {type(value).__name__}")
    out = []
    for x in value:
        if isinstance(x, bool) or not isinstance(x, int):
            try:
                import numpy as np

                if isinstance(x, np.integer):
                    out.append(int(x))
                    continue
            except ImportError:  # pragma: no cover
                pass
            raise RowError(f"{name!r} must contain integers, got {type(x).__name__}")
        out.append(x)
    return out


def _maybe_json(value: Any) -> Any:
    """CSV cells hold conversations as JSON text; decode them."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(f"conversation column is a string that is not valid JSON ({exc.msg})") from None
    return value


def is_alpaca_row(row: Any) -> bool:
    return (isinstance(row, dict) and row.get("messages") is None and row.get("conversations") is None
            and row.get("instruction") is not None)


def is_conversation_row(row: Any) -> bool:
    return isinstance(row, dict) and (row.get("messages") is not None or row.get("conversations") is not None
                                      or is_alpaca_row(row))


ALPACA_KEYS = ("instruction", "input", "output", "history")


def _alpaca_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    def text(key: str, value: Any) -> str:
        if not isinstance(value, str):
            raise RowError(f"'{key}' must be a string, got {type(value).__name__}")
        return value

    instruction = text("instruction", row["instruction"])
    if row.get("output") is None:
        raise RowError("Alpaca row (it has 'instruction') has no 'output'")
    output = text("output", row["output"])
    query = instruction
    if row.get("input") is not None and text("input", row["input"]):
        query = f"{instruction}\n{row['input']}" if instruction else row["input"]
    messages: list[dict[str, Any]] = []
    history = _maybe_json(row["history"]) if row.get("history") is not None else []
    if not isinstance(history, list):
        raise RowError(f"'history' must be a list of [user, assistant] pairs, got {type(history).__name__}")
    for i, pair in enumerate(history):
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or not all(isinstance(x, str) for x in pair)):
            raise RowError(f"'history' item {i} must be a [user, assistant] pair of strings, got {pair!r}"[:200])
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    messages += [{"role": "user", "content": query}, {"role": "assistant", "content": output}]
    return messages


def _sharegpt_messages(raw: list[Any]) -> list[dict[str, Any]]:
    """A ShareGPT ``conversations`` list (``from`` / ``value`` turns, or role/content ones) as role/content dicts."""
    messages = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, dict):
            raise RowError(f"conversation turn {i} must be an object, got {type(turn).__name__}")
        if "from" in turn and turn["from"] is not None:
            who = turn["from"]
            if who not in _SHAREGPT_ROLES:
                raise RowError(f"conversation turn {i} has unknown 'from' {who!r}; expected one of "
                               f"{', '.join(sorted(_SHAREGPT_ROLES))}")
            msg = {"role": _SHAREGPT_ROLES[who], "content": turn.get("value")}
            msg.update({k: v for k, v in turn.items() if k not in ("from", "value")})
        else:  # already role/content inside a "conversations" column
            msg = dict(turn)
        messages.append(msg)
    return messages


def _listed(row: dict[str, Any], key: str) -> list[Any]:
    raw = _maybe_json(row[key])
    if not isinstance(raw, list):
        raise RowError(f"'{key}' must be a list, got {type(raw).__name__}")
    return raw


def _row_messages(row: dict[str, Any]) -> tuple[str, list[Any], tuple[str, ...]]:
    """``(the key the turns came from, the turns, the row's keys that are not extra fields)``."""
    skip: tuple[str, ...] = ("messages", "conversations", "system")
    if is_alpaca_row(row):
        return "instruction", _alpaca_messages(row), skip + ALPACA_KEYS
    if row.get("messages") is not None:
        return "messages", [dict(m) if isinstance(m, dict) else m for m in _listed(row, "messages")], skip
    if row.get("conversations") is not None:
        return "conversations", _sharegpt_messages(_listed(row, "conversations")), skip
    raise RowError("row has neither 'messages' nor 'conversations' (nor Alpaca 'instruction' / 'output')")


def normalize_conversation(row: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Return ``(messages as role/content dicts, other fields)`` for an OpenAI, ShareGPT or Alpaca row."""
    if not isinstance(row, dict):
        raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
    key, messages, skip = _row_messages(row)
    if not messages:
        raise RowError(f"'{key}' is empty")
    extra = {k: v for k, v in row.items() if k not in skip}
    system = row.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise RowError(f"'system' must be a string, got {type(system).__name__}")
        first = messages[0]
        if not (isinstance(first, dict) and first.get("role") == "system"):
            messages.insert(0, {"role": "system", "content": system})
    return messages, extra


__all__ = [
    "IGNORE_INDEX",
    "ROLES",
    "InputFeature",
    "Message",
    "RowError",
    "Trajectory",
    "is_alpaca_row",
    "is_conversation_row",
    "normalize_conversation",
]
