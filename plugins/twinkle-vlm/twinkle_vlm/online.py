"""The ``vlm_grpo`` task: online RL (GRPO, DAPO, Dr. GRPO, GSPO, RLOO, REINFORCE++) on prompts that show pictures.

It is the ``grpo`` task (:class:`twinkle_rl.online_task.OnlineRLTask`: sampler, rewards, advantages, reference, one
step off, the policy losses) with the ``vlm`` task's data side: prompt rows whose messages show images or videos,
encoded through the model's processor exactly as ``vlm`` chats are, the per-part training plan (``train_vision`` /
``train_projector`` / ``train_language``) and Qwen-VL's 3-D RoPE positions. Each prompt carries its pictures, its
per-token values and its positions as :class:`~twinkle_core.prompt_inputs.PromptInputs`: the sampler's prefill
reads them, and every training row (prompt + completion) gets the same pictures and the positions its completion
was sampled at. Requires ``pip install twinkle-vlm[rl]``.

Rows: a ``vlm`` chat whose last turn is the user's (``messages`` / ``conversations`` or a ``prompt`` string, with
``images`` / ``videos`` as in ``vlm`` rows), every other column reaching the rewards; or a ``vlm`` SFT row whose last
assistant turn is the reference, which the rewards see as ``answer`` (so the ``vlm`` quickstart's files train as
they are)::

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                               {"type": "text", "text": "What colour is the shape?"}]}],
     "answer": "red"}

``task_options``: the ``grpo`` task's (but not ``environment``: multi-turn agent rollouts are text only) and the
``vlm`` task's processor, image, video and part options (:data:`~twinkle_vlm.preference.VLM_OPTIONS`). A prompt
longer than ``max_prompt_length`` is skipped (cutting it could cut a picture).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Iterable
from typing import Any

try:
    from twinkle_rl.online_task import OnlineRLTask
    from twinkle_rl.prompts import PromptFeature
except ModuleNotFoundError as exc:  # the optional dependency: name the extra that installs it
    raise ModuleNotFoundError(f"the vlm_grpo task builds on twinkle-rl's grpo task ({exc}); install it with: "
                              f"pip install 'twinkle-vlm[rl]'") from exc

from twinkle_core.data.formats import RowError
from twinkle_core.data.loading import load_records
from twinkle_core.errors import ConfigError, DataFormatError
from twinkle_core.prompt_inputs import PromptInputs
from twinkle_vlm.data import VLMDataError, VLMSample, parse_row
from twinkle_vlm.evaluate import question_and_answer
from twinkle_vlm.images import check_max_image_pixels, image_problem
from twinkle_vlm.packing import TOKEN_TYPES_KEY, find_rope_index, multimodal_position_ids
from twinkle_vlm.pair_encoding import prompt_chat
from twinkle_vlm.parts import TrainablePartsMixin
from twinkle_vlm.processor import image_size_refusal, load_processor
from twinkle_vlm.task import VLMEncoder, VLMTask
from twinkle_vlm.videos import video_options

logger = logging.getLogger(__name__)

#: the keys of a prompt row that make the chat; every other column is a field for the rewards
CHAT_KEYS = frozenset({"messages", "conversations", "prompt", "system", "tools", "images", "videos"})
#: what the rewards see the reference answer of an SFT-style row as
ANSWER_FIELD = "answer"
#: the answer appended to a prompt-only chat so that it encodes as a ``vlm`` sample (its span is cut off again)
_PLACEHOLDER = [{"role": "assistant", "content": "?"}]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")


def parse_prompt_row(row: Any, base_dir: str) -> tuple[VLMSample, dict[str, Any]]:
    """A row -> (the prompt chat followed by an answer turn, as a ``vlm`` sample; the reward fields)."""
    if not isinstance(row, dict):
        raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
    fields = {k: v for k, v in row.items() if k not in CHAT_KEYS}
    chat = {k: v for k, v in row.items() if k in CHAT_KEYS}
    key = "messages" if chat.get("messages") is not None else "conversations"
    messages = chat.get(key)
    last = messages[-1] if isinstance(messages, list) and messages else None
    if isinstance(last, dict) and last.get("role", last.get("from")) in ("assistant", "gpt"):
        fields.setdefault(ANSWER_FIELD, _text(last.get("content", last.get("value", ""))).strip())
        return parse_row(chat, base_dir), fields
    chat = prompt_chat(chat, answer_keys=())
    key = "messages" if chat.get("messages") is not None else "conversations"
    return parse_row({**chat, key: [*chat[key], *_PLACEHOLDER]}, base_dir), fields


def read_prompt_rows(path: str | os.PathLike[str] | Iterable[Any], *, image_root: Any = None,
                     max_image_pixels: int | None = None, size_refusal: Any = None,
                     ) -> list[tuple[int, VLMSample, dict[str, Any]]]:
    """``(line, sample, fields)`` of every row of a file (image paths relative to it) or a list of rows (relative to
    the working directory). Every row and picture is checked first; all problems are raised together."""
    if isinstance(path, (str, os.PathLike)):
        source = os.fspath(path)
        records, base_dir = load_records(source, validate=None), os.path.dirname(os.path.abspath(source))
    else:
        source, base_dir = "<rows>", os.getcwd()
        records = [(i + 1, row) for i, row in enumerate(path)]
    if not records:
        raise DataFormatError(source, None, "no rows were given")
    problems: list[tuple[str, int | None, str]] = []
    rows = []
    checked: dict[str, str | None] = {}
    for line, row in records:
        try:
            sample, fields = parse_prompt_row(row, base_dir)
        except RowError as exc:
            problems.append((source, line, str(exc)))
            continue
        for image in sample.images:
            if image not in checked:
                checked[image] = image_problem(image, root=image_root, max_image_pixels=max_image_pixels,
                                               size_refusal=size_refusal)
            if checked[image] is not None:
                problems.append((source, line, str(checked[image])))
        rows.append((line, dataclasses.replace(sample, source=source, line=line), fields))
    if problems:
        raise VLMDataError(problems)
    return rows


class VLMOnlineRLTask(TrainablePartsMixin, OnlineRLTask):
    name = "vlm_grpo"
    model_kind = "image_text_to_text"

    @classmethod
    def check_recipe(cls, recipe: Any) -> list[str]:
        return [*VLMTask.check_recipe(recipe), *super().check_recipe(recipe)]

    def __init__(self, *, environment: Any = None, processor: Any = None, image_processor: Any = None,
                 min_pixels: int | None = None, max_pixels: int | None = None, train_vision: str | None = None,
                 train_projector: str | None = None, train_language: str | None = None,
                 max_image_pixels: int | None = None, image_root: str | None = None, video_fps: float | None = None,
                 video_max_frames: int | None = None, video_max_pixels: int | None = None, **options: Any) -> None:
        if environment is not None:
            raise ConfigError("task_options.environment: multi-turn agent rollouts are text only; the vlm_grpo task "
                              "samples one completion per prompt (use task grpo for an agent)")
        if options.get("prompt_over_length", "skip") != "skip":
            raise ConfigError("task_options.prompt_over_length: the vlm_grpo task skips prompts longer than "
                              "max_prompt_length (cutting one could cut a picture); remove the option")
        given = dict(processor=processor, image_processor=image_processor, min_pixels=min_pixels,
                     max_pixels=max_pixels, train_vision=train_vision, train_projector=train_projector,
                     train_language=train_language, max_image_pixels=max_image_pixels, image_root=image_root,
                     video_fps=video_fps, video_max_frames=video_max_frames, video_max_pixels=video_max_pixels)
        vlm_options = {key: value for key, value in given.items() if value is not None}  # None: the vlm default
        super().__init__(**options)
        self.options.update(vlm_options)
        self.processor: Any = None
        self.rope_index: Any = None
        self.rope_checked = False

    def image_options(self) -> dict[str, Any]:
        return {"image_root": self.options.get("image_root"),
                "max_image_pixels": check_max_image_pixels(self.options.get("max_image_pixels"))}

    def check_data(self, path: Any, **data_options: Any) -> None:
        """Every row and picture of ``path``, checked as :meth:`load_dataset` checks them, before launching."""
        read_prompt_rows(path, **self.image_options())

    # ------------------------------------------------------------------ data
    def load_dataset(self, path: Any, tokenizer: Any, *, max_length: int | None = None, mode: str | None = None,
                     trust_remote_code: bool | None = None, **unused: Any) -> list[PromptFeature]:
        self.check_prompt_data(mode, unused)
        self.tokenizer = tokenizer
        if self.processor is None or self.processor.tokenizer is not tokenizer:
            self.processor = load_processor(tokenizer, self.options, trust_remote_code=trust_remote_code)
        refusal = functools.partial(image_size_refusal, self.processor.image_processor)
        rows = read_prompt_rows(path, size_refusal=refusal, **self.image_options())
        encoder = VLMEncoder(self.processor, video=video_options(self.options), **self.image_options())
        # a completion cannot show a picture: a sampled placeholder token would have no vision features to fill it
        suppressed = set(self.params.suppress_token_ids) | set(encoder.vision_ids)
        self.params = dataclasses.replace(self.params, suppress_token_ids=tuple(sorted(suppressed)))
        limit = self.prompt_length_limit(max_length)
        features: list[PromptFeature] = []
        for line, sample, fields in rows:
            try:
                feature = self._encode(encoder, sample, fields, index=len(features), line=line)
            except RowError as exc:
                raise DataFormatError(sample.source, line, str(exc)) from None
            if limit is None or len(feature.prompt_ids) <= limit:
                features.append(feature)
        skipped = len(rows) - len(features)
        if skipped:
            logger.warning("%d of %d prompts are longer than max_prompt_length=%s and were skipped (a cut could go "
                           "through a picture)", skipped, len(rows), limit)
        if not features:
            raise DataFormatError(rows[0][1].source, None, f"every prompt is longer than max_prompt_length={limit}")
        self.prompt_counts = {"prompts": len(features), "skipped_over_length": skipped, "truncated": 0}
        return features

    @staticmethod
    def _encode(encoder: VLMEncoder, sample: VLMSample, fields: dict[str, Any], *, index: int,
                line: int) -> PromptFeature:
        import torch

        encoded = encoder.encode(sample)
        pair = question_and_answer(encoded, encoder) if encoded is not None else None
        if pair is None:
            raise RowError("the prompt has no answer turn to continue")
        question, _ = pair
        values = {key: torch.tensor(v, dtype=torch.long) for key, v in question.token_values.items()}
        inputs = PromptInputs(token_values=values, tensors=dict(question.vision))
        text = encoder.render(sample.messages[:-1], generation_prompt=True)
        return PromptFeature(index=index, prompt_ids=list(question.input_ids), text=text, fields=fields, line=line,
                             inputs=inputs)

    # ------------------------------------------------------------------ model and prompts
    def prepare_model(self, model: Any) -> None:
        """The per-part plan (what trains) and Qwen-VL's RoPE, then the grpo task's set-up."""
        self.prepare_parts(model)
        self._rope(model)
        super().prepare_model(model)

    def _rope(self, model: Any) -> Any:
        if not self.rope_checked:
            self.rope_index = find_rope_index(model.network)
            self.rope_checked = True
        return self.rope_index

    def positioned(self, model: Any, features: list[PromptFeature]) -> list[PromptFeature]:
        """``features`` with their own 3-D RoPE positions (Qwen-VL; unchanged for 1-D families)."""
        import torch

        rope = self._rope(model)
        if rope is None:
            return features
        out = []
        for feature in features:
            inputs = feature.inputs
            if inputs is None or inputs.position_ids is not None:
                out.append(feature)
                continue
            ids = torch.tensor([feature.prompt_ids], dtype=torch.long)
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **inputs.tensors,
                     **{key: value[None] for key, value in inputs.token_values.items()}}
            if TOKEN_TYPES_KEY not in batch:
                batch[TOKEN_TYPES_KEY] = torch.zeros_like(ids)
            positions = multimodal_position_ids(rope, batch)[:, 0]
            out.append(dataclasses.replace(feature, inputs=dataclasses.replace(inputs, position_ids=positions)))
        return out

    def prepare_dataset(self, model: Any, dataset: Any, *, split: str, output_dir: str) -> Any:
        return super().prepare_dataset(model, self.positioned(model, list(dataset)), split=split,
                                       output_dir=output_dir)

    def next_training_batch(self, model: Any, draw: Any) -> dict[str, Any]:
        def positioned_draw() -> dict[str, Any]:
            batch = draw()
            return {**batch, "prompts": self.positioned(model, list(batch["prompts"]))}

        return super().next_training_batch(model, positioned_draw)

    def evaluate(self, model: Any, dataset: Any, tokenizer: Any, **options: Any) -> dict[str, float]:
        dataset = self.positioned(model, list(dataset)) if dataset is not None else None
        return super().evaluate(model, dataset, tokenizer, **options)

    def on_export(self, model: Any, directory: str, adapter_name: str | None) -> None:
        """Save the processor with the checkpoint, as the ``vlm`` task does."""
        if self.processor is None and getattr(model, "tokenizer", None) is not None:
            self.processor = load_processor(model.tokenizer, self.options)
        if self.processor is not None:
            self.processor.save_pretrained(directory)


__all__ = ["ANSWER_FIELD", "CHAT_KEYS", "VLMOnlineRLTask", "parse_prompt_row", "read_prompt_rows"]
