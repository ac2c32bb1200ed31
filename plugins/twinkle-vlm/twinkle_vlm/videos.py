"""Video inputs: local video files or frame images, checked before training and turned into the model's video tensors.

A video in a row is one of

* a video file (``clips/a.mp4``; any container / codec PyAV's bundled FFmpeg decodes: ``pip install av``);
* a directory of frame images (``.png``, ``.jpg``, ``.jpeg``, ``.webp``, ``.bmp``), in file-name order;
* a list of frame image paths, in order.

Frames need no decoder. Their rate is taken to be ``video_fps`` (they are the sampled frames). A file is sampled
at ``video_fps`` frames per second of its duration (default :data:`DEFAULT_VIDEO_FPS`, Qwen's rate), uniformly over
the whole clip, as transformers' Qwen2-VL video processor samples. At most ``video_max_frames`` frames are kept
(frames beyond it are skipped uniformly, which lowers the effective rate). Each frame is resized as one image within
the per-frame pixel budget ``video_max_pixels`` (default: the image processor's ``max_pixels``).

Checks (:func:`video_problem`, before training, reported as ``file:line: reason``): the file or every frame exists
and lies inside ``image_root`` when set; a frame's or the stream's ``width x height`` is at most
``max_image_pixels`` (read from the header before any pixel is decoded); frames of one video share one size; a file
has a video stream whose first frame decodes.

Tensors (:class:`VideoEncoder`): Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE) and Qwen3.5 take video here
(:data:`VIDEO_PROCESSOR_CLASSES`; InternVL and Gemma 3 rows with a video are refused with the reason). Their
processor's video processor needs torchvision; where it is installed it
makes ``pixel_values_videos`` / ``video_grid_thw``. Without torchvision (this project's CPU machines) every frame
goes through the model's own image processor (its resize, rescale and normalisation, the rules it applies to images)
and the frames are grouped into temporal patches of ``temporal_patch_size`` exactly as the video processor's
``patchify`` does (the last frame repeated to fill the last patch). Each video's ``<|video_pad|>`` is expanded to
``t * h * w / merge_size**2`` tokens and marked as video (2) in ``mm_token_type_ids``; Qwen2.5-VL also gets
``second_per_grid_ts`` (``temporal_patch_size / fps``, the temporal spacing of its RoPE positions).

Qwen3-VL's processor (also Qwen3.5's) writes a video differently: the chat template's
``<|vision_start|><|video_pad|><|vision_end|>`` becomes one ``<t seconds><|vision_start|><|video_pad|>*n<|vision_end|>``
group per temporal patch, ``t`` the mean time of the patch's first and last frame (frame ``i`` at ``i / fps``,
:func:`frame_group_times`), and its model's ``get_rope_index`` gives each group its own (1, h, w) grid with the
timestamp text between them: time is in the text, not in the positions. :meth:`VideoEncoder.expand` writes that text.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_vlm.images import DEFAULT_MAX_IMAGE_PIXELS, ImageFileError, confined, image_problem, open_image

#: the placeholder of the LLaMA-Factory / ms-swift format (``"videos": [...]`` lists the videos in order)
VIDEO_PLACEHOLDER = "<video>"
#: frames per second sampled from a video file (Qwen2-VL's default)
DEFAULT_VIDEO_FPS = 2.0
#: most frames kept per video (the Qwen2-VL video processor's ``max_frames``)
DEFAULT_VIDEO_MAX_FRAMES = 768
#: the files of a frame directory that are frames
FRAME_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
#: processor classes whose model takes video here -> their model types
VIDEO_PROCESSOR_CLASSES = {"Qwen2VLProcessor": "qwen2_vl", "Qwen2_5_VLProcessor": "qwen2_5_vl",
                           "Qwen3VLProcessor": "qwen3_vl / qwen3_vl_moe / qwen3_5"}
#: processor classes that write a video as one ``<t seconds><|vision_start|>...<|vision_end|>`` group per temporal
#: patch (Qwen3-VL's processor; its model's ``get_rope_index`` splits ``video_grid_thw`` the same way)
TIMESTAMPED_PROCESSOR_CLASSES = frozenset({"Qwen3VLProcessor"})

#: a video as a row names it (absolute paths): a file or directory path, or a list of frame paths
VideoSource = str | list[str]


@dataclass(frozen=True)
class VideoOptions:
    """``task_options.video_fps`` / ``video_max_frames`` / ``video_max_pixels`` (see the module doc)."""

    fps: float = DEFAULT_VIDEO_FPS
    max_frames: int = DEFAULT_VIDEO_MAX_FRAMES
    max_pixels: int | None = None


def video_options(options: Mapping[str, Any]) -> VideoOptions:
    """The video options of ``options`` (the task options) checked; a :class:`ConfigError` naming the bad one."""
    fps = options.get("video_fps", DEFAULT_VIDEO_FPS)
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0 or not math.isfinite(fps):
        raise ConfigError(f"task_options.video_fps must be a positive number (frames sampled per second), got {fps!r}")
    limits = {}
    for key, default in (("video_max_frames", DEFAULT_VIDEO_MAX_FRAMES), ("video_max_pixels", None)):
        value = options.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError(f"task_options.{key} must be a positive integer, got {value!r}")
        limits[key] = value
    return VideoOptions(float(fps), limits["video_max_frames"], limits["video_max_pixels"])


def describe(source: VideoSource) -> str:
    """How a message names ``source``."""
    if isinstance(source, list):
        return f"frames {source[0]} ... ({len(source)} files)" if source else "an empty frame list"
    return source


def frame_files(source: VideoSource) -> list[str] | None:
    """The frame paths of ``source`` in order (a list, or the frame files of a directory), or None for a file."""
    if isinstance(source, list):
        return list(source)
    if os.path.isdir(source):
        names = sorted(n for n in os.listdir(source) if n.lower().endswith(FRAME_EXTENSIONS))
        return [os.path.join(source, n) for n in names]
    return None


def sample_indices(total: int, wanted: int) -> list[int]:
    """``wanted`` of ``total`` frame indices spread uniformly from the first frame (transformers' rule:
    ``arange(0, total, total / wanted)``)."""
    wanted = max(1, min(wanted, total))
    return [int(i * total / wanted) for i in range(wanted)]


def _open_container(path: str) -> Any:
    try:
        import av
    except ImportError:
        raise ImageFileError(path, f"video {path} is a file and decoding video files needs PyAV (pip install av); "
                                   "or give the video as a directory of frame images") from None
    try:
        container = av.open(path)
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise ImageFileError(path, f"not a readable video {path}: {exc}") from None
    if not container.streams.video:
        container.close()
        raise ImageFileError(path, f"video {path} has no video stream")
    return container


def _check_file(path: str, root: Any, max_image_pixels: int) -> None:
    target = confined(path, root)
    if not os.path.isfile(target):
        raise ImageFileError(path, f"video file not found: {path}")
    with _open_container(target) as container:
        import av  # _open_container has imported it (or said how to install it)

        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > max_image_pixels:
            raise ImageFileError(path, f"video {path} is {width}x{height} ({width * height:,} pixels a frame), more "
                                       f"than max_image_pixels={max_image_pixels:,}: shrink the video, or raise "
                                       "task_options.max_image_pixels")
        try:
            first = next(container.decode(stream), None)
        except (av.error.FFmpegError, ValueError) as exc:
            raise ImageFileError(path, f"corrupt video {path}: {exc}") from None
        if first is None:
            raise ImageFileError(path, f"video {path} has no frames")


def video_problem(source: VideoSource, *, root: Any = None,
                  max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> str | None:
    """Why ``source`` cannot be used as a video (see the module doc), or None."""
    frames = frame_files(source)
    if frames is None:
        try:
            _check_file(source, root, max_image_pixels)
        except ImageFileError as exc:
            return exc.reason
        return None
    if not frames:
        kinds = ", ".join(FRAME_EXTENSIONS)
        return (f"video directory {source} holds no frame images ({kinds}); add the frames or fix the path"
                if not isinstance(source, list) else "a video's frame list is empty; list its frame images")
    sizes = set()
    for path in frames:
        problem = image_problem(path, root=root, max_image_pixels=max_image_pixels)
        if problem is not None:
            return f"video {describe(source)}: {problem}"
        from PIL import Image

        with Image.open(path) as image:
            sizes.add(image.size)
    if len(sizes) > 1:
        shown = ", ".join(f"{w}x{h}" for w, h in sorted(sizes))
        return f"video {describe(source)} has frames of different sizes ({shown}); all frames of a video share one size"
    return None


def load_frames(source: VideoSource, options: VideoOptions, *, root: Any = None,
                max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> tuple[list[Any], float]:
    """The sampled frames of ``source`` (RGB PIL images) and their rate in frames per second."""
    frames = frame_files(source)
    if frames is not None:
        if not frames:
            raise ImageFileError(describe(source), video_problem(source) or "no frames")
        kept = sample_indices(len(frames), options.max_frames)
        images = [open_image(frames[i], root=root, max_image_pixels=max_image_pixels) for i in kept]
        return images, options.fps * len(kept) / len(frames)
    _check_file(source, root, max_image_pixels)
    target = confined(source, root)
    with _open_container(target) as container:  # first pass: the frame count, from the packets (no decoding)
        stream = container.streams.video[0]
        total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        native = float(stream.average_rate) if stream.average_rate else options.fps
    duration = total / native
    kept = sample_indices(total, min(options.max_frames, max(1, round(duration * options.fps))))
    wanted = set(kept)
    frames: list[Any] = []
    with _open_container(target) as container:  # second pass: only the sampled frames become images
        for index, frame in enumerate(container.decode(container.streams.video[0])):
            if index in wanted:
                frames.append(frame.to_image().convert("RGB"))
            if len(frames) == len(kept):
                break
    if not frames:
        raise ImageFileError(source, f"video {source} has no frames")
    return frames, len(frames) / duration


def video_refusal(processor: Any) -> str | None:
    """Why the model of ``processor`` cannot take video here, or None."""
    name = type(processor).__name__
    if name in VIDEO_PROCESSOR_CLASSES:
        return None
    return (f"this row has a video, and the vlm task reads video for {', '.join(VIDEO_PROCESSOR_CLASSES.values())} "
            f"models only (this model's processor is {name}); remove the video or train one of those families")


def frame_group_times(num_frames: int, fps: float, temporal_patch_size: int) -> list[float]:
    """The time in seconds of each temporal patch of ``num_frames`` frames taken at ``fps`` (the mean of its first and
    last frame's time, the last frame repeated to a whole patch): Qwen3-VL's processor's rule for frames
    ``0 .. num_frames - 1`` at ``fps``."""
    times = [i / fps for i in range(num_frames)]
    times += [times[-1]] * (-num_frames % temporal_patch_size)
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def patchify_frames(frames: Any, patch_size: int, merge_size: int, temporal_patch_size: int) -> tuple[Any, list[int]]:
    """``frames`` ``[T, C, H, W]`` (normalised) -> ``([grid_t * grid_h * grid_w, C * temporal * patch**2], [t, h, w])``
    in the order of transformers' ``Qwen2VLVideoProcessor.patchify`` (the last frame repeated to a whole temporal
    patch)."""
    import torch

    if pad := -frames.shape[0] % temporal_patch_size:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)], dim=0)
    num_frames, channel, height, width = frames.shape
    grid_t, grid_h, grid_w = num_frames // temporal_patch_size, height // patch_size, width // patch_size
    patches = frames.reshape(grid_t, temporal_patch_size, channel, grid_h // merge_size, merge_size, patch_size,
                             grid_w // merge_size, merge_size, patch_size)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = patches.reshape(grid_t * grid_h * grid_w, channel * temporal_patch_size * patch_size * patch_size)
    return flat, [grid_t, grid_h, grid_w]


class VideoEncoder:
    """Frames -> the model's video tensors and the expanded ``<|video_pad|>`` text (see the module doc)."""

    def __init__(self, processor: Any, options: VideoOptions) -> None:
        self.processor, self.options = processor, options
        self.refusal = video_refusal(processor)
        #: what the chat template writes once per video part
        self.marker = getattr(processor, "video_token", None) or "<|video_pad|>"
        #: Qwen3-VL's layout: the template's ``<|vision_start|><|video_pad|><|vision_end|>`` becomes one
        #: ``<t seconds><|vision_start|><|video_pad|>*n<|vision_end|>`` group per temporal patch
        self.timestamped = type(processor).__name__ in TIMESTAMPED_PROCESSOR_CLASSES
        start = getattr(processor, "vision_start_token", None) or "<|vision_start|>"
        end = getattr(processor, "vision_end_token", None) or "<|vision_end|>"
        self.wrapper, self.group = start + self.marker + end, (start, end)

    def _frames_tensor(self, frames: Sequence[Any]) -> Any:
        """The frames resized, rescaled and normalised by the image processor's own methods, ``[T, C, H, W]``."""
        import numpy as np
        import torch
        from transformers.image_utils import SizeDict

        ip = self.processor.image_processor
        size = ip.size
        high = self.options.max_pixels or size.longest_edge
        budget = SizeDict(shortest_edge=min(size.shortest_edge, high), longest_edge=high)
        out = []
        for frame in frames:
            array = ip.process_image(frame, do_convert_rgb=True)
            array = ip.resize(array, size=budget, resample=ip.resample, factor=ip.patch_size * ip.merge_size)
            array = ip.normalize(ip.rescale(array, ip.rescale_factor), ip.image_mean, ip.image_std)
            out.append(np.asarray(array, dtype=np.float32))
        return torch.from_numpy(np.stack(out))

    def _tensors(self, clips: Sequence[tuple[list[Any], float]]) -> dict[str, Any]:
        import torch

        ip = self.processor.image_processor
        video_processor = getattr(self.processor, "video_processor", None)
        if video_processor is not None:  # torchvision installed: the model's own video processor
            out = video_processor(videos=[frames for frames, _ in clips], do_sample_frames=False, return_tensors="pt",
                                  **({"size": {"shortest_edge": video_processor.size.shortest_edge,
                                               "longest_edge": self.options.max_pixels}}
                                     if self.options.max_pixels else {}))
            values, grids = out["pixel_values_videos"], out["video_grid_thw"]
            temporal = video_processor.temporal_patch_size
        else:
            temporal = ip.temporal_patch_size
            pieces = [patchify_frames(self._frames_tensor(frames), ip.patch_size, ip.merge_size, temporal)
                      for frames, _ in clips]
            values = torch.cat([p for p, _ in pieces], dim=0)
            grids = torch.tensor([g for _, g in pieces], dtype=torch.long)
        tensors = {"pixel_values_videos": values, "video_grid_thw": grids}
        if "second_per_grid_ts" in getattr(self.processor, "model_input_names", ()):
            tensors["second_per_grid_ts"] = torch.tensor([temporal / fps for _, fps in clips], dtype=torch.float32)
        return tensors

    def runs(self, clips: Sequence[tuple[list[Any], float]]) -> tuple[list[int], dict[str, Any]]:
        """How many video tokens each of ``clips`` (``(frames, fps)`` in order) expands into, and their tensors."""
        tensors = self._tensors(clips)
        merge = self.processor.image_processor.merge_size ** 2
        return [int(grid.prod()) // merge for grid in tensors["video_grid_thw"]], tensors

    def _expansion(self, tokens: int, grid: Any, clip: tuple[list[Any], float]) -> str:
        """The text one video marker becomes (``tokens`` video tokens over ``grid``, of ``clip``'s frames)."""
        if not self.timestamped:
            return self.marker * tokens
        frames, fps = clip
        video_processor = getattr(self.processor, "video_processor", None)
        temporal = (video_processor or self.processor.image_processor).temporal_patch_size
        start, end = self.group
        per_group = tokens // int(grid[0])
        return "".join(f"<{t:.1f} seconds>{start}{self.marker * per_group}{end}"
                       for t in frame_group_times(len(frames), fps, temporal))

    def expand(self, text: str, clips: Sequence[tuple[list[Any], float]]
               ) -> tuple[list[str], list[int], dict[str, Any]]:
        """``text`` (one video marker per clip, in order) with every marker expanded as the processor expands it:
        the text segments between the runs of video tokens, the length of each run (one fewer than the segments)
        and the clips' tensors. The segments hold no video token, so they tokenise as the expanded whole does
        (special tokens split the text)."""
        import re

        counts, tensors = self.runs(clips)
        if self.timestamped:  # Qwen3-VL's processor drops the template's wrapper: each group has its own
            text = text.replace(self.wrapper, self.marker)
        pieces = text.split(self.marker)
        expanded = pieces[0] + "".join(self._expansion(n, grid, clip) + piece for n, grid, clip, piece
                                       in zip(counts, tensors["video_grid_thw"], clips, pieces[1:], strict=True))
        run = re.compile(f"(?:{re.escape(self.marker)})+")
        lengths = [len(m.group()) // len(self.marker) for m in run.finditer(expanded)]
        return run.split(expanded), lengths, tensors


__all__ = ["DEFAULT_VIDEO_FPS", "DEFAULT_VIDEO_MAX_FRAMES", "FRAME_EXTENSIONS", "VIDEO_PLACEHOLDER",
           "TIMESTAMPED_PROCESSOR_CLASSES", "VIDEO_PROCESSOR_CLASSES", "VideoEncoder", "VideoOptions", "VideoSource",
           "describe", "frame_files", "frame_group_times", "load_frames", "patchify_frames", "sample_indices",
           "video_options", "video_problem", "video_refusal"]
