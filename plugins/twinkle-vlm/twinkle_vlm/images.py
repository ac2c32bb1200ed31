"""Image files: checking them before training and opening them for the processor.

A check opens the file twice: ``Image.verify()`` catches a damaged container (a truncated PNG, a bad
checksum) without decoding the pixels, and a second open with ``load()`` catches what only decoding
finds (a truncated pixel stream). Both are needed: ``verify`` leaves the image unusable, and ``load``
alone accepts some damaged headers.
"""

from __future__ import annotations

import os
from typing import Any


def image_problem(path: str) -> str | None:
    """Why ``path`` cannot be used as an image (missing, not a file, not an image, corrupt), or None."""
    from PIL import Image, UnidentifiedImageError

    if not os.path.exists(path):
        return f"image file not found: {path}"
    if not os.path.isfile(path):
        return f"image path is not a file: {path}"
    try:
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            image.load()
    except UnidentifiedImageError:
        return f"not a readable image (unknown format): {path}"
    except (OSError, SyntaxError, ValueError) as exc:  # PIL reports damage as any of these
        return f"corrupt image {path}: {exc}"
    return None


def open_image(path: str) -> Any:
    """The image at ``path`` decoded as RGB (processors expect three channels; PNGs may carry alpha or a palette)."""
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


__all__ = ["image_problem", "open_image"]
