"""Per-family recipes for the tiny test VLMs of :mod:`twinkle_vlm.testing`.

Each :class:`TinyFamily` says which vision special tokens the tokenizer needs, how the real chat
template renders an image part, which PIL image processor to build (with small resolution limits so
an image becomes a handful of vision tokens) and the tiny config (text hidden 64, 2 layers; vision
hidden 32, 1-2 layers). Sizes follow each architecture's constraints (noted where they bind).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Text tower shared by all families: hidden 64, 2 layers, 4 heads of 16 (2 kv heads).
_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)
#: Qwen's multimodal RoPE splits head_dim / 2 = 8 rotary frequencies into (temporal, height, width).
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}


def _qwen_template(vision_start: str, image: str, vision_end: str) -> str:
    """ChatML with image parts rendered ``<|vision_start|><|image_pad|><|vision_end|>`` and video parts
    ``<|vision_start|><|video_pad|><|vision_end|>`` in place, as Qwen2-VL / Qwen2.5-VL / Qwen3-VL do (without
    their default system prompt)."""
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for content in message['content'] %}"
        "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
        f"{vision_start}{image}{vision_end}"
        "{% elif content['type'] == 'video' or 'video' in content %}"
        f"{vision_start}<|video_pad|>{vision_end}"
        "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


@dataclass(frozen=True)
class TinyFamily:
    special_tokens: tuple[str, ...]
    chat_template: str
    image_processor: Callable[..., Any]     # (min_pixels=, max_pixels=) -> image processor
    processor_class: Callable[[], type]     # lazy: transformers import only when used
    config: Callable[[Any], Any]            # tokenizer -> model config
    processor_kwargs: dict[str, Any] = field(default_factory=dict)
    tokenizer_attributes: dict[str, str] = field(default_factory=dict)


def _ids(tokenizer: Any, *tokens: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


def _text(tokenizer: Any, **extra: Any) -> dict[str, Any]:
    return {**_TEXT, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None, **extra}


# --------------------------------------------------------------------------- Qwen2-VL / Qwen2.5-VL / Qwen3-VL

_QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _qwen_image_processor(patch_size: int) -> Callable[..., Any]:
    def build(min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        factor = patch_size * 2     # one merged vision token covers a (2 patch x 2 patch) square
        return Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=2,
                                        min_pixels=min_pixels or factor * factor,
                                        max_pixels=max_pixels or 4 * factor * factor)
    return build


def _qwen_token_ids(tokenizer: Any) -> dict[str, int]:
    start, end, image, video = _ids(tokenizer, *_QWEN_TOKENS)
    return dict(image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)


def _qwen2_vl_config(tokenizer: Any) -> Any:
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(text_config=_text(tokenizer, rope_parameters=dict(_MROPE)),
                         vision_config=dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2),
                         tie_word_embeddings=False, **_qwen_token_ids(tokenizer))


def _qwen2_5_vl_config(tokenizer: Any) -> Any:
    from transformers import Qwen2_5_VLConfig

    # block 0 uses windowed attention, block 1 full attention: both code paths run
    return Qwen2_5_VLConfig(text_config=_text(tokenizer, rope_parameters=dict(_MROPE)),
                            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                               out_hidden_size=64, fullatt_block_indexes=[1], window_size=56),
                            tie_word_embeddings=False, **_qwen_token_ids(tokenizer))


def _qwen3_vl_config(tokenizer: Any) -> Any:
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(text_config=_text(tokenizer, head_dim=16,
                                           rope_parameters={**_MROPE, "mrope_interleaved": True}),
                         vision_config=_qwen3_vision(), tie_word_embeddings=False, **_qwen_token_ids(tokenizer))


def _qwen3_vl_moe_config(tokenizer: Any) -> Any:
    from transformers import Qwen3VLMoeConfig

    text = _text(tokenizer, head_dim=16, rope_parameters={**_MROPE, "mrope_interleaved": True},
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    return Qwen3VLMoeConfig(text_config=text, vision_config=_qwen3_vision(), tie_word_embeddings=False,
                            **_qwen_token_ids(tokenizer))


def _qwen3_5_config(tokenizer: Any) -> Any:
    from transformers import Qwen3_5Config

    # one Gated-DeltaNet (linear attention) layer and one full-attention layer
    text = _text(tokenizer, head_dim=16, rope_parameters={**_MROPE, "mrope_interleaved": True,
                                                           "partial_rotary_factor": 1.0},
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 layer_types=["linear_attention", "full_attention"])
    vision = {k: v for k, v in _qwen3_vision().items() if k != "deepstack_visual_indexes"}
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False,
                         **_qwen_token_ids(tokenizer))


def _qwen3_vision() -> dict[str, Any]:
    # deepstack: features of vision block 0 are added into the first text layer
    return dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                num_position_embeddings=16, deepstack_visual_indexes=[0])


def _processor_class(name: str) -> Callable[[], type]:
    def load() -> type:
        import transformers

        return getattr(transformers, name)
    return load


# --------------------------------------------------------------------------- InternVL (transformers-native format)

_INTERNVL_NAMED = {"start_image_token": "<img>", "end_image_token": "</img>",
                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
#: 32 px image, 8 px patches: 4 x 4 patches, pixel-shuffled by 0.5 to 2 x 2 = 4 tokens per image.
_INTERNVL_IMAGE, _INTERNVL_PATCH, _INTERNVL_TOKENS = 32, 8, 4
#: InternVL's template writes ``<IMG_CONTEXT>`` per image part; the processor expands it to
#: ``<img><IMG_CONTEXT>*N</img>``.
_INTERNVL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _internvl_image_processor(min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    # fixed-size tiles: InternVL has no pixel range, the tile size is its resolution knob
    return GotOcr2ImageProcessorPil(size={"height": _INTERNVL_IMAGE, "width": _INTERNVL_IMAGE},
                                    crop_to_patches=False, max_patches=1)


def _internvl_config(tokenizer: Any) -> Any:
    from transformers import InternVLConfig

    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  image_size=[_INTERNVL_IMAGE] * 2, patch_size=[_INTERNVL_PATCH] * 2)
    return InternVLConfig(text_config={**_text(tokenizer), "model_type": "qwen2"}, vision_config=vision,
                          image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"),
                          image_seq_length=_INTERNVL_TOKENS, tie_word_embeddings=False)


# --------------------------------------------------------------------------- Gemma 3

_GEMMA3_NAMED = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
#: SigLIP on 32 px images with 8 px patches (4 x 4), average-pooled to 2 x 2 = 4 tokens per image.
_GEMMA3_IMAGE, _GEMMA3_PATCH, _GEMMA3_TOKENS = 32, 8, 4
#: Gemma's turn format (role ``model`` for the assistant); an image part is ``<start_of_image>``,
#: which the processor expands to the full image sequence.
_GEMMA3_TEMPLATE = (
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<start_of_image>"
    "{% elif content['type'] == 'text' %}{{ content['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _gemma3_image_processor(min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": _GEMMA3_IMAGE, "width": _GEMMA3_IMAGE})


def _gemma3_config(tokenizer: Any) -> Any:
    from transformers import Gemma3Config

    text = _text(tokenizer, head_dim=16, query_pre_attn_scalar=16, sliding_window=64,
                 layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=_GEMMA3_IMAGE, patch_size=_GEMMA3_PATCH, vision_use_head=False)
    boi, eoi, image = _ids(tokenizer, *_GEMMA3_NAMED.values())
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=_GEMMA3_TOKENS,
                        boi_token_index=boi, eoi_token_index=eoi, image_token_index=image,
                        tie_word_embeddings=False)


_QWEN_TEMPLATE = _qwen_template("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")

TINY_FAMILIES: dict[str, TinyFamily] = {
    "qwen2_vl": TinyFamily(_QWEN_TOKENS, _QWEN_TEMPLATE, _qwen_image_processor(14),
                           _processor_class("Qwen2VLProcessor"), _qwen2_vl_config),
    "qwen2_5_vl": TinyFamily(_QWEN_TOKENS, _QWEN_TEMPLATE, _qwen_image_processor(14),
                             _processor_class("Qwen2_5_VLProcessor"), _qwen2_5_vl_config),
    "qwen3_vl": TinyFamily(_QWEN_TOKENS, _QWEN_TEMPLATE, _qwen_image_processor(16),
                           _processor_class("Qwen3VLProcessor"), _qwen3_vl_config),
    "qwen3_vl_moe": TinyFamily(_QWEN_TOKENS, _QWEN_TEMPLATE, _qwen_image_processor(16),
                               _processor_class("Qwen3VLProcessor"), _qwen3_vl_moe_config),
    "qwen3_5": TinyFamily(_QWEN_TOKENS, _QWEN_TEMPLATE, _qwen_image_processor(16),
                          _processor_class("Qwen3VLProcessor"), _qwen3_5_config),
    "internvl": TinyFamily(tuple(_INTERNVL_NAMED.values()), _INTERNVL_TEMPLATE, _internvl_image_processor,
                           _processor_class("InternVLProcessor"), _internvl_config,
                           processor_kwargs={"image_seq_length": _INTERNVL_TOKENS},
                           tokenizer_attributes=_INTERNVL_NAMED),
    "gemma3": TinyFamily((*_GEMMA3_NAMED.values(), "<start_of_turn>", "<end_of_turn>"), _GEMMA3_TEMPLATE,
                         _gemma3_image_processor, _processor_class("Gemma3Processor"), _gemma3_config,
                         processor_kwargs={"image_seq_length": _GEMMA3_TOKENS},
                         tokenizer_attributes=_GEMMA3_NAMED),
}
