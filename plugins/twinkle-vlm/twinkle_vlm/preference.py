"""The ``vlm_preference`` task: DPO-family preference training of vision-language models on image chats.

It is the ``preference`` task (:class:`twinkle_rl.task.PreferenceTask`: the batch layout of
:mod:`twinkle_rl.layout`, the reference providers of :mod:`twinkle_rl.reference`, the DPO / SimPO / ORPO ... losses,
which read only logits and labels) with the ``vlm`` task's data side: rows whose prompts show images
(:mod:`twinkle_vlm.pair_encoding`), encoded through the model's processor like ``vlm`` chats, the per-part training
plan (``train_vision`` / ``train_projector`` / ``train_language``, :mod:`twinkle_vlm.parts`) and Qwen-VL's 3-D RoPE
positions (:mod:`twinkle_vlm.packing`), which the reference forward sees too. Requires ``pip install
twinkle-vlm[rl]``.

Recipe: ``task: vlm_preference`` (``loss: dpo`` by default), rows like::

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                               {"type": "text", "text": "What colour is the shape?"}]}],
     "chosen": "red", "rejected": "blue"}

``task_options``: the preference task's (``reference``, ``over_length``, ``max_length``, ``pad_to_multiple_of``,
``adapter_name``) and the ``vlm`` task's processor, image and part options (:data:`VLM_OPTIONS`). ``packing`` is
refused: the sequences of a pair are padded rows (each with its own copy of the prompt's image tensors).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

try:
    from twinkle_rl.reference import reference_logps
    from twinkle_rl.task import PreferenceTask
except ModuleNotFoundError as exc:  # the optional dependency: name the extra that installs it
    raise ModuleNotFoundError(f"the vlm_preference task builds on twinkle-rl's preference task ({exc}); install it "
                              f"with: pip install 'twinkle-vlm[rl]'") from exc

from twinkle_core.data.formats import RowError
from twinkle_core.errors import ConfigError, DataFormatError
from twinkle_vlm.images import check_max_image_pixels
from twinkle_vlm.packing import find_rope_index, multimodal_position_ids
from twinkle_vlm.pair_encoding import PairEncoder, VLMPairFeature, collate_vlm_pairs, read_pairs
from twinkle_vlm.parts import TrainablePartsMixin
from twinkle_vlm.processor import image_size_refusal, load_processor
from twinkle_vlm.task import VLMEncoder, VLMTask
from twinkle_vlm.videos import video_options

logger = logging.getLogger(__name__)

#: the ``vlm`` task's options this task takes besides the preference task's own
VLM_OPTIONS = frozenset({"processor", "image_processor", "min_pixels", "max_pixels", "train_vision", "train_projector",
                         "train_language", "max_image_pixels", "image_root", "video_fps", "video_max_frames",
                         "video_max_pixels"})
PACKING_REFUSAL = ("data.packing is not supported by the vlm_preference task (each sequence of a pair is a padded "
                   "row with its own copy of the prompt's images); set data.packing: false")


class VLMPreferenceTask(TrainablePartsMixin, PreferenceTask):
    name = "vlm_preference"
    model_kind = "image_text_to_text"

    def __init__(self, *, reference: str = "auto", over_length: str = "truncate", max_length: int | None = None,
                 packing: bool = False, pad_to_multiple_of: int | None = None, adapter_name: str | None = None,
                 **vlm_options: Any) -> None:
        unknown = sorted(set(vlm_options) - VLM_OPTIONS)
        if unknown:
            raise ConfigError(f"task_options {', '.join(unknown)}: not an option of the vlm_preference task; it takes "
                              f"reference, over_length, max_length, pad_to_multiple_of, adapter_name and "
                              f"{', '.join(sorted(VLM_OPTIONS))}")
        if packing:
            raise ConfigError(PACKING_REFUSAL)
        super().__init__(reference=reference, over_length=over_length, max_length=max_length, packing=False,
                         pad_to_multiple_of=pad_to_multiple_of, adapter_name=adapter_name)
        self.options.update(vlm_options)
        self.processor: Any = None
        self.pair_encoder: PairEncoder | None = None
        self.rope_index: Any = None
        self.rope_checked = False

    @classmethod
    def check_recipe(cls, recipe: Any) -> list[str]:
        problems = VLMTask.check_recipe(recipe)
        if recipe.task_options.get("packing") or getattr(recipe.data, "packing", False):
            problems.append(PACKING_REFUSAL)
        return problems

    def image_options(self) -> dict[str, Any]:
        return {"image_root": self.options.get("image_root"),
                "max_image_pixels": check_max_image_pixels(self.options.get("max_image_pixels"))}

    def check_data(self, path: Any, **data_options: Any) -> None:
        """Every row and image of ``path``, checked as :meth:`load_dataset` checks them, before launching."""
        read_pairs(path, **self.image_options())

    # ------------------------------------------------------------------ data
    def load_dataset(self, path: Any, tokenizer: Any, *, max_length: int | None = None, mode: str | None = None,
                     packing: bool | None = None, over_length: str | None = None,
                     trust_remote_code: bool | None = None) -> list[VLMPairFeature]:
        """Read image preference rows (a .jsonl/.json/.parquet/.csv file, or a list of dicts) into encoded pairs."""
        if mode not in (None, "chat"):
            raise ConfigError(f"data.mode: the vlm_preference task reads chat pairs (mode: chat), got {mode!r}")
        if packing:
            raise ConfigError(PACKING_REFUSAL)
        max_length = max_length if max_length is not None else self.options["max_length"]
        over_length = over_length if over_length is not None else self.options["over_length"]
        if self.processor is None or self.processor.tokenizer is not tokenizer:
            self.processor = load_processor(tokenizer, self.options, trust_remote_code=trust_remote_code)
        refusal = functools.partial(image_size_refusal, self.processor.image_processor)
        pairs, identical = read_pairs(path, size_refusal=refusal, **self.image_options())
        video = video_options(self.options)
        encoder = VLMEncoder(self.processor, video=video, **self.image_options())
        cutter = (None if max_length is None else
                  VLMEncoder(self.processor, max_length=int(max_length), video=video, **self.image_options()))
        self.pair_encoder = PairEncoder(encoder, cutter, over_length)
        self.pad_token_id = encoder.pad_token_id
        features, stats = [], {"truncated": 0, "skipped_over_length": 0, "skipped_identical": identical}
        for pair in pairs:
            try:
                feature, outcome = self.pair_encoder.encode(pair)
            except RowError as exc:
                raise DataFormatError(pair.chosen.source, pair.line, str(exc)) from None
            if outcome in stats:
                stats[outcome] += 1
            if feature is not None:
                features.append(feature)
        self.stats = {"pairs": len(features), **stats}
        if stats["truncated"] or stats["skipped_over_length"]:
            logger.warning("%d pairs longer than max_length=%s: %d truncated on the right, %d skipped (over_length="
                           "%s, or the cut would go through an image)", stats["truncated"] + stats["skipped_over_length"],
                           max_length, stats["truncated"], stats["skipped_over_length"], over_length)
        if not features:
            raise DataFormatError(pairs[0].chosen.source, None, f"no usable pair after max_length={max_length} (too "
                                  f"long, cut through an image, or the answers became the same); raise data.max_length")
        return features

    def collate(self, features: list[Any]) -> dict[str, Any]:
        if self.pad_token_id is None:
            raise RuntimeError("VLMPreferenceTask.collate needs the pad token id: call load_dataset first")
        return collate_vlm_pairs(features, self.pad_token_id, pad_to_multiple_of=self.options["pad_to_multiple_of"])

    # ------------------------------------------------------------------ model and batches
    def prepare_model(self, model: Any) -> None:
        """The per-part plan (what trains), Qwen-VL's RoPE, then the preference task's reference."""
        self.prepare_parts(model)
        self.rope_index = find_rope_index(model.network)
        self.rope_checked = True
        super().prepare_model(model)

    def prepare_batch(self, model: Any, batch: dict[str, Any]) -> dict[str, Any]:
        """Qwen-VL's 3-D RoPE positions (so the reference forward sees them too), then ``ref_logps``."""
        if not self.rope_checked:
            self.rope_index = find_rope_index(model.network)
            self.rope_checked = True
        if self.rope_index is not None and "position_ids" not in batch:
            batch = {**batch, "position_ids": multimodal_position_ids(self.rope_index, batch)}
        return super().prepare_batch(model, batch)

    def evaluate(self, model: Any, dataset: Any, tokenizer: Any, *, batch_size: int = 8,
                 limit: int | None = None, **_: Any) -> dict[str, float]:
        """How often the policy ranks the chosen answer above the rejected one on held-out pairs:
        ``preference_accuracy`` (summed answer log-probabilities) and, with a reference, ``reward_accuracy``
        (the DPO implicit reward ``log pi - log ref``; ``rewards/accuracies`` of the loss), and ``num_examples``.
        Ties (an untrained model scoring both alike) count as wrong."""
        if dataset is None:
            raise ConfigError("train.evaluate_options: the vlm_preference task evaluates on data.eval; set it")
        pairs = list(dataset)[: None if limit is None else int(limit)]
        preferred = rewarded = 0
        with_reference = True
        for begin in range(0, len(pairs), batch_size):
            batch = self.prepare_batch(model, self.collate(pairs[begin:begin + batch_size]))
            with torch.no_grad():
                outputs = model.forward_only(inputs=batch)
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
            logps = reference_logps(logits, batch).reshape(-1, 2)
            preferred += int((logps[:, 0] > logps[:, 1]).sum())
            if batch.get("ref_logps") is None:
                with_reference = False
                continue
            rewards = logps - torch.as_tensor(batch["ref_logps"]).float().reshape(-1, 2)
            rewarded += int((rewards[:, 0] > rewards[:, 1]).sum())
        count = max(len(pairs), 1)
        result = {"preference_accuracy": preferred / count, "num_examples": len(pairs)}
        if with_reference:
            result["reward_accuracy"] = rewarded / count
        return result

    def on_export(self, model: Any, directory: str, adapter_name: str | None) -> None:
        """Save the processor with the checkpoint, as the ``vlm`` task does."""
        if self.processor is None and getattr(model, "tokenizer", None) is not None:
            self.processor = load_processor(model.tokenizer, self.options)
        if self.processor is not None:
            self.processor.save_pretrained(directory)


__all__ = ["PACKING_REFUSAL", "VLM_OPTIONS", "VLMPreferenceTask"]
