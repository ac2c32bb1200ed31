"""Image files: checking them before training and opening them for the processor.

Every open goes through the same gate, in this order, and never decodes a pixel before the last step:

1. with a ``root`` (task option ``image_root``), the path -- ``..`` and symlinks resolved -- lies inside it
   (checked first, so nothing is told about files outside the root, not even whether they exist);
2. the file exists and is a regular file;
3. PIL reads the header only (``Image.open``), and the declared ``width x height`` is at most
   ``max_image_pixels`` (task option; default :data:`DEFAULT_MAX_IMAGE_PIXELS`). A 17 KB PNG can declare
   144 million pixels, and decoding it takes gigabytes before any processor's ``max_pixels`` applies;
4. only then are the pixels decoded.

A check (:func:`image_problem`) opens the file twice: ``Image.verify()`` catches a damaged container (a truncated
PNG, a bad checksum) without decoding the pixels, and a second open with ``load()`` catches what only decoding
finds (a truncated pixel stream). Both are needed: ``verify`` leaves the image unusable, and ``load`` alone accepts
some damaged headers. It can also ask a processor whether it takes the image's size (``size_refusal``, e.g.
:func:`twinkle_vlm.processor.image_size_refusal`), from the header alone.

PIL's own process-wide guard (``PIL.Image.MAX_IMAGE_PIXELS``: a ``DecompressionBombWarning`` above it, a
``DecompressionBombError`` above twice it) is left as it is and still applies; what it raises is reported as an
:class:`ImageFileError` too.

Every failure is an :class:`ImageFileError` (a :class:`~twinkle_core.errors.DataFormatError`) whose message names
the image and the fix; :func:`image_problem` returns that message instead of raising.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError, DataFormatError

#: the default of ``max_image_pixels``: PIL's own default ``Image.MAX_IMAGE_PIXELS`` (``1024**3 // 4 // 3``, about
#: 9459 x 9459), the size above which PIL itself calls an image a possible decompression bomb. Common camera photos
#: fit (up to ~61 Mpixel); one image this large takes 256 MiB per decoded RGB copy, and the processors resize it to
#: far less anyway (the Qwen-VL checkpoints' pixel budgets are at most ~16 Mpixel).
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485

#: ``(width, height) -> reason or None``: whether a consumer (a processor) takes an image of that size
SizeRefusal = Callable[[int, int], "str | None"]


class ImageFileError(DataFormatError):
    """An image cannot be used (missing, outside ``image_root``, too large, not an image, corrupt); ``path`` is the
    image, ``reason`` the whole message (it names the image and the fix)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, None, reason)
        self.args = (reason,)

    def __str__(self) -> str:
        return self.reason


def check_image_root(root: Any) -> Path | None:
    """``root`` (the ``image_root`` option) resolved, or None when unset; a :class:`ConfigError` unless it is an
    existing directory."""
    if root is None:
        return None
    if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
        raise ConfigError(f"task_options.image_root must be a directory path, got {root!r}")
    resolved = Path(os.fspath(root)).expanduser().resolve()
    if not resolved.is_dir():
        raise ConfigError(f"task_options.image_root {os.fspath(root)} is not an existing directory; create it or "
                          "point image_root at the directory holding the images")
    return resolved


def check_max_image_pixels(value: Any) -> int:
    """The ``max_image_pixels`` option checked (None: :data:`DEFAULT_MAX_IMAGE_PIXELS`); a :class:`ConfigError`
    unless it is a positive integer."""
    if value is None:
        return DEFAULT_MAX_IMAGE_PIXELS
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"task_options.max_image_pixels must be a positive integer (pixels, width x height), got "
                          f"{value!r}; the default is {DEFAULT_MAX_IMAGE_PIXELS:,}")
    return value


def confined(path: str, root: str | os.PathLike[str] | None) -> str:
    """The path to open for ``path``: ``path`` itself without a ``root``; with one, ``path`` with ``..`` and every
    symlink resolved, which must lie inside ``root`` (else :class:`ImageFileError`)."""
    if root is None:
        return path
    base = Path(root).resolve()
    try:
        real = Path(path).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise ImageFileError(path, f"image path {path} cannot be resolved ({exc}); fix the symlink") from None
    if not real.is_relative_to(base):
        shown = "" if str(real) == os.path.abspath(path) else f" (it resolves to {real})"
        raise ImageFileError(path, f"image {path} is outside image_root {base}{shown}; only files under image_root "
                                   "may be read: move the image there, or fix the path")
    return str(real)


