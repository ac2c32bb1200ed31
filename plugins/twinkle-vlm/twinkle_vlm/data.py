"""VLM data rows: two formats read into one :class:`VLMSample`, validated before training.

Accepted rows (JSONL, JSON, or anything the core's data specs read):

* typed content parts::

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "imgs/cat.png"},
                                               {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": "A cat."}]}

* LLaMA-Factory / ms-swift style, ``<image>`` placeholders in the text, images listed in order::

    {"messages": [{"role": "user", "content": "<image>What is this?"},
                  {"role": "assistant", "content": "A cat."}], "images": ["imgs/cat.png"]}

ShareGPT ``conversations`` (``from`` / ``value``) and a top-level ``system`` work as in the core. Relative image
paths are relative to the directory of the data file (to the working directory for rows given in code). A row
without images is a text-only sample. Videos work the same way: ``{"type": "video", "video": "clips/a.mp4"}`` parts,
or ``<video>`` placeholders with a ``videos`` list; a video is a file, a directory of frames or a list of frame paths
(:mod:`twinkle_vlm.videos`, which also checks them). Images belong to user / system turns: the model cannot be trained to
produce one.

Every row is checked before any training (the last message must be the assistant's, placeholders match the
images, every image exists, lies under ``image_root`` when one is set, has at most ``max_image_pixels`` pixels by
its header, has a size the model's image processor takes, and decodes: :mod:`twinkle_vlm.images`); all problems
are collected and raised together as one :class:`VLMDataError` naming file, line and reason of each (the first
:data:`MAX_REPORTED`).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from twinkle_core.data.formats import ROLES, RowError, normalize_conversation
from twinkle_core.data.mixing import Record, is_data_spec, load_spec, parse_sources
from twinkle_core.errors import DataFormatError
from twinkle_vlm.images import check_image_root, check_max_image_pixels, image_problem
from twinkle_vlm.processor import image_size_refusal
from twinkle_vlm.videos import VIDEO_PLACEHOLDER, VideoSource, video_problem

#: the placeholder of the LLaMA-Factory / ms-swift format
IMAGE_PLACEHOLDER = "<image>"
#: how many problems one error message lists
MAX_REPORTED = 20

_PLACEHOLDER_SPLIT = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


@dataclass
class VLMSample:
    """One conversation: messages with typed content parts (``{"type": "text", "text"}`` / ``{"type": "image"}``
    / ``{"type": "video"}``, the form processors' chat templates read) and the absolute paths of its images and
    videos (a file or directory path, or a list of frame paths: :mod:`twinkle_vlm.videos`) in order of
    appearance."""

    messages: list[dict[str, Any]]
    images: list[str]
    source: str = "<rows>"
    line: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    videos: list[VideoSource] = field(default_factory=list)


class VLMDataError(DataFormatError):
    """Several rows are bad; ``problems`` lists ``(file, line, reason)`` of each one found."""

    def __init__(self, problems: list[tuple[str, int | None, str]]) -> None:
        first_path, first_line, first_reason = problems[0]
        super().__init__(first_path, first_line, first_reason)
        self.problems = problems
        shown = [f"{path}:{line}: {reason}" if line is not None else f"{path}: {reason}"
                 for path, line, reason in problems[:MAX_REPORTED]]
        more = len(problems) - len(shown)
        head = f"{len(problems)} problem(s) in the VLM data; fix them before training:"
        self.args = ("\n  ".join([head, *shown]) + (f"\n  ... and {more} more" if more > 0 else ""),)

    def __str__(self) -> str:
        return str(self.args[0])


def _text_part(text: Any, where: str) -> dict[str, Any]:
    if not isinstance(text, str):
        raise RowError(f"{where}: a text part needs a string 'text', got {type(text).__name__}")
    return {"type": "text", "text": text}


def _video_source(value: Any, where: str) -> VideoSource:
    """A video as a row gives it: a file or frame directory path, or a non-empty list of frame paths."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(p, str) and p for p in value):
        return list(value)
    raise RowError(f"{where}: a video is a file or frame directory path, or a list of frame image paths, got {value!r}")


def _typed_parts(content: list[Any], where: str, images: list[str], videos: list[VideoSource]) -> list[dict[str, Any]]:
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or "type" not in part:
            raise RowError(f"{where} part {j} must be an object with 'type' ('text', 'image' or 'video')")
        if part["type"] == "text":
            parts.append(_text_part(part.get("text"), f"{where} part {j}"))
        elif part["type"] == "image":
            path = part.get("image", part.get("path"))
            if not isinstance(path, str) or not path:
                raise RowError(f"{where} part {j}: an image part needs the file path in 'image'")
            images.append(path)
            parts.append({"type": "image"})
        elif part["type"] == "video":
            videos.append(_video_source(part.get("video", part.get("path")), f"{where} part {j}"))
            parts.append({"type": "video"})
        else:
            raise RowError(f"{where} part {j} has unknown type {part['type']!r}; expected 'text', 'image' or 'video'")
    return parts


def _placeholder_parts(content: str, listed: list[str], images: list[str], listed_videos: list[VideoSource],
                       videos: list[VideoSource]) -> list[dict[str, Any]]:
    parts = []
    for piece in _PLACEHOLDER_SPLIT.split(content):
        if piece == IMAGE_PLACEHOLDER:
            # a missing entry is reported once for the whole row (placeholder count vs images)
            images.append(listed[len(images)] if len(images) < len(listed) else "")
            parts.append({"type": "image"})
        elif piece == VIDEO_PLACEHOLDER:
            videos.append(listed_videos[len(videos)] if len(videos) < len(listed_videos) else "")
            parts.append({"type": "video"})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _listed_media(extra: dict[str, Any]) -> tuple[list[str], list[VideoSource]]:
    """The row's ``images`` and ``videos`` columns (for ``<image>`` / ``<video>`` placeholders), checked."""
    listed = extra.pop("images", None)
    if listed is not None and (not isinstance(listed, list) or not all(isinstance(p, str) for p in listed)):
        raise RowError("'images' must be a list of file paths")
    listed_videos = extra.pop("videos", None)
    if listed_videos is not None and not isinstance(listed_videos, list):
        raise RowError("'videos' must be a list of videos (file or frame directory paths, or lists of frame paths)")
    return listed or [], [_video_source(v, f"'videos' entry {k}") for k, v in enumerate(listed_videos or [])]


@dataclass
class _Media:
    """The images and videos a row's messages name, and how: as typed parts or as placeholders."""

    images: list[str] = field(default_factory=list)
    videos: list[VideoSource] = field(default_factory=list)
    typed_images: int = 0
    placeholders: int = 0
    typed_videos: int = 0
    video_placeholders: int = 0


def _parse_message(i: int, message: Any, listed: list[str], listed_videos: list[VideoSource],
                   media: _Media) -> dict[str, Any]:
    where = f"message {i}"
    if not isinstance(message, Mapping) or message.get("role") not in ROLES:
        raise RowError(f"{where} must be an object with a 'role' in {', '.join(ROLES)}")
    content = message.get("content")
    before, videos_before = len(media.images), len(media.videos)
    if isinstance(content, str):
        parts = _placeholder_parts(content, listed, media.images, listed_videos, media.videos)
        media.placeholders += len(media.images) - before
        media.video_placeholders += len(media.videos) - videos_before
    elif isinstance(content, list):
        parts = _typed_parts(content, where, media.images, media.videos)
        media.typed_images += len(media.images) - before
        media.typed_videos += len(media.videos) - videos_before
    else:
        raise RowError(f"{where} ({message['role']}) content must be a string or a list of parts")
    if (len(media.images) > before or len(media.videos) > videos_before) and message["role"] == "assistant":
        raise RowError(f"{where} is the assistant's and holds an image or video; they belong to user or system "
                       "turns")
    return {"role": message["role"], "content": parts}


def _check_media_counts(media: _Media, listed: list[str], listed_videos: list[VideoSource]) -> None:
    if media.typed_images and listed:
        raise RowError("the row has both image parts and an 'images' list; use one of the two formats")
    if media.placeholders != len(listed):
        raise RowError(f"{media.placeholders} {IMAGE_PLACEHOLDER} placeholder(s) in the messages but {len(listed)} "
                       "image(s) in 'images'; they must match one to one")
    if media.typed_videos and listed_videos:
        raise RowError("the row has both video parts and a 'videos' list; use one of the two formats")
    if media.video_placeholders != len(listed_videos):
        raise RowError(f"{media.video_placeholders} {VIDEO_PLACEHOLDER} placeholder(s) in the messages but "
                       f"{len(listed_videos)} video(s) in 'videos'; they must match one to one")


def parse_row(row: Any, base_dir: str) -> VLMSample:
    """A row -> :class:`VLMSample` (paths made absolute, files not yet opened); raises :class:`RowError`."""
    messages, extra = normalize_conversation(row)
    listed, listed_videos = _listed_media(extra)
    media = _Media()
    parsed = [_parse_message(i, message, listed, listed_videos, media) for i, message in enumerate(messages)]
    if parsed[-1]["role"] != "assistant":
        raise RowError(f"the last message must be from the assistant for SFT, got {parsed[-1]['role']!r}")
    _check_media_counts(media, listed, listed_videos)

    def absolute(path: str) -> str:
        return os.path.normpath(os.path.join(base_dir, path))

    clips = [absolute(v) if isinstance(v, str) else [absolute(p) for p in v] for v in media.videos]
    return VLMSample(messages=parsed, images=[absolute(p) for p in media.images], extra=extra, videos=clips)


def _base_dir(path: str) -> str:
    path = os.path.expanduser(path)
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def _records(spec: Any, columns: Any, seed: int) -> list[tuple[Record, str]]:
    """Every record of ``spec`` with the directory its image paths are relative to."""
    if is_data_spec(spec):
        sources = parse_sources(spec, columns=columns)
        records = load_spec(spec, columns=columns, seed=seed, validate=None)
        return [(r, _base_dir(sources[r.index].path)) for r in records]
    return [(Record("<rows>", i + 1, row), os.getcwd()) for i, row in enumerate(spec)]


def load_samples(spec: Any, *, columns: Any = None, seed: int = 0, image_root: Any = None,
                 max_image_pixels: int | None = None, image_processor: Any = None) -> list[VLMSample]:
    """Read and validate every row of ``spec`` (a data spec or a list of rows); raise :class:`VLMDataError`
    listing every problem found (each image is checked once, however often mixing repeats its row).

    ``image_root``: refuse images that do not resolve inside this directory (default: no confinement);
    ``max_image_pixels``: refuse images whose header declares more pixels (default
    :data:`~twinkle_vlm.images.DEFAULT_MAX_IMAGE_PIXELS`); ``image_processor``: refuse sizes it would refuse
    (:func:`~twinkle_vlm.processor.image_size_refusal`)."""
    root = check_image_root(image_root)
    limit = check_max_image_pixels(max_image_pixels)
    refusal = functools.partial(image_size_refusal, image_processor) if image_processor is not None else None
    problems: list[tuple[str, int | None, str]] = []
    samples: list[VLMSample] = []
    parsed: dict[int, VLMSample | None] = {}
    checked: dict[str, str | None] = {}
    for record, base_dir in _records(spec, columns, seed):
        key = id(record)
        if key not in parsed:
            try:
                sample = parse_row(record.row, base_dir)
                sample.source, sample.line = record.source, record.line
            except RowError as exc:
                problems.append((record.source, record.line, str(exc)))
                parsed[key] = None
                continue
            bad = False
            for path in sample.images:
                if path not in checked:
                    checked[path] = image_problem(path, root=root, max_image_pixels=limit, size_refusal=refusal)
                if checked[path] is not None:
                    problems.append((record.source, record.line, checked[path]))
                    bad = True
            for clip in sample.videos:
                key_clip = "\n".join(clip) if isinstance(clip, list) else clip  # a frame list: all its paths
                if key_clip not in checked:
                    checked[key_clip] = video_problem(clip, root=root, max_image_pixels=limit)
                if checked[key_clip] is not None:
                    problems.append((record.source, record.line, checked[key_clip]))
                    bad = True
            parsed[key] = None if bad else sample
        if parsed[key] is not None:
            samples.append(parsed[key])
    if problems:
        raise VLMDataError(problems)
    return samples


__all__ = ["IMAGE_PLACEHOLDER", "MAX_REPORTED", "VLMDataError", "VLMSample", "load_samples", "parse_row"]
