"""Video in the ``vlm_preference`` task: a pair whose prompt shows a video gives two chats that each carry the
video's tensors with only the answers labelled, a bad video is reported by line, and a DPO step on a tiny Qwen3-VL
equals per-sequence plain transformers forwards (reference text and pixels built as in test_video_qwen3.py: the
processor's own video text, the image processor on the frames)."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from transformers.video_utils import VideoMetadata

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.testing.tolerance import forward_tolerance

pytest.importorskip("twinkle_rl")

from twinkle_vlm.data import VLMDataError  # noqa: E402
from twinkle_vlm.preference import VLMPreferenceTask  # noqa: E402

FULL = {"train_vision": "full", "train_projector": "full", "train_language": "full", "video_fps": 1}
BETA = 0.1
QUESTION = "Which colour comes last?"
RED, BLUE, GREEN = (200, 30, 30), (30, 30, 200), (30, 200, 30)


def _frames(directory, colours, size=(64, 64)) -> str:
    os.makedirs(directory, exist_ok=True)
    for i, rgb in enumerate(colours):
        Image.new("RGB", size, rgb).save(os.path.join(directory, f"frame_{i:03d}.png"))
    return str(directory)


@pytest.fixture
def video_pairs(tmp_path) -> list[dict]:
    """Two pairs: a red-then-blue and a green-then-red clip (two static temporal patches each)."""
    clips = [("blue", "red", [RED, RED, BLUE, BLUE]), ("red", "green", [GREEN, GREEN, RED, RED])]
    return [{"messages": [{"role": "user", "content": [{"type": "video", "video": _frames(tmp_path / f"c{i}", c)},
                                                       {"type": "text", "text": QUESTION}]}],
             "chosen": chosen, "rejected": rejected} for i, (chosen, rejected, c) in enumerate(clips)]


def _model(model_dir):
    from twinkle_backend_hf.model import TransformersModel

    task = VLMPreferenceTask(**FULL, reference="model")
    model = TransformersModel(model_id=str(model_dir), task=task, tokenizer=TransformersModel.load_tokenizer(
        str(model_dir)))
    task.prepare_model(model)
    model.set_loss("dpo", beta=BETA)
    model.set_optimizer("SGD", lr=0.5)
    return model, task


def _batch(task, model, rows):
    features = task.load_dataset(rows, model.tokenizer)
    task.prepare_dataset(model, features, split="train", output_dir="unused")
    return features, task.prepare_batch(model, task.collate(features))


def test_both_chats_carry_the_video_and_only_the_answers_train(tiny_vlm_dir, video_pairs, tmp_path):
    model, task = _model(tiny_vlm_dir("qwen3_vl"))
    features, batch = _batch(task, model, video_pairs)
    tokenizer = model.tokenizer
    video_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    for feature, row in zip(features, video_pairs, strict=True):
        for key, value in feature.chosen.vision.items():
            assert torch.equal(value, feature.rejected.vision[key]), key
        assert feature.chosen.vision["video_grid_thw"].tolist() == [[2, 4, 4]]
        for sequence, answer in ((feature.chosen, row["chosen"]), (feature.rejected, row["rejected"])):
            assert sequence.input_ids.count(video_id) == 2 * 4  # 2 groups of 4 x 4 patches / merge 2 x 2
            trained = [label for label in sequence.labels if label != IGNORE_INDEX]
            assert tokenizer.decode(trained) == f"{answer}<|im_end|>"
    assert batch["video_grid_thw"].tolist() == [[2, 4, 4]] * 4  # one copy per sequence
    assert batch["pixel_values_videos"].shape[0] == 4 * 2 * 4 * 4

    missing = [{**video_pairs[0], "messages": [{"role": "user", "content": [
        {"type": "video", "video": str(tmp_path / "gone")}, {"type": "text", "text": QUESTION}]}]}]
    with pytest.raises(VLMDataError, match=r"<rows>:1: video file not found: .*gone"):
        task.load_dataset(missing, tokenizer)


def _plain_sequence(processor, row, answer):
    """One sequence built without the task: the processor's video text (its video processor stood in by the two sizes
    the text needs), the image processor on the two distinct frames, labels on the answer and its end of turn."""
    directory = row["messages"][0]["content"][0]["video"]
    pixels = processor.image_processor(images=[Image.open(os.path.join(directory, n)).convert("RGB")
                                               for n in ("frame_000.png", "frame_002.png")], return_tensors="pt")
    grid = torch.tensor([[2, *pixels["image_grid_thw"][0, 1:].tolist()]])
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    processor.video_processor = SimpleNamespace(merge_size=2, temporal_patch_size=2)
    metadata = VideoMetadata(total_num_frames=4, fps=1.0, frames_indices=[0, 1, 2, 3])
    replacement = processor.replace_video_token({"video_grid_thw": grid, "video_metadata": [metadata]}, 0)
    [prompt], _ = processor.get_text_with_replacements([prompt], videos_replacements=[replacement])
    tokenizer = processor.tokenizer
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(f"{answer}<|im_end|>", add_special_tokens=False)["input_ids"]
    input_ids = torch.tensor([prompt_ids + answer_ids])
    labels = torch.tensor([[IGNORE_INDEX] * len(prompt_ids) + answer_ids])
    token_types = (input_ids == tokenizer.convert_tokens_to_ids("<|video_pad|>")).long() * 2
    return {"input_ids": input_ids, "pixel_values_videos": pixels["pixel_values"], "video_grid_thw": grid,
            "mm_token_type_ids": token_types}, labels


def _sequence_logp(network, inputs, labels):
    logps = torch.log_softmax(network(**inputs).logits.float()[:, :-1], dim=-1)
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    return logps.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)[mask].sum()


def test_a_video_dpo_step_equals_per_sequence_transformers_forwards(tiny_vlm_dir, video_pairs):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir = tiny_vlm_dir("qwen3_vl")
    model, task = _model(model_dir)
    _, batch = _batch(task, model, video_pairs)
    model.forward_backward(inputs=batch)  # a first step, so the policy differs from the (initial) reference
    model.clip_grad_and_step(None)
    loss = float(model.forward_backward(inputs=batch)["loss"])

    reference = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    policy = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    policy.load_state_dict(model.module.state_dict())
    processor = AutoProcessor.from_pretrained(model_dir)
    losses, magnitude = [], 0.0
    with torch.no_grad():
        for row in video_pairs:
            margin = {}
            for side in ("chosen", "rejected"):
                inputs, labels = _plain_sequence(processor, row, row[side])
                ref = _sequence_logp(reference, inputs, labels)
                margin[side] = _sequence_logp(policy, inputs, labels) - ref
                magnitude = max(magnitude, float(ref.abs()))
            losses.append(-torch.nn.functional.logsigmoid(BETA * (margin["chosen"] - margin["rejected"])))
    want = float(torch.stack(losses).mean())

    text = reference.config.text_config
    width = max(text.vocab_size, text.intermediate_size, text.hidden_size)
    depth = text.num_hidden_layers + reference.config.vision_config.depth
    tolerance = 4 * BETA * forward_tolerance(magnitude, width=width, depth=depth)
    assert abs(loss - want) <= tolerance, (loss, want, tolerance)
    assert 0.0 < abs(loss - math.log(2)), "the step before must have moved the policy away from the reference"
