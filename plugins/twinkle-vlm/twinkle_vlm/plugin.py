"""Registrations of the VLM plugin (entry point ``twinkle: vlm``)."""

from __future__ import annotations

from twinkle_core import hookimpl
from twinkle_core.records import TaskRecord

_PKG = "twinkle_vlm"


@hookimpl
def twinkle_register_tasks():
    yield TaskRecord("vlm", f"{_PKG}.task:VLMTask",
                     "vision-language SFT: images and chats through the model's processor, assistant-only labels, "
                     "per-part freezing / LoRA, padding-free packing with multimodal RoPE")