def _too_large(path: str, width: int, height: int, limit: int) -> str:
    return (f"image {path} is {width}x{height} ({width * height:,} pixels), more than max_image_pixels={limit:,} "
            "(a guard against decompression bombs, checked before decoding): shrink the image, or raise "
            "max_image_pixels (task_options.max_image_pixels in a recipe)")


def _pil_refusal(path: str, exc: BaseException, limit: int) -> str:
    """PIL's own guard (``PIL.Image.MAX_IMAGE_PIXELS``) refused ``path`` before its size could be read."""
    from PIL import Image

    pil_limit = Image.MAX_IMAGE_PIXELS
    if pil_limit is not None and limit > pil_limit:  # PIL refuses what max_image_pixels would take
        fix = (f"shrink the image, or raise PIL.Image.MAX_IMAGE_PIXELS (now {pil_limit:,}) in the program that "
               f"trains: PIL's own limit applies besides max_image_pixels={limit:,}")
    else:  # PIL refuses above its limit, which is at least max_image_pixels
        fix = f"shrink the image to at most max_image_pixels={limit:,} pixels"
    return f"image {path} is too large for PIL to open ({str(exc).rstrip('.')}): {fix}"


@contextmanager
def _header(path: str, root: str | os.PathLike[str] | None, limit: int) -> Iterator[Any]:
    """The image at ``path`` opened (header read, pixels not decoded), its size within ``limit``."""
    from PIL import Image, UnidentifiedImageError

    target = confined(path, root)
    if not os.path.exists(target):
        raise ImageFileError(path, f"image file not found: {path}")
    if not os.path.isfile(target):
        raise ImageFileError(path, f"image path is not a file: {path}")
    try:
        image = Image.open(target)
    except UnidentifiedImageError:
        raise ImageFileError(path, f"not a readable image (unknown format): {path}") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:  # the warning: under -W error
        raise ImageFileError(path, _pil_refusal(path, exc, limit)) from None
    except (OSError, SyntaxError, ValueError) as exc:  # PIL reports a damaged header as any of these
        raise ImageFileError(path, f"corrupt image {path}: {exc}") from None
    with image:
        width, height = image.size
        if width * height > limit:
            raise ImageFileError(path, _too_large(path, width, height, limit))
        yield image


def _check(path: str, root: str | os.PathLike[str] | None, limit: int, size_refusal: SizeRefusal | None) -> None:
    with _header(path, root, limit) as image:
        refusal = size_refusal(*image.size) if size_refusal is not None else None
        if refusal is not None:
            raise ImageFileError(path, f"image {path}: {refusal}")
        try:
            image.verify()
        except (OSError, SyntaxError, ValueError) as exc:  # PIL reports damage as any of these
            raise ImageFileError(path, f"corrupt image {path}: {exc}") from None
    with _header(path, root, limit) as image:
        try:
            image.load()
        except (OSError, SyntaxError, ValueError) as exc:
            raise ImageFileError(path, f"corrupt image {path}: {exc}") from None


def image_problem(path: str, *, root: str | os.PathLike[str] | None = None,
                  max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                  size_refusal: SizeRefusal | None = None) -> str | None:
    """Why ``path`` cannot be used as an image (missing, outside ``root``, more pixels than ``max_image_pixels``,
    a size ``size_refusal`` refuses, not an image, corrupt), or None. Pixels are decoded only once the header
    passed."""
    try:
        _check(path, root, max_image_pixels, size_refusal)
    except ImageFileError as exc:
        return exc.reason
    return None


def open_image(path: str, *, root: str | os.PathLike[str] | None = None,
               max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Any:
    """The image at ``path`` decoded as RGB (processors expect three channels; PNGs may carry alpha or a palette),
    through the gate of the module doc: a file outside ``root`` (when given) or larger than ``max_image_pixels``
    is refused before decoding. Raises :class:`ImageFileError` (a ``DataFormatError``) naming the file and the fix.

    Meant for paths and files others supply, e.g. in a training service::

        open_image(user_path, root="/srv/uploads/job-17", max_image_pixels=40_000_000)

    The root is checked on the resolved path and the resolved path is what is opened; a directory that someone
    else can change between the check and the open (swapping in a symlink) still needs the OS to isolate it.
    """
    with _header(path, root, max_image_pixels) as image:
        try:
            return image.convert("RGB")
        except (OSError, SyntaxError, ValueError) as exc:
            raise ImageFileError(path, f"corrupt image {path}: {exc}") from None


__all__ = ["DEFAULT_MAX_IMAGE_PIXELS", "ImageFileError", "SizeRefusal", "check_image_root", "check_max_image_pixels",
           "confined", "image_problem", "open_image"]
