"""Video rows: frame directories, frame lists and mp4 files become ``pixel_values_videos`` / ``video_grid_thw`` and a
``<|video_pad|>`` run per video; the tensors equal transformers' image processor's on the same frames, the loss equals
a hand-built call of the model, video tokens never train, mixed image / video / text batches and packing give each
row's own logits, and bad videos are reported as ``file:line: reason``."""

from __future__ import annotations

import json
import os

import pytest
import torch
from PIL import Image
from twinkle_vlm.data import VLMDataError, load_samples
from twinkle_vlm.task import VLMEncoder, VLMTask
from twinkle_vlm.testing import build_vlm_model, tiny_processor
from twinkle_vlm.videos import VideoOptions, load_frames, patchify_frames, video_options, video_problem

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError, DataFormatError
from twinkle_core.testing.tolerance import forward_tolerance

FULL = {"train_vision": "full", "train_projector": "full", "train_language": "full"}
#: hidden size and layers of the tiny models (twinkle_vlm.testing_families): 2 vision + 2 text blocks
WIDTH, DEPTH = 64, 4


def _frames(directory, colours, size=(56, 56)) -> str:
    os.makedirs(directory, exist_ok=True)
    for i, rgb in enumerate(colours):
        Image.new("RGB", size, rgb).save(os.path.join(directory, f"frame_{i:03d}.png"))
    return str(directory)


def _mp4(path, colours, fps=4, size=(64, 48)) -> str:
    av = pytest.importorskip("av")
    import numpy as np

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        for rgb in colours:
            frame = np.zeros((size[1], size[0], 3), np.uint8)
            frame[:] = rgb
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


def _video_row(video, answer="blue") -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "video", "video": video},
                                                      {"type": "text", "text": "What happens?"}]},
                         {"role": "assistant", "content": answer}]}


def _text_row() -> dict:
    return {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]}


@pytest.fixture
def clip(tmp_path) -> str:
    """Four frames, the first two and the last two equal (two temporal patches of static content)."""
    return _frames(tmp_path / "clip", [(200, 30, 30), (200, 30, 30), (30, 30, 200), (30, 30, 200)])


# ------------------------------------------------------------------ tensors and tokens


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_a_video_row_gets_video_tensors_and_its_pad_run(model_type, clip):
    processor = tiny_processor(model_type)
    encoder = VLMEncoder(processor)
    [sample] = load_samples([_video_row(clip)])
    feature = encoder.encode(sample)
    grid = feature.vision["video_grid_thw"]
    assert grid.tolist() == [[2, 4, 4]]  # 4 frames / temporal patch 2; 56 px / patch 14
    assert feature.vision["pixel_values_videos"].shape == (2 * 4 * 4, 3 * 2 * 14 * 14)
    video_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    positions = [i for i, t in enumerate(feature.input_ids) if t == video_id]
    assert len(positions) == int(grid.prod()) // 4  # merge_size 2 x 2
    assert positions == list(range(positions[0], positions[0] + len(positions)))  # one run
    types = feature.token_values["mm_token_type_ids"]
    assert [i for i, t in enumerate(types) if t == 2] == positions and 1 not in types
    assert all(feature.labels[i] == IGNORE_INDEX for i in positions)
    assert feature.num_trained_tokens > 0
    if model_type == "qwen2_5_vl":  # temporal_patch_size / fps: frames are taken at video_fps (2)
        assert feature.vision["second_per_grid_ts"].tolist() == [1.0]
    else:
        assert "second_per_grid_ts" not in feature.vision


def test_frames_go_through_the_image_processor_in_temporal_patches(tmp_path):
    """Frames [A, A, B, B] are two static temporal patches: exactly what transformers' image processor makes of
    images A and B (it repeats an image over the temporal patch), in that order; an odd count repeats the last."""
    a, b = (200, 30, 30), (30, 90, 200)
    processor = tiny_processor("qwen2_vl")
    encoder = VLMEncoder(processor)
    size = (50, 38)  # not a multiple of the patch grid: the image processor's resize runs
    [sample] = load_samples([_video_row(_frames(tmp_path / "v", [a, a, b, b], size))])
    feature = encoder.encode(sample)
    reference = processor.image_processor(images=[Image.new("RGB", size, a), Image.new("RGB", size, b)],
                                          return_tensors="pt")
    assert torch.equal(feature.vision["pixel_values_videos"], reference["pixel_values"])
    grid_t, grid_h, grid_w = feature.vision["video_grid_thw"][0].tolist()
    assert grid_t == 2 and reference["image_grid_thw"].tolist() == [[1, grid_h, grid_w]] * 2

    [odd] = load_samples([_video_row(_frames(tmp_path / "odd", [a, a, b], size))])
    values = encoder.encode(odd).vision["pixel_values_videos"]
    assert torch.equal(values, reference["pixel_values"])  # B padded to (B, B)


