"""The ``vlm`` task: supervised fine-tuning of vision-language models on images and chats.

Rows (:mod:`twinkle_vlm.data`) are rendered with the processor's chat template (:mod:`twinkle_vlm.processor`)
and encoded piece by piece, as the core's :class:`~twinkle_core.data.template.Template` does for text: the
rendering is cut at the start and end of every assistant turn, each prompt piece goes through the processor with
the images it shows (which expands each image into its placeholder run), each assistant piece through the
tokenizer. Labels are the assistant pieces up to their end-of-turn token; prompt pieces, image placeholders and
every vision special token are -100 (vision tokens are masked by id as well, so a literal ``<|image_pad|>`` typed
into an answer is not trained either).

Data options (``data:`` / ``task_options``): ``max_length``, ``truncation`` (``"right"``, default, or
``"error"``), ``packing``, ``columns``, ``seed``. A sample longer than ``max_length`` is cut on the right when
the cut falls after its last image; when the cut would go through or before an image's placeholder run the
sample is dropped with a warning (a model cannot see part of an image). ``truncation: error`` refuses both.

Task options: ``processor``, ``image_processor``, ``min_pixels``, ``max_pixels`` (the processor),
``train_vision`` / ``train_projector`` / ``train_language`` (what trains, read by the model side),
``pad_to_multiple_of``, and for the image files (:mod:`twinkle_vlm.images`): ``max_image_pixels`` (images whose
header declares more pixels are refused before decoding; default PIL's own limit, 89,478,485) and ``image_root``
(every image must resolve inside this directory; default: none, any readable path). The data check before
training also refuses image sizes the model's image processor refuses (Qwen2-VL family: aspect ratio over 200),
from the headers alone, so a bad image is reported as ``file:line`` instead of failing inside the processor.
Videos (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5; :mod:`twinkle_vlm.videos`): ``video_fps`` (frames sampled per
second, default 2), ``video_max_frames`` (default 768) and ``video_max_pixels`` (per frame; default the image
``max_pixels``); each video part expands into its ``<|video_pad|>`` run (Qwen3-VL: one timestamped run per temporal
patch), masked like image tokens.
"""

from __future__ import annotations

import logging
from typing import Any

from twinkle_core.data.formats import IGNORE_INDEX, RowError
from twinkle_core.data.template import KNOWN_END_OF_TURN_TOKENS
from twinkle_core.errors import ConfigError, DataFormatError
from twinkle_core.task import Task
from twinkle_vlm.collate import VLMFeature, collate_vlm
from twinkle_vlm.data import VLMSample, load_samples
from twinkle_vlm.images import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageFileError,
    check_image_root,
    check_max_image_pixels,
    open_image,
)
from twinkle_vlm.packing import find_rope_index, multimodal_position_ids, pack_vlm_features
from twinkle_vlm.parts import TrainablePartsMixin
from twinkle_vlm.processor import load_processor
from twinkle_vlm.videos import VideoEncoder, VideoOptions, load_frames, video_options

logger = logging.getLogger(__name__)

#: processor attributes naming vision special tokens (placeholders and their delimiters)
_VISION_TOKEN_ATTRIBUTES = ("image_token", "video_token", "boi_token", "eoi_token", "start_image_token",
                            "end_image_token", "vision_start_token", "vision_end_token")
_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<img>", "</img>",
                  "<IMG_CONTEXT>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")
#: what the processor returns that is neither a per-token value nor a vision tensor
_TEXT_KEYS = ("input_ids", "attention_mask")
#: processor outputs with one value per token (modality of each token); everything else is per image
TOKEN_VALUE_KEYS = ("mm_token_type_ids", "token_type_ids")


def vision_token_ids(processor: Any) -> frozenset[int]:
    """Ids of every vision special token the processor's tokenizer has (never trained)."""
    tokenizer = processor.tokenizer
    vocab = tokenizer.get_vocab()
    names = {getattr(processor, a, None) for a in _VISION_TOKEN_ATTRIBUTES} | set(_VISION_TOKENS)
    return frozenset(int(vocab[n]) for n in names if isinstance(n, str) and n in vocab)


def image_marker(processor: Any) -> str:
    """The string the chat template writes once per image part (``<|image_pad|>``, ``<start_of_image>`` ...)."""
    probe = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    text = processor.apply_chat_template(probe, tokenize=False)
    for name in ("image_token", "boi_token", "start_image_token"):
        token = getattr(processor, name, None)
        if isinstance(token, str) and text.count(token) == 1:
            return token
    raise ConfigError(f"cannot tell how the chat template of {type(processor).__name__} marks an image (rendered "
                      f"{text!r}); its processor names none of image_token / boi_token once in it")


