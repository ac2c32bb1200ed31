"""Regenerate the VLM quickstart's bundled processor (deterministic; its output, ``processor/``, is committed).

The processor is the text quickstart's character-level tokenizer (``examples/quickstart/tokenizer``) extended
with Qwen2.5-VL's vision special tokens, a chat template that renders typed content parts the way
Qwen2.5-VL's does, and a config for transformers' PIL Qwen2-VL image processor that resizes every picture
to exactly 56 x 56 pixels: 4 x 4 patches of 14 pixels, merged 2 x 2 into 4 image tokens. Small pictures
keep a training step cheap on a CPU; the shapes in them are still easy to tell apart at that size.

    python examples/vlm/make_processor.py
"""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT_TOKENIZER = os.path.join(HERE, "..", "quickstart", "tokenizer")
OUT = os.path.join(HERE, "processor")

#: Qwen2.5-VL's vision tokens, appended after the text tokenizer's 262 ids (so their ids are 262..265;
#: recipe.yaml's ``image_token_id`` / ``video_token_id`` / ``vision_*_token_id`` name them)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_SIDE = 56  # pixels; a multiple of patch_size * merge_size = 28
# Qwen2.5-VL's template without the default system prompt (it would cost ~30 character tokens a sample).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' or 'video' in part %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    # CLIP's statistics, as in Qwen2.5-VL's own preprocessor_config.json
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": IMAGE_SIDE * IMAGE_SIDE, "longest_edge": IMAGE_SIDE * IMAGE_SIDE},
}


def build_processor(out_dir: str = OUT) -> str:
    """Write tokenizer, chat template, ``preprocessor_config.json`` and ``processor_config.json`` to ``out_dir``.

    The files are written one by one rather than through ``Qwen2_5_VLProcessor.save_pretrained`` because
    that class cannot be constructed without torchvision (its video processor needs it); with torchvision
    installed ``AutoProcessor.from_pretrained(out_dir)`` loads the directory as a ``Qwen2_5_VLProcessor``.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TEXT_TOKENIZER)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]})
    # an assistant turn ends at <|im_end|>, as in Qwen's instruct models
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    _drop_keys(os.path.join(out_dir, "tokenizer_config.json"), ("is_local", "local_files_only"))
    for name, content in (("preprocessor_config.json", IMAGE_PROCESSOR),
                          ("processor_config.json", {"processor_class": "Qwen2_5_VLProcessor"})):
        with open(os.path.join(out_dir, name), "w") as fh:
            json.dump(content, fh, indent=2)
            fh.write("\n")
    return out_dir


def _drop_keys(path: str, keys: tuple[str, ...]) -> None:
    """Remove what ``save_pretrained`` records about where the tokenizer was loaded from (not a setting)."""
    with open(path) as fh:
        config = json.load(fh)
    with open(path, "w") as fh:
        json.dump({k: v for k, v in config.items() if k not in keys}, fh, indent=2, sort_keys=True)
        fh.write("\n")


def main() -> None:
    build_processor()
    print(f"wrote the processor (tokenizer + vision tokens, chat template, image processor) to {OUT}")


if __name__ == "__main__":
    main()
