"""Video rows on Qwen3-VL and Qwen3.5: the token text is the one transformers' Qwen3-VL processor writes (one
``<t seconds><|vision_start|><|video_pad|>*n<|vision_end|>`` group per temporal patch, the template's wrapper
dropped), the loss equals a plain transformers forward over that text and the frames' pixels, packed rows keep
each video's 3-D positions, and truncation never cuts a clip.

transformers' video processor needs torchvision, which this project's CPU machines lack: the reference pixels come
from the image processor on the frames (as in test_video.py: frames [A, A, B, B] are the static temporal patches A
and B), the reference text from the processor's own ``replace_video_token`` / ``get_text_with_replacements`` given
the frames' grid and metadata."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from transformers.video_utils import VideoMetadata
from twinkle_vlm.data import load_samples
from twinkle_vlm.task import VLMEncoder
from twinkle_vlm.testing import build_vlm_model, tiny_processor
from twinkle_vlm.videos import frame_group_times

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.testing.tolerance import forward_tolerance

FULL = {"train_vision": "full", "train_projector": "full", "train_language": "full"}
#: hidden size and layers of the tiny models (twinkle_vlm.testing_families): 2 vision + 2 text blocks
WIDTH, DEPTH = 64, 4
RED, BLUE = (200, 30, 30), (30, 30, 200)


def _frames(directory, colours, size=(64, 64)) -> str:
    os.makedirs(directory, exist_ok=True)
    for i, rgb in enumerate(colours):
        Image.new("RGB", size, rgb).save(os.path.join(directory, f"frame_{i:03d}.png"))
    return str(directory)


def _video_row(video, answer="blue") -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "video", "video": video},
                                                      {"type": "text", "text": "What happens?"}]},
                         {"role": "assistant", "content": answer}]}


@pytest.fixture
def clip(tmp_path) -> str:
    """Four 64 px frames (4 x 4 patches of 16), the first two and the last two equal."""
    return _frames(tmp_path / "clip", [RED, RED, BLUE, BLUE])


def _reference_prompt(processor, grid, frames: int, fps: float) -> str:
    """The prompt transformers' Qwen3-VL processor writes for one video of ``frames`` frames at ``fps`` over ``grid``
    (its video processor stood in by the two sizes the text needs)."""
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    processor.video_processor = SimpleNamespace(merge_size=2, temporal_patch_size=2)
    metadata = VideoMetadata(total_num_frames=frames, fps=fps, frames_indices=list(range(frames)))
    replacement = processor.replace_video_token({"video_grid_thw": grid, "video_metadata": [metadata]}, 0)
    [expanded], _ = processor.get_text_with_replacements([text], videos_replacements=[replacement])
    return expanded


def test_frame_group_times_follow_the_processor():
    processor = tiny_processor("qwen3_vl")
    for frames, fps in ((4, 2.0), (5, 1.0), (1, 3.0)):
        expected = processor._calculate_timestamps(list(range(frames)), fps, 2)
        assert frame_group_times(frames, fps, 2) == pytest.approx(expected)


@pytest.mark.parametrize("model_type", ["qwen3_vl", "qwen3_5"])
def test_video_text_and_loss_equal_the_processor_and_a_plain_forward(model_type, tiny_vlm_dir, clip):
    model, task = build_vlm_model(tiny_vlm_dir(model_type), task_options={**FULL, "video_fps": 1})
    batch = task.prepare_batch(model, task.collate(task.load_dataset([_video_row(clip)], model.tokenizer)))

    processor = tiny_processor(model_type)
    tokenizer = processor.tokenizer
    pixels = processor.image_processor(images=[Image.open(os.path.join(clip, n)).convert("RGB")
                                               for n in ("frame_000.png", "frame_002.png")], return_tensors="pt")
    grid = torch.tensor([[2, *pixels["image_grid_thw"][0, 1:].tolist()]])
    assert grid.tolist() == [[2, 4, 4]]
    prompt = _reference_prompt(processor, grid, frames=4, fps=1.0)
    assert prompt.count("<0.5 seconds><|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>") == 1
    assert "<2.5 seconds><|vision_start|>" in prompt and prompt.count("<|vision_start|>") == 2
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer("blue<|im_end|>", add_special_tokens=False)["input_ids"]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    input_ids = torch.tensor([prompt_ids + answer_ids + newline])
    labels = torch.tensor([[IGNORE_INDEX] * len(prompt_ids) + answer_ids + [IGNORE_INDEX] * len(newline)])
    assert batch["input_ids"].tolist() == input_ids.tolist() and batch["labels"].tolist() == labels.tolist()
    assert batch["video_grid_thw"].tolist() == grid.tolist() and "second_per_grid_ts" not in batch
    assert torch.equal(batch["pixel_values_videos"], pixels["pixel_values"])

    video_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    token_types = (input_ids == video_id).long() * 2
    assert batch["mm_token_type_ids"].tolist() == token_types.tolist()
    positions, _ = model.network.model.get_rope_index(input_ids, token_types, video_grid_thw=grid)
    assert torch.equal(batch["position_ids"], positions)
    with torch.no_grad():
        expected = model.network(input_ids=input_ids, labels=labels, pixel_values_videos=pixels["pixel_values"],
                                 video_grid_thw=grid, mm_token_type_ids=token_types).loss
    loss = float(model.forward_backward(inputs=batch)["loss"])
    assert abs(loss - float(expected)) <= forward_tolerance(float(expected), width=WIDTH, depth=DEPTH)
    vision_grads = [p.grad for n, p in model.network.named_parameters() if n.startswith("model.visual.blocks")]
    assert vision_grads and any(g is not None and g.abs().sum() > 0 for g in vision_grads)


def test_frames_of_a_file_rate_give_the_timestamps(tmp_path):
    """Five frames at video_fps 2: three groups (the last frame repeated) at 0.25, 1.25 and 2.0 seconds."""
    encoder = VLMEncoder(tiny_processor("qwen3_vl"))
    [sample] = load_samples([_video_row(_frames(tmp_path / "five", [RED, RED, BLUE, BLUE, RED]))])
    feature = encoder.encode(sample)
    text = encoder.processor.tokenizer.decode(feature.input_ids)
    assert [t for t in ("<0.2 seconds>", "<1.2 seconds>", "<2.0 seconds>") if t in text] == [
        "<0.2 seconds>", "<1.2 seconds>", "<2.0 seconds>"]
    assert feature.vision["video_grid_thw"].tolist() == [[3, 4, 4]]
    assert all(feature.labels[i] == IGNORE_INDEX for i, t in enumerate(feature.token_values["mm_token_type_ids"])
               if t)


def test_packed_qwen3_video_rows_give_the_padded_logits(tiny_vlm_dir, colour_rows, clip, tmp_path):
    model, task = build_vlm_model(tiny_vlm_dir("qwen3_vl"), task_options={**FULL, "video_fps": 1})
    long_clip = _frames(tmp_path / "long", [BLUE, BLUE, RED, RED, BLUE, BLUE])
    rows = [_video_row(clip), colour_rows[1], _video_row(long_clip, "red"), _video_row(clip, "red")]
    padded_features = task.load_dataset(rows, model.tokenizer)
    padded = model.forward_only(inputs=task.prepare_batch(model, task.collate(padded_features)))["logits"]
    [row] = task.load_dataset(rows, model.tokenizer, packing=True, max_length=1024)
    packed = model.forward_only(inputs=task.prepare_batch(model, task.collate([row])))["logits"]
    offset = 0
    for part in row.parts:
        n = len(part.input_ids)
        reference = padded[[f.input_ids for f in padded_features].index(part.input_ids), :n]
        tolerance = forward_tolerance(float(reference.abs().max()), width=WIDTH, depth=DEPTH)
        assert float((packed[0, offset:offset + n] - reference).abs().max()) <= tolerance
        offset += n
    assert offset == packed.shape[1]


def test_truncation_never_cuts_a_timestamped_clip(clip):
    """A cut anywhere from the first frame group to the last one's end (timestamps between groups included) drops
    the row; a cut after the clip keeps it whole."""
    processor = tiny_processor("qwen3_vl")
    [sample] = load_samples([_video_row(clip)])
    whole = VLMEncoder(processor).encode(sample)
    end = processor.tokenizer.convert_tokens_to_ids("<|vision_end|>")
    last = max(i for i, t in enumerate(whole.input_ids) if t == end)
    second_timestamp = whole.input_ids.index(end) + 1  # the text "<2.5 seconds>" between the two groups
    for limit in (second_timestamp + 1, last):
        assert VLMEncoder(processor, max_length=limit).encode(sample) is None, limit
    kept = VLMEncoder(processor, max_length=last + 2).encode(sample)
    assert kept is not None and kept.input_ids == whole.input_ids[:last + 2]
    assert torch.equal(kept.vision["pixel_values_videos"], whole.vision["pixel_values_videos"])