def refuse_unsupported_packing(features: list[VLMFeature]) -> None:
    """Gemma 3 marks image tokens with ``token_type_ids`` to let them attend to each other both ways; in
    transformers 5.24 packed rows with such image blocks do not reproduce the unpacked logits (its sliding-window
    layers' mask, measured: 0.4 relative difference), so packing them would train a different model."""
    if any("token_type_ids" in f.token_values and any(f.token_values["token_type_ids"]) for f in features):
        raise ConfigError("data.packing is not supported for models whose image tokens attend bidirectionally "
                          "(Gemma 3: token_type_ids): transformers builds a wrong attention mask for packed rows "
                          "with images; set data.packing: false")



def _collect(out: dict[str, Any], shows_media: bool, input_ids: list[int], token_values: dict[str, list[int]],
             vision: dict[str, list[Any]]) -> list[int]:
    """Append one piece's processor outputs to the row's: its ids (returned), its per-token values (text pieces
    that lack a key get 0 there) and, for a piece that shows images or videos, its vision tensors."""
    ids = [int(t) for t in out["input_ids"][0]]
    for key, value in out.items():
        if key in _TEXT_KEYS:
            continue
        if key in TOKEN_VALUE_KEYS:
            token_values.setdefault(key, [0] * len(input_ids)).extend(int(v) for v in value[0])
        elif shows_media:
            vision.setdefault(key, []).append(value)
    input_ids += ids
    for values in token_values.values():  # a key only some pieces return: text (0) elsewhere
        values.extend([0] * (len(input_ids) - len(values)))
    return ids

