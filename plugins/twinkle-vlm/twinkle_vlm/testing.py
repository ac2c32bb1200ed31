"""Tiny, offline vision-language models and processors for tests and examples.

Nothing is downloaded. For every supported ``model_type`` this builds, in code:

* the project's tiny byte-level tokenizer (:func:`twinkle_core.testing.tiny_tokenizer.build_tiny_tokenizer`)
  extended with the family's vision special tokens;
* a chat template that renders image parts the way the real model's template does;
* the family's PIL image processor with small resolution limits (a handful of vision tokens per image);
* a config with hidden sizes <= 64 and 1-2 layers per tower.

Usage::

    from twinkle_vlm.testing import save_tiny_vlm, tiny_processor

    processor = tiny_processor("qwen2_5_vl")
    path = save_tiny_vlm("qwen2_5_vl", tmp_path / "model")
    AutoModelForImageTextToText.from_pretrained(path); AutoProcessor.from_pretrained(path)
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from twinkle_vlm.compat import allow_processors_without_torchvision
from twinkle_vlm.testing_families import TINY_FAMILIES, TinyFamily

#: Model types :func:`tiny_processor` / :func:`save_tiny_vlm` can build.
TINY_MODEL_TYPES = tuple(TINY_FAMILIES)


def _family(model_type: str) -> TinyFamily:
    try:
        return TINY_FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"no tiny VLM for model_type {model_type!r}; "
                         f"choose one of {', '.join(TINY_MODEL_TYPES)}") from None


def tiny_tokenizer(model_type: str) -> Any:
    """The project's tiny tokenizer plus ``model_type``'s vision special tokens."""
    from twinkle_core.testing.tiny_tokenizer import build_tiny_tokenizer

    family = _family(model_type)
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(list(family.special_tokens), special_tokens=True)
    tokenizer.chat_template = family.chat_template
    if family.tokenizer_attributes:
        # named multimodal tokens (``tokenizer.image_token`` / ``image_token_id``, which InternVL and
        # Gemma 3 processors read) are declared the way hub checkpoints do: in the tokenizer config
        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory() as staging:
            tokenizer.save_pretrained(staging)
            tokenizer = AutoTokenizer.from_pretrained(staging, trust_remote_code=False,
                                                      **family.tokenizer_attributes)
    return tokenizer


def tiny_processor(model_type: str, *, min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    """A processor for ``model_type``: tiny tokenizer + vision tokens, chat template, PIL image
    processor. ``min_pixels`` / ``max_pixels`` override the small defaults where the family has them."""
    allow_processors_without_torchvision()
    family = _family(model_type)
    tokenizer = tiny_tokenizer(model_type)
    image_processor = family.image_processor(min_pixels=min_pixels, max_pixels=max_pixels)
    return family.processor_class()(image_processor=image_processor, tokenizer=tokenizer,
                                    chat_template=family.chat_template, **family.processor_kwargs)


def tiny_config(model_type: str, processor: Any | None = None) -> Any:
    """The tiny model config of ``model_type``, with token ids taken from ``processor``'s tokenizer."""
    processor = processor if processor is not None else tiny_processor(model_type)
    return _family(model_type).config(processor.tokenizer)


def build_tiny_vlm(model_type: str, *, seed: int = 0) -> tuple[Any, Any]:
    """``(model, processor)`` in memory: an ``AutoModelForImageTextToText`` with random weights
    (deterministic in ``seed``) in fp32 and its processor."""
    import torch
    from transformers import AutoModelForImageTextToText

    processor = tiny_processor(model_type)
    config = tiny_config(model_type, processor)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32, trust_remote_code=False)
    return model, processor


def save_tiny_vlm(model_type: str, directory: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny ``model_type`` VLM (config, random weights, tokenizer, image processor config,
    chat template) to ``directory`` and return it; ``AutoModelForImageTextToText.from_pretrained``
    and ``AutoProcessor.from_pretrained`` load it."""
    directory = Path(directory)
    model, processor = build_tiny_vlm(model_type, seed=seed)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


# --------------------------------------------------------------------------- a trainable model on a tiny VLM

def build_vlm_model(model_dir: str | Path, *, adapter: dict[str, Any] | None = None,
                    task_options: dict[str, Any] | None = None, strategy: str | None = None,
                    **kwargs: Any) -> tuple[Any, Any]:
    """``(model, task)``: a ``TransformersModel`` on ``model_dir`` with the ``vlm`` task, prepared the way the
    trainer prepares it (``prepare_model``, then the adapter), with an SGD optimizer."""
    from twinkle_backend_hf.model import TransformersModel

    from twinkle_vlm.task import VLMTask

    task = VLMTask(**(task_options or {}))
    tokenizer = TransformersModel.load_tokenizer(str(model_dir))
    model = TransformersModel(model_id=str(model_dir), task=task, tokenizer=tokenizer,
                              **({"strategy": strategy} if strategy else {}), **kwargs)
    task.prepare_model(model)
    name = None
    if adapter is not None:
        name = "default"
        model.add_adapter_to_model(name, adapter)
    model.set_loss("cross_entropy", adapter_name=name)
    model.set_optimizer("SGD", adapter_name=name, lr=0.5)
    return model, task


def vlm_batch(task: Any, model: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One collated batch of chat ``rows``, completed by the task as the trainer does (``prepare_batch``)."""
    features = task.load_dataset(rows, model.tokenizer)
    return task.prepare_batch(model, task.collate(features))


def train_steps(model: Any, batch: dict[str, Any], steps: int, adapter_name: str | None = None) -> list[float]:
    """``steps`` optimizer steps on ``batch``; the loss of each."""
    losses = []
    for _ in range(steps):
        out = model.forward_backward(inputs=batch, adapter_name=adapter_name)
        losses.append(float(out["loss"]))
        model.clip_grad_and_step(None, adapter_name=adapter_name)
    return losses


def character_share(prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
    """A dense reward for online-RL tests (``twinkle_vlm.testing:character_share``): the share of a completion's
    characters that are vowels, so the random completions of one prompt score differently."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


__all__ = ["TINY_MODEL_TYPES", "build_tiny_vlm", "character_share", "build_vlm_model", "save_tiny_vlm", "tiny_config", "tiny_processor",
           "tiny_tokenizer", "train_steps", "vlm_batch"]
