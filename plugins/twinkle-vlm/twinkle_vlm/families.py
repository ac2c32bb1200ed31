"""The supported vision-language families: where each part of the network lives.

Module paths are those of transformers 5.24's ``AutoModelForImageTextToText`` classes, relative to the
model (``model.named_modules()``); PEFT's wrapper prefix (``base_model.model.``) is stripped before
matching. A VLM has three parts that a recipe trains separately (:mod:`twinkle_vlm.parts`):

* ``vision``    -- the vision encoder (patch embedding, blocks);
* ``projector`` -- what maps vision features into the language model's embedding space (Qwen's
  ``merger`` -- nested inside the vision module --, InternVL / Gemma 3's ``multi_modal_projector``);
* ``language``  -- the decoder (embeddings, layers, norm) and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twinkle_core.errors import ConfigError

PARTS = ("vision", "projector", "language")
#: prefixes PEFT adds in front of the transformers model's own parameter names
_WRAPPER_PREFIXES = ("base_model.model.",)
#: what PEFT inserts inside a ``modules_to_save`` module's path
_MODULES_TO_SAVE_MARKERS = (".modules_to_save.", ".original_module.")


@dataclass(frozen=True)
class VLMFamily:
    model_type: str
    #: module paths of the vision encoder root (the projector may be nested inside it)
    vision: tuple[str, ...]
    projector: tuple[str, ...]
    language: tuple[str, ...]
    #: the token each image expands into in the text (its placeholder run)
    image_token: str
    #: the transformers processor class (``AutoProcessor`` picks it from the model directory)
    processor_class: str

    def prefixes(self, part: str) -> tuple[str, ...]:
        return {"vision": self.vision, "projector": self.projector, "language": self.language}[part]


_QWEN_LANGUAGE = ("model.language_model", "lm_head")
_SIDE_TOWER = dict(vision=("model.vision_tower",), projector=("model.multi_modal_projector",),
                   language=("model.language_model", "lm_head"))

FAMILIES: dict[str, VLMFamily] = {f.model_type: f for f in (
    VLMFamily("qwen2_vl", ("model.visual",), ("model.visual.merger",), _QWEN_LANGUAGE,
              "<|image_pad|>", "Qwen2VLProcessor"),
    VLMFamily("qwen2_5_vl", ("model.visual",), ("model.visual.merger",), _QWEN_LANGUAGE,
              "<|image_pad|>", "Qwen2_5_VLProcessor"),
    # Qwen3-VL's deepstack mergers project intermediate vision features into early text layers
    VLMFamily("qwen3_vl", ("model.visual",), ("model.visual.merger", "model.visual.deepstack_merger_list"),
              _QWEN_LANGUAGE, "<|image_pad|>", "Qwen3VLProcessor"),
    VLMFamily("qwen3_vl_moe", ("model.visual",), ("model.visual.merger", "model.visual.deepstack_merger_list"),
              _QWEN_LANGUAGE, "<|image_pad|>", "Qwen3VLProcessor"),
    # Qwen3.5: Qwen3-VL's vision side (without deepstack) on a hybrid linear / full attention decoder
    VLMFamily("qwen3_5", ("model.visual",), ("model.visual.merger",), _QWEN_LANGUAGE, "<|image_pad|>",
              "Qwen3VLProcessor"),
    VLMFamily("internvl", **_SIDE_TOWER, image_token="<IMG_CONTEXT>", processor_class="InternVLProcessor"),
    VLMFamily("gemma3", **_SIDE_TOWER, image_token="<image_soft_token>", processor_class="Gemma3Processor"),
)}


def family_for(model_or_config: Any) -> VLMFamily:
    """The family of a transformers model or config (by ``model_type``); a clear error for others."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise ConfigError(f"the vlm task does not know the model type {model_type!r}; supported: "
                          f"{', '.join(FAMILIES)}")
    return family


def strip_wrappers(name: str) -> str:
    """A parameter / module name as the bare transformers model names it (no PEFT prefixes or
    ``modules_to_save`` copies)."""
    for prefix in _WRAPPER_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
    for marker in _MODULES_TO_SAVE_MARKERS:
        head, sep, tail = name.partition(marker)
        if sep:  # ``x.modules_to_save.<adapter>.rest`` -> ``x.rest``
            name = head + "." + tail.split(".", 1)[1] if marker == ".modules_to_save." else head + "." + tail
    return name


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def part_of(name: str, family: VLMFamily) -> str | None:
    """Which part a parameter or module belongs to (``None``: none, e.g. a parameter-free root)."""
    name = strip_wrappers(name)
    # the projector first: Qwen's merger sits inside the vision module
    for part in ("projector", "vision", "language"):
        if any(_under(name, p) for p in family.prefixes(part)):
            return part
    return None


__all__ = ["FAMILIES", "PARTS", "VLMFamily", "family_for", "part_of", "strip_wrappers"]