def test_patchify_orders_patches_as_the_qwen_video_processor():
    """Each row is one (temporal patch, patch) cell: its values are [C, T, p, p] of that cell."""
    t, c, h, w, p = 4, 3, 4, 4, 2
    frames = torch.arange(t * c * h * w, dtype=torch.float32).reshape(t, c, h, w)
    flat, grid = patchify_frames(frames, patch_size=p, merge_size=2, temporal_patch_size=2)
    assert grid == [2, 2, 2] and flat.shape == (8, c * 2 * p * p)
    # row 5: temporal patch 1, merged block (0, 0), inner (row 0, column 1) -> pixels [0:2, 2:4] of frames 2-3
    assert torch.equal(flat[5].reshape(c, 2, p, p), frames[2:4, :, 0:2, 2:4].permute(1, 0, 2, 3))


# ------------------------------------------------------------------ the model


def test_loss_equals_a_hand_built_call_and_gradients_reach_the_vision_tower(tiny_vlm_dir, clip):
    model, task = build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), task_options={**FULL, "video_fps": 1})
    rows = [_video_row(clip)]
    batch = task.prepare_batch(model, task.collate(task.load_dataset(rows, model.tokenizer)))
    assert batch["second_per_grid_ts"].tolist() == [2.0]  # temporal_patch_size 2 / 1 frame per second

    # by hand: the template's rendering, the video pad expanded, the image processor on the two distinct frames
    processor = tiny_processor("qwen2_5_vl")
    tokenizer = processor.tokenizer
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    pixels = processor.image_processor(images=[Image.open(os.path.join(clip, n)).convert("RGB")
                                               for n in ("frame_000.png", "frame_002.png")], return_tensors="pt")
    grid = torch.tensor([[2, *pixels["image_grid_thw"][0, 1:].tolist()]])
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = prompt.replace("<|video_pad|>", "<|video_pad|>" * (int(grid.prod()) // 4))
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer("blue<|im_end|>", add_special_tokens=False)["input_ids"]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    input_ids = torch.tensor([prompt_ids + answer_ids + newline])
    labels = torch.tensor([[IGNORE_INDEX] * len(prompt_ids) + answer_ids + [IGNORE_INDEX] * len(newline)])
    assert input_ids.tolist() == batch["input_ids"].tolist() and labels.tolist() == batch["labels"].tolist()
    video_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    token_types = (input_ids == video_id).long() * 2
    # the 3-D positions: the model's own rule on the hand-built inputs; the second temporal patch lies
    # tokens_per_second * 2 s after the first
    positions, _ = model.network.model.get_rope_index(input_ids, token_types, video_grid_thw=grid,
                                                      second_per_grid_ts=torch.tensor([2.0]))
    assert torch.equal(batch["position_ids"], positions)
    temporal = positions[0, 0][input_ids[0] == video_id]
    step = model.network.config.vision_config.tokens_per_second * 2
    assert temporal.unique().tolist() == [int(temporal[0]), int(temporal[0]) + step]
    with torch.no_grad():
        expected = model.network(input_ids=input_ids, labels=labels, pixel_values_videos=pixels["pixel_values"],
                                 video_grid_thw=grid, second_per_grid_ts=torch.tensor([2.0]),
                                 mm_token_type_ids=token_types).loss

    out = model.forward_backward(inputs=batch)
    loss = float(out["loss"])
    assert abs(loss - float(expected)) <= forward_tolerance(float(expected), width=WIDTH, depth=DEPTH)
    vision_grads = [p.grad for n, p in model.network.named_parameters() if n.startswith("model.visual.blocks")]
    assert vision_grads and all(g is not None and torch.isfinite(g).all() for g in vision_grads)
    assert any(g.abs().sum() > 0 for g in vision_grads)


def test_image_video_and_text_rows_in_one_batch_give_each_row_its_own_logits(tiny_vlm_dir, colour_rows, clip):
    model, task = build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), task_options=FULL)
    rows = [colour_rows[0], _video_row(clip), _text_row(), _video_row(clip, "red")]
    features = task.load_dataset(rows, model.tokenizer)
    batch = task.prepare_batch(model, task.collate(features))
    assert batch["pixel_values"].shape[0] == features[0].vision["pixel_values"].shape[0]
    assert batch["video_grid_thw"].tolist() == [[2, 4, 4]] * 2
    mixed = model.forward_only(inputs=batch)["logits"]
    for row, feature in enumerate(features):
        alone = model.forward_only(inputs=task.prepare_batch(model, task.collate([feature])))["logits"][0]
        n = len(feature.input_ids)
        tolerance = forward_tolerance(float(alone.abs().max()), width=WIDTH, depth=DEPTH)
        assert float((mixed[row, :n] - alone).abs().max()) <= tolerance, row
    # the video pixels reach the logits
    other = model.forward_only(inputs={**batch, "pixel_values_videos": torch.zeros_like(batch["pixel_values_videos"])})
    assert not torch.allclose(other["logits"][1], mixed[1])
    assert torch.equal(other["logits"][0], mixed[0])
    out = model.forward_backward(inputs=batch)
    assert torch.isfinite(torch.as_tensor(float(out["loss"])))


