"""Ask the VLM quickstart's checkpoint about a new picture, with plain transformers (no Twinkle import).

    python examples/vlm/generate.py outputs/vlm/final                      # fresh pictures, every question kind
    python examples/vlm/generate.py outputs/vlm/final my.png "What colour is the shape?"

Without an image it draws new pictures (a seed the data set never uses) and prints the true answer next to
the model's.
"""

from __future__ import annotations

import os
import random
import sys

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer
from transformers.utils import is_torchvision_available

HERE = os.path.dirname(os.path.abspath(__file__))
NEW_PICTURES_SEED = 2024  # make_images.py draws its data set with seed 0


class ImageOnlyProcessor:
    """What ``Qwen2_5_VLProcessor`` does for one chat with images, for when it cannot be built.

    transformers 5.24 gives Qwen2.5-VL's processor a video processor, and every video processor needs
    torchvision: without torchvision ``AutoProcessor.from_pretrained`` raises. This stand-in loads the
    tokenizer and the image processor from the same directory and expands each ``<|image_pad|>`` into one
    token per merged patch, exactly as the real processor does."""

    image_token = "<|image_pad|>"

    def __init__(self, path: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.image_processor = AutoImageProcessor.from_pretrained(path)

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __call__(self, text: list[str], images: list[Image.Image], return_tensors: str = "pt") -> dict:
        vision = self.image_processor(images=images, return_tensors=return_tensors)
        tokens_per_image = iter(int(g.prod()) // self.image_processor.merge_size ** 2
                                for g in vision["image_grid_thw"])
        expanded = [self._expand(t, tokens_per_image) for t in text]
        encoded = self.tokenizer(expanded, return_tensors=return_tensors, padding=True)
        # the modality of every token (text 0, image 1): Qwen2.5-VL places image tokens on its 3-D RoPE grid
        # by it; without it the model would read the picture as text positions
        image_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        encoded["mm_token_type_ids"] = (encoded["input_ids"] == image_id).long()
        return {**encoded, **vision}

    def _expand(self, text: str, counts) -> str:
        pieces = text.split(self.image_token)
        return pieces[0] + "".join(self.image_token * next(counts) + rest for rest in pieces[1:])


def load_processor(path: str):
    return AutoProcessor.from_pretrained(path) if is_torchvision_available() else ImageOnlyProcessor(path)


def answer(model, processor, image: Image.Image, question: str) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    tokenizer = processor.tokenizer
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False,
                             eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def fresh_pictures() -> list[tuple[Image.Image, str, str]]:
    """One new picture per question kind: (picture, question, true answer)."""
    sys.path.insert(0, HERE)
    import make_images

    rng = random.Random(NEW_PICTURES_SEED)
    cases = []
    for kind in make_images.DEFAULT_KINDS:
        image, truth = make_images.picture(rng, kind)
        cases.append((image, make_images.QUESTIONS[kind], truth))
    return cases


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "outputs/vlm/final"
    processor = load_processor(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    if len(sys.argv) > 2:
        image = Image.open(sys.argv[2]).convert("RGB")
        for question in sys.argv[3:] or ["What colour is the shape?"]:
            print(f"{question!r} -> {answer(model, processor, image, question)!r}")
        return
    for image, question, truth in fresh_pictures():
        print(f"{question!r} -> {answer(model, processor, image, question)!r} (true: {truth!r})")


if __name__ == "__main__":
    main()