class VLMEncoder:
    """Rows -> :class:`VLMFeature` with one processor (see the module doc)."""

    def __init__(self, processor: Any, *, max_length: int | None = None, truncation: str = "right",
                 image_root: Any = None, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 video: VideoOptions | None = None) -> None:
        if truncation not in ("right", "error"):
            raise ConfigError(f"truncation for the vlm task must be 'right' or 'error', got {truncation!r} (cutting "
                              "the start would cut images and the prompt)")
        self.processor, self.max_length, self.truncation = processor, max_length, truncation
        #: every image is opened through :func:`~twinkle_vlm.images.open_image` with these (checked again at
        #: encoding: the files may have changed since the data check)
        self.image_root, self.max_image_pixels = check_image_root(image_root), check_max_image_pixels(max_image_pixels)
        tokenizer = processor.tokenizer
        vocab = tokenizer.get_vocab()
        eos = getattr(tokenizer, "eos_token_id", None)
        self.end_of_turn_ids = frozenset({int(vocab[t]) for t in KNOWN_END_OF_TURN_TOKENS if t in vocab}
                                         | ({int(eos)} if eos is not None else set()))
        self.vision_ids = vision_token_ids(processor)
        self.marker = image_marker(processor)
        #: videos (twinkle_vlm.videos): frames -> tensors and the expanded video placeholder run
        self.video = VideoEncoder(processor, video or VideoOptions())
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else eos)

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        try:
            return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as exc:  # jinja2 errors and raise_exception() inside templates
            raise RowError(f"the chat template cannot render this conversation: {type(exc).__name__}: {exc}") from None

    def assistant_spans(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendering and the character span of every assistant turn (the template must be prefix-stable)."""
        full = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], generation_prompt=True)
            turn = self.render(messages[: i + 1])
            if not (full.startswith(prompt) and turn.startswith(prompt) and full.startswith(turn)):
                raise RowError(f"the chat template is not prefix-stable at assistant message {i}: it rewrites "
                               "earlier turns, so the trained tokens cannot be located")
            spans.append((len(prompt), len(turn)))
        return full, spans

    def open_images(self, paths: list[str]) -> list[Any]:
        """The images at ``paths`` decoded (a :class:`RowError` naming the file when one cannot be used)."""
        try:
            return [open_image(p, root=self.image_root, max_image_pixels=self.max_image_pixels) for p in paths]
        except ImageFileError as exc:
            raise RowError(exc.reason) from None

    def open_videos(self, sources: list[Any]) -> list[tuple[list[Any], float]]:
        """The sampled frames and their rate of each video (a :class:`RowError` naming the file when one cannot
        be used, or when the model takes no video)."""
        if sources and self.video.refusal is not None:
            raise RowError(self.video.refusal)
        try:
            return [load_frames(s, self.video.options, root=self.image_root, max_image_pixels=self.max_image_pixels)
                    for s in sources]
        except ImageFileError as exc:
            raise RowError(exc.reason) from None

    def _process(self, text: str, images: list[Any], paths: list[str]) -> dict[str, Any]:
        if not images:  # text alone is only tokenised: the tokenizer directly is several times faster
            import torch

            return {"input_ids": torch.tensor([self.processor.tokenizer(text, add_special_tokens=False)["input_ids"]])}
        try:
            return dict(self.processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False))
        except ValueError as exc:  # what transformers processors raise for inputs they refuse
            raise RowError(f"the processor refused this row's text or its image(s) {', '.join(paths)}: {exc}") from None

    def encode(self, sample: VLMSample) -> VLMFeature | None:
        """The feature of ``sample``, or None when ``max_length`` would cut an image (see the module doc)."""
        import torch

        full, spans = self.assistant_spans(sample.messages)
        bounds = [0, *(edge for span in spans for edge in span), len(full)]
        pending = list(sample.images)
        pending_videos = list(sample.videos)
        input_ids: list[int] = []
        labels: list[int] = []
        token_values: dict[str, list[int]] = {}
        vision: dict[str, list[Any]] = {}
        for k, (start, end) in enumerate(zip(bounds, bounds[1:])):
            piece = full[start:end]
            if not piece:
                continue
            out, shows_media, pending, pending_videos = self._piece_outputs(piece, pending, pending_videos)
            ids = _collect(out, shows_media, input_ids, token_values, vision)
            labels += self._labels(ids) if k % 2 == 1 and k < 2 * len(spans) else [IGNORE_INDEX] * len(ids)
        if pending:
            raise RowError(f"{len(pending)} image(s) were not rendered by the chat template")
        if pending_videos:
            raise RowError(f"{len(pending_videos)} video(s) were not rendered by the chat template"
                           + (f": {self.video.refusal}" if self.video.refusal else ""))
        labels = [IGNORE_INDEX if t in self.vision_ids else label for t, label in zip(input_ids, labels, strict=True)]
        stacked = {key: torch.cat(parts, dim=0) for key, parts in vision.items()}
        return self._truncate(VLMFeature(input_ids, labels, token_values, stacked, len(sample.images)), sample)

    def _piece_outputs(self, piece: str, pending: list[str], pending_videos: list[Any]
                       ) -> tuple[dict[str, Any], bool, list[str], list[Any]]:
        """The processor's outputs for one piece of the rendered chat, whether it shows images or videos, and the
        images and videos left for the later pieces."""
        count = piece.count(self.marker)
        if count > len(pending):
            raise RowError(f"the text holds {self.marker!r}, the image marker of this model, where the row has no "
                           "image: remove it from the text (images are image parts or <image> placeholders)")
        paths, pending = pending[:count], pending[count:]
        images = self.open_images(paths)
        clips, pending_videos = self._split_videos(piece, pending_videos)
        if clips:
            out = self._process_with_videos(piece, images, paths, self.open_videos(clips))
        else:
            out = self._process(piece, images, paths)
        return out, bool(images or clips), pending, pending_videos

    def _process_with_videos(self, text: str, images: list[Any], paths: list[str],
                             clips: list[tuple[list[Any], float]]) -> dict[str, Any]:
        """:meth:`_process` for a piece that shows videos: the processor refuses video tokens without its video
        processor, so the text between the video markers goes through it (with its images) and each marker
        becomes its clip's run of video tokens (special tokens split the text the same way: same ids)."""
        import torch

        segments, counts, video_tensors = self.video.expand(text, clips)  # Qwen3-VL: per-frame-group timestamps
        video_id = self.processor.tokenizer.convert_tokens_to_ids(self.video.marker)
        ids: list[int] = []
        image_outputs: dict[str, list[Any]] = {}
        used = 0
        for k, segment in enumerate(segments):
            count = segment.count(self.marker)
            out = self._process(segment, images[used:used + count], paths[used:used + count])
            used += count
            ids += [int(t) for t in out["input_ids"][0]]
            for key, value in out.items():
                if key not in _TEXT_KEYS and key not in TOKEN_VALUE_KEYS:
                    image_outputs.setdefault(key, []).append(value)
            if k < len(counts):
                ids += [video_id] * counts[k]
        return {"input_ids": torch.tensor([ids]),
                "mm_token_type_ids": torch.tensor(self.processor.create_mm_token_type_ids([ids])),  # video: 2
                **{key: torch.cat(values, dim=0) for key, values in image_outputs.items()}, **video_tensors}

    def _split_videos(self, piece: str, pending: list[Any]) -> tuple[list[Any], list[Any]]:
        """The videos ``piece`` shows (one video marker each) and those left for later pieces."""
        count = piece.count(self.video.marker) if pending or self.video.refusal is None else 0
        if count > len(pending):
            raise RowError(f"the text holds {self.video.marker!r}, the video marker of this model, where the row has "
                           "no video: remove it from the text (videos are video parts or <video> placeholders)")
        return pending[:count], pending[count:]

    def _labels(self, ids: list[int]) -> list[int]:
        """An assistant piece is trained up to its last end-of-turn token (ChatML's trailing newline is not)."""
        cut = next((j + 1 for j in range(len(ids) - 1, -1, -1) if ids[j] in self.end_of_turn_ids), len(ids))
        return ids[:cut] + [IGNORE_INDEX] * (len(ids) - cut)

    def _truncate(self, feature: VLMFeature, sample: VLMSample) -> VLMFeature | None:
        if feature.labels:
            feature.labels[0] = IGNORE_INDEX
        n, limit = len(feature.input_ids), self.max_length
        if limit is None or n <= limit:
            return feature
        if self.truncation == "error":
            raise RowError(f"sample has {n} tokens, more than max_length={limit} (raise data.max_length)")
        marks = [i for i, t in enumerate(feature.input_ids) if t in self.vision_ids]
        for values in feature.token_values.values():
            marks += [i for i, v in enumerate(values) if v]
        if marks and max(marks) >= limit:
            logger.warning("%s:%s: dropped: max_length=%d would cut through an image (the sample has %d tokens)",
                           sample.source, sample.line, limit, n)
            return None
        return VLMFeature(feature.input_ids[:limit], feature.labels[:limit],
                          {k: v[:limit] for k, v in feature.token_values.items()}, feature.vision, feature.num_images)


class VLMTask(TrainablePartsMixin, Task):
    """The ``vlm`` task. What trains per part and the vision inputs the forward takes come from
    :class:`~twinkle_vlm.parts.TrainablePartsMixin` (the model side)."""

    name = "vlm"
    default_loss = "cross_entropy"
    model_kind = "image_text_to_text"
    reads_logits = False  # process_outputs passes them through

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.processor: Any = None
        #: whether the processor may run its repository's code (None: TWINKLE_TRUST_REMOTE_CODE decides)
        self.trust_remote_code: bool | None = None
        self.encoder: VLMEncoder | None = None
        self._rope_index: Any = None
        self._rope_checked = False

    def _option(self, value: Any, key: str, default: Any) -> Any:
        return value if value is not None else self.options.get(key, default)

    @classmethod
    def check_recipe(cls, recipe: Any) -> list[str]:
        """``task_options.max_image_pixels`` and ``image_root`` (their types; the directory's existence is checked
        where the data is read)."""
        problems = []
        try:
            check_max_image_pixels(recipe.task_options.get("max_image_pixels"))
        except ConfigError as exc:
            problems.append(f"task_options.max_image_pixels: {exc}")
        try:
            video_options(recipe.task_options)
        except ConfigError as exc:
            problems.append(str(exc))
        root = recipe.task_options.get("image_root")
        if root is not None and (not isinstance(root, str) or not root):
            problems.append(f"task_options.image_root: must be a directory path, got {root!r}")
        return problems

    def check_data(self, path: Any, *, columns: dict[str, str] | None = None, seed: int | None = None,
                   **data_options: Any) -> None:
        """Every row and image of ``path``, checked as :meth:`load_dataset` checks them (:func:`load_samples`), less
        the sizes the processor takes (``twinkle train`` and ``--dry-run`` call it before launching)."""
        load_samples(path, columns=self._option(columns, "columns", None), seed=int(seed or 0),
                     **self.image_options())

    def image_options(self) -> dict[str, Any]:
        """``image_root`` and ``max_image_pixels`` from the task options (see :mod:`twinkle_vlm.images`)."""
        return {"image_root": self.options.get("image_root"),
                "max_image_pixels": check_max_image_pixels(self.options.get("max_image_pixels"))}

    def processor_for(self, tokenizer: Any, trust_remote_code: bool | None = None) -> Any:
        """The processor (loaded once per tokenizer, see :func:`~twinkle_vlm.processor.load_processor`);
        ``trust_remote_code``: the recipe's ``model.trust_remote_code`` (``None``: the environment's switch)."""
        if trust_remote_code is not None:
            self.trust_remote_code = trust_remote_code
        if self.processor is None or self.processor.tokenizer is not tokenizer:
            self.processor = load_processor(tokenizer, self.options,
                                            trust_remote_code=self.trust_remote_code)
        return self.processor

    def load_dataset(self, path: Any, tokenizer: Any, *, max_length: int | None = None, packing: bool | None = None,
                     truncation: str | None = None, columns: dict[str, str] | None = None,
                     seed: int | None = None, trust_remote_code: bool | None = None) -> list[VLMFeature]:
        """Validate every row and image of ``path`` (a data spec or a list of rows), then encode them.
        ``trust_remote_code`` (the trainer passes the recipe's resolved switch) decides whether the processor
        may run its repository's code."""
        max_length = self._option(max_length, "max_length", None)
        packing = bool(self._option(packing, "packing", False))
        if packing and max_length is None:
            raise ConfigError("packing needs max_length (the length of a packed row)")
        processor = self.processor_for(tokenizer, trust_remote_code)  # the data check asks it which sizes it takes
        samples = load_samples(path, columns=self._option(columns, "columns", None), seed=int(seed or 0),
                               image_processor=processor.image_processor, **self.image_options())
        self.encoder = VLMEncoder(processor, max_length=max_length,
                                  truncation=self._option(truncation, "truncation", "right"),
                                  video=video_options(self.options), **self.image_options())
        features = []
        for sample in samples:
            try:
                feature = self.encoder.encode(sample)
            except RowError as exc:
                raise DataFormatError(sample.source, sample.line, str(exc)) from None
            if feature is not None:
                features.append(feature)
        if samples and not any(f.num_trained_tokens for f in features):
            raise DataFormatError(samples[0].source, None, f"no sample has a trained token left (max_length="
                                  f"{max_length} drops or truncates them all); raise data.max_length")
        if len(features) < len(samples):
            logger.warning("%d of %d samples dropped because max_length=%s would cut an image",
                           len(samples) - len(features), len(samples), max_length)
        if packing:
            refuse_unsupported_packing(features)
            return pack_vlm_features(features, int(max_length))
        return features

    def collate(self, features: list[Any]) -> dict[str, Any]:
        if self.encoder is None:
            raise RuntimeError("VLMTask.collate needs the processor: call load_dataset first")
        return collate_vlm(features, self.encoder.pad_token_id,
                           pad_to_multiple_of=self.options.get("pad_to_multiple_of"))

    def prepare_model(self, model: Any) -> None:
        self.prepare_parts(model)  # train_vision / train_projector / train_language (twinkle_vlm.parts)
        self._rope_index = find_rope_index(model.network)
        self._rope_checked = True

    def prepare_batch(self, model: Any, batch: dict[str, Any]) -> dict[str, Any]:
        """Qwen-VL models: add the 3-D RoPE positions their own ``get_rope_index`` computes (see
        :mod:`twinkle_vlm.packing`), so packed rows restart per sample and padded rows skip their padding."""
        if not self._rope_checked:  # a script that skipped prepare_model: find the RoPE only, change no weights
            self._rope_index = find_rope_index(model.network)
            self._rope_checked = True
        if self._rope_index is None:
            return batch
        return {**batch, "position_ids": multimodal_position_ids(self._rope_index, batch)}

    def evaluate(self, model: Any, dataset: Any, tokenizer: Any, *, max_new_tokens: int = 16,
                 limit: int | None = None, batch_size: int = 8) -> dict[str, float]:
        """Held-out answer accuracy by greedy generation (:func:`twinkle_vlm.evaluate.answer_accuracy`).
        ``dataset``: features from :meth:`load_dataset` (packed or not), a data spec, or a list of rows."""
        from twinkle_vlm.evaluate import answer_accuracy

        is_features = isinstance(dataset, (list, tuple)) and all(isinstance(f, VLMFeature) for f in dataset)
        if not is_features:
            dataset = self.load_dataset(dataset, tokenizer, packing=False)
        if self.encoder is None:
            self.encoder = VLMEncoder(self.processor_for(tokenizer), video=video_options(self.options),
                                      **self.image_options())
        return answer_accuracy(model, dataset, self.encoder, max_new_tokens=max_new_tokens, limit=limit,
                               batch_size=batch_size)

    def on_export(self, model: Any, directory: str, adapter_name: str | None) -> None:
        """Save the processor (tokenizer, image processor, chat template) so ``AutoProcessor`` loads the
        checkpoint on its own."""
        if self.processor is None and getattr(model, "tokenizer", None) is not None:  # saved before any data
            self.processor_for(model.tokenizer)
        if self.processor is not None:
            self.processor.save_pretrained(directory)


__all__ = ["VLMEncoder", "VLMTask", "image_marker", "vision_token_ids"]