def test_packed_video_rows_give_the_padded_logits(tiny_vlm_dir, colour_rows, clip):
    model, task = build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), task_options={**FULL, "video_fps": 1})
    rows = [_video_row(clip), colour_rows[1], _text_row(), _video_row(clip, "red")]
    padded_features = task.load_dataset(rows, model.tokenizer)
    padded = model.forward_only(inputs=task.prepare_batch(model, task.collate(padded_features)))["logits"]
    [row] = task.load_dataset(rows, model.tokenizer, packing=True, max_length=512)
    packed = model.forward_only(inputs=task.prepare_batch(model, task.collate([row])))["logits"]
    offset = 0
    for part in row.parts:
        n = len(part.input_ids)
        reference = padded[[f.input_ids for f in padded_features].index(part.input_ids), :n]
        tolerance = forward_tolerance(float(reference.abs().max()), width=WIDTH, depth=DEPTH)
        assert float((packed[0, offset:offset + n] - reference).abs().max()) <= tolerance
        offset += n


# ------------------------------------------------------------------ formats and files


def test_placeholder_rows_and_frame_lists(tmp_path, clip):
    frames = sorted(os.path.join(clip, n) for n in os.listdir(clip))
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "<video><image>Same?"}, {"role": "assistant", "content": "no"}],
         "videos": ["clip"], "images": [frames[0]]},
        _video_row(frames),
    ]) + "\n")
    samples = load_samples(str(data))
    assert samples[0].videos == [clip] and samples[0].images == [frames[0]]
    assert [p["type"] for p in samples[0].messages[0]["content"]] == ["video", "image", "text"]
    assert samples[1].videos == [frames]
    encoder = VLMEncoder(tiny_processor("qwen2_vl"))
    first, second = (encoder.encode(s) for s in samples)
    assert first.num_images == 1 and first.vision["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert first.vision["image_grid_thw"].tolist() == [[1, 4, 4]]
    types = first.token_values["mm_token_type_ids"]
    assert types.count(2) == 8 and types.count(1) == 4 and types.index(2) < types.index(1)  # video, then image
    assert torch.equal(second.vision["pixel_values_videos"], first.vision["pixel_values_videos"])
    few = VLMEncoder(tiny_processor("qwen2_vl"), video=VideoOptions(max_frames=2)).encode(samples[1])
    assert few.vision["video_grid_thw"].tolist() == [[1, 4, 4]]  # frames 0 and 2 of 4


def test_mp4_files_are_sampled_at_video_fps(tmp_path):
    os.makedirs(tmp_path / "clips")
    mp4 = _mp4(tmp_path / "clips" / "a.mp4", [(30 * i, 100, 200) for i in range(8)])
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(_video_row("clips/a.mp4")) + "\n")
    [sample] = load_samples(str(data))
    assert sample.videos == [mp4]
    # 8 frames at 4 per second: 2 seconds sampled at 2 per second
    decoded, fps = load_frames(mp4, VideoOptions())
    assert len(decoded) == 4 and fps == 2.0 and decoded[0].size == (64, 48)
    reds = [float(torch.tensor(list(d.split()[0].tobytes())).float().mean()) for d in decoded]
    assert reds == sorted(reds) and abs(reds[0] - 0) < 8 and abs(reds[-1] - 180) < 8  # frames 0, 2, 4, 6 (lossy)
    few, _ = load_frames(mp4, VideoOptions(max_frames=2))
    assert len(few) == 2
    feature = VLMEncoder(tiny_processor("qwen2_vl")).encode(sample)
    assert feature.vision["video_grid_thw"][0, 0] == 2  # 4 frames


