"""The model's processor (tokenizer + image processor + chat template), from the recipe's task options.

* ``processor``: a directory ``AutoProcessor.from_pretrained`` reads; default: the directory the trainer loaded
  the tokenizer from (the model directory).
* ``image_processor``: assemble the processor from the trainer's tokenizer and this image processor instead: a
  directory (``AutoImageProcessor.from_pretrained``) or a config mapping naming its class, e.g.
  ``{"image_processor_type": "Qwen2VLImageProcessorPil", "patch_size": 14, "merge_size": 2}``. The processor
  class is the one transformers registers for the model's ``model_type``; the chat template is the tokenizer's.
* ``min_pixels`` / ``max_pixels``: the pixel budget of one image (Qwen2-VL family: images are resized to a
  multiple of the patch grid whose area lies within the budget). Processors with a fixed input size (InternVL,
  Gemma 3) have no such budget: these options are refused for them, with the option that does apply.

Image sizes: :func:`image_size_refusal` says, from an image's width and height alone, whether the processor would
refuse it (the data check runs it on every image's header before training, see :mod:`twinkle_vlm.images`).

Custom code: every load passes the resolved switch (:func:`twinkle_core.sources.resolve.trust_remote_code`:
``trust_remote_code=`` of :func:`load_processor`, else ``TWINKLE_TRUST_REMOTE_CODE``) to transformers explicitly,
so transformers never asks "Do you wish to run the custom code? [y/N]" on stdin. With the switch off, a directory
whose config, tokenizer, processor or image processor declares custom code (``auto_map``) is refused before
transformers reads it, with an error naming the switches.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_core.sources import resolve

#: the files of a model directory where transformers looks for ``auto_map`` (custom code to import)
CUSTOM_CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
                     "video_preprocessor_config.json", "image_processor_config.json")


def refuse_custom_code(directory: str | os.PathLike[str], what: str, trust: bool) -> None:
    """With the switch off, refuse ``directory`` when one of its configs declares custom code (``auto_map``):
    transformers would otherwise import it, ask on stdin, or silently swap in a built-in class."""
    if trust or not os.path.isdir(directory):
        return
    for name in CUSTOM_CODE_FILES:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                content = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}; fix or remove that file") from exc
        if isinstance(content, Mapping) and content.get("auto_map"):
            raise ConfigError(f"{what} ({path}) names custom code in its auto_map, and running a model "
                              f"repository's code is off; {resolve.REMOTE_CODE_FIX}")


def _model_type(model_dir: str, trust: bool) -> str:
    from transformers import AutoConfig

    refuse_custom_code(model_dir, f"the model directory {model_dir}", trust)
    with resolve.explain_remote_code_refusal(f"the model config at {model_dir}"):
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust).model_type


def _image_processor(spec: Any, trust: bool) -> Any:
    import transformers

    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        refuse_custom_code(path, f"the image processor at {path}", trust)
        with resolve.explain_remote_code_refusal(f"the image processor at {path}"):
            return transformers.AutoImageProcessor.from_pretrained(path, trust_remote_code=trust)
    if not isinstance(spec, Mapping):
        raise ConfigError("task_options.image_processor must be a directory or a config mapping with "
                          f"'image_processor_type', got {type(spec).__name__}")
    options = dict(spec)
    name = options.pop("image_processor_type", None)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"task_options.image_processor.image_processor_type must name a transformers image "
                          f"processor class (e.g. Qwen2VLImageProcessorPil), got {name!r}")
    return cls(**options)


def _assembled(tokenizer: Any, model_dir: str, spec: Any, trust: bool) -> Any:
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    model_type = _model_type(model_dir, trust)
    class_name = PROCESSOR_MAPPING_NAMES.get(model_type)
    if class_name is None:
        raise ConfigError(f"transformers has no processor class for model_type {model_type!r}; give "
                          "task_options.processor (a directory with the processor files) instead")
    cls = getattr(transformers, class_name)
    return cls(image_processor=_image_processor(spec, trust), tokenizer=tokenizer,
               chat_template=getattr(tokenizer, "chat_template", None))


def apply_pixel_limits(image_processor: Any, min_pixels: int | None, max_pixels: int | None) -> None:
    """Set the per-image pixel budget of a Qwen2-VL-style image processor (``size`` holds it as
    ``shortest_edge`` / ``longest_edge``, in pixels, not edges)."""
    if min_pixels is None and max_pixels is None:
        return
    size = getattr(image_processor, "size", None)
    if size is None or getattr(size, "longest_edge", None) is None or not hasattr(image_processor, "merge_size"):
        raise ConfigError(f"min_pixels / max_pixels apply to processors with a pixel budget (Qwen2-VL, Qwen2.5-VL, "
                          f"Qwen3-VL); {type(image_processor).__name__} resizes to a fixed size: set its 'size' "
                          "through task_options.image_processor instead")
    low = int(min_pixels) if min_pixels is not None else size.shortest_edge
    high = int(max_pixels) if max_pixels is not None else size.longest_edge
    if not 0 < low <= high:
        raise ConfigError(f"need 0 < min_pixels <= max_pixels, got min_pixels={low}, max_pixels={high}")
    size.shortest_edge, size.longest_edge = low, high


def image_size_refusal(image_processor: Any, width: int, height: int) -> str | None:
    """Why ``image_processor`` would refuse a ``width`` x ``height`` image, or None; no pixel is needed.

    The processor answers itself: ``get_number_of_image_patches(height, width)`` (transformers' method for planning
    an image's tokens without its pixels, which vLLM uses) runs the resize rule the processor applies to pixels.
    For the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) that is ``smart_resize``, which in
    transformers 5.25 refuses an aspect ratio (long side / short side) over 200 with a ``ValueError``; the rule
    follows whatever version is installed. InternVL's tiling takes any size, and processors without the method
    (Gemma 3) resize every image to their fixed input size."""
    plan = getattr(image_processor, "get_number_of_image_patches", None)
    if plan is None:
        return None
    try:
        plan(height, width)
    except ValueError as exc:
        return (f"the model's image processor ({type(image_processor).__name__}) cannot take a {width}x{height} "
                f"image: {exc}; crop or pad the image to a less extreme shape")
    return None


def load_processor(tokenizer: Any, options: Mapping[str, Any], *, trust_remote_code: bool | None = None) -> Any:
    """The processor the ``vlm`` task renders and encodes with (see the module doc for ``options``).

    Its tokenizer is the trainer's ``tokenizer``, so the ids the task produces are the ones the model and
    the saved checkpoint use. ``trust_remote_code``: whether the processor's own code may run (``None``:
    ``TWINKLE_TRUST_REMOTE_CODE``, off by default)."""
    from transformers import AutoProcessor

    from twinkle_vlm.compat import allow_processors_without_torchvision

    allow_processors_without_torchvision()
    trust = resolve.trust_remote_code(trust_remote_code)
    model_dir = getattr(tokenizer, "name_or_path", None)
    if options.get("image_processor") is not None:
        if not model_dir or not os.path.isdir(model_dir):
            raise ConfigError("task_options.image_processor needs the model directory to find the processor class; "
                              "the tokenizer was not loaded from a directory")
        processor = _assembled(tokenizer, model_dir, options["image_processor"], trust)
    else:
        path = options.get("processor") or model_dir
        if not path:
            raise ConfigError("the vlm task needs a processor: set task_options.processor to a directory with the "
                              "processor files (or task_options.image_processor to assemble one)")
        refuse_custom_code(os.fspath(path), f"the processor at {path}", trust)
        try:
            with resolve.explain_remote_code_refusal(f"the processor at {path}"):
                processor = AutoProcessor.from_pretrained(os.fspath(path), trust_remote_code=trust)
        except ConfigError:
            raise
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load a processor from {path}: {exc}; set task_options.processor to a "
                              "directory with preprocessor_config.json (or task_options.image_processor)") from exc
        if getattr(processor, "image_processor", None) is None:
            raise ConfigError(f"{path} holds no image processor (AutoProcessor returned "
                              f"{type(processor).__name__}); set task_options.processor or image_processor")
        processor.tokenizer = tokenizer
    if not getattr(processor, "chat_template", None):
        raise ConfigError("the processor has no chat template; save one with the processor (chat_template.jinja) "
                          "or give the tokenizer one")
    apply_pixel_limits(processor.image_processor, options.get("min_pixels"), options.get("max_pixels"))
    return processor


__all__ = ["CUSTOM_CODE_FILES", "apply_pixel_limits", "image_size_refusal", "load_processor", "refuse_custom_code"]
