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
    # needs twinkle-rl (pip install twinkle-vlm[rl]); its module imports twinkle_rl only when the task is built
    yield TaskRecord("vlm_preference", f"{_PKG}.preference:VLMPreferenceTask",
                     "vision-language preference training (DPO family) on image chats: the preference task's pairs, "
                     "references and losses with the vlm task's processor, per-part freezing / LoRA and mRoPE")
    yield TaskRecord("vlm_grpo", f"{_PKG}.online:VLMOnlineRLTask",
                     "vision-language online RL (GRPO family) on prompts that show pictures: the grpo task's sampler, "
                     "rewards and losses with the vlm task's processor, per-part freezing / LoRA and mRoPE positions "
                     "kept from sampling to training")