def test_bad_videos_are_reported_by_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no frames here")
    mixed = _frames(tmp_path / "mixed", [(1, 2, 3)], size=(56, 56))
    Image.new("RGB", (28, 28)).save(os.path.join(mixed, "frame_999.png"))
    (tmp_path / "broken.mp4").write_bytes(b"not a video" * 10)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        _video_row("missing.mp4"),
        _video_row("empty"),
        _video_row("mixed"),
        _video_row(["gone.png"]),
        _video_row("broken.mp4"),
        {"messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "x"}], "videos": []},
    ]) + "\n")
    with pytest.raises(VLMDataError) as caught:
        load_samples(str(data))
    message = str(caught.value)
    assert f"{data}:1: video file not found: {tmp_path / 'missing.mp4'}" in message
    assert f"{data}:2: video directory {empty} holds no frame images" in message
    assert f"{data}:3: video {mixed} has frames of different sizes (28x28, 56x56)" in message
    assert f"{data}:4: video frames {tmp_path / 'gone.png'} ... (1 files): image file not found" in message
    assert f"{data}:5: " in message and ("not a readable video" in message or "needs PyAV" in message)
    assert f"{data}:6: 1 <video> placeholder(s) in the messages but 0 video(s) in 'videos'" in message
    assert video_problem(str(tmp_path / "mixed"), max_image_pixels=1000).endswith(
        "more than max_image_pixels=1,000 (a guard against decompression bombs, checked before decoding): shrink "
        "the image, or raise max_image_pixels (task_options.max_image_pixels in a recipe)")


@pytest.mark.parametrize("model_type", ["gemma3", "internvl"])
def test_families_without_video_refuse_a_video_row(model_type, tiny_vlm_dir, clip):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm_dir(model_type))
    with pytest.raises(DataFormatError,
                       match="reads video for qwen2_vl, qwen2_5_vl, qwen3_vl / qwen3_vl_moe / qwen3_5 models only"):
        VLMTask().load_dataset([_text_row(), _video_row(clip)], tokenizer)
    assert len(VLMTask().load_dataset([_text_row()], tokenizer)) == 1  # rows without video still work


def test_video_options_are_checked():
    assert video_options({}) == VideoOptions(2.0, 768, None)
    assert video_options({"video_fps": 1, "video_max_frames": 8, "video_max_pixels": 3136}) == VideoOptions(1.0, 8, 3136)
    for bad in ({"video_fps": 0}, {"video_fps": "2"}, {"video_max_frames": 0}, {"video_max_pixels": 1.5}):
        with pytest.raises(ConfigError, match="task_options.video_"):
            video_options(bad)


def test_video_max_pixels_bounds_each_frame(clip):
    processor = tiny_processor("qwen2_vl", max_pixels=56 * 56 * 4)
    [sample] = load_samples([_video_row(clip)])
    wide = VLMEncoder(processor).encode(sample).vision["video_grid_thw"]
    small = VLMEncoder(processor, video=VideoOptions(max_pixels=28 * 28)).encode(sample).vision["video_grid_thw"]
    assert wide.tolist() == [[2, 4, 4]] and small.tolist() == [[2, 2, 2]]


def test_evaluation_generates_with_the_videos(tiny_vlm_dir, colour_rows, clip):
    model, task = build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), task_options=FULL)
    rows = [_video_row(clip), colour_rows[0], _text_row()]
    result = task.evaluate(model, rows, model.tokenizer, max_new_tokens=3, batch_size=3)
    assert result["num_examples"] == 3 and 0.0 <= result["answer_accuracy"] <= 1.0
