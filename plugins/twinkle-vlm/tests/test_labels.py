"""Assistant-only labels: no prompt token and no vision token is ever a label, checked at every position."""

from __future__ import annotations

import pytest
from PIL import Image
from twinkle_vlm.data import load_samples
from twinkle_vlm.task import VLMEncoder, vision_token_ids
from twinkle_vlm.testing import tiny_processor

from twinkle_core.data.formats import IGNORE_INDEX, RowError

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl", "gemma3")


def _rows(tmp_path):
    Image.new("RGB", (40, 30), (200, 10, 10)).save(tmp_path / "a.png")
    Image.new("RGB", (28, 56), (10, 10, 200)).save(tmp_path / "b.png")
    a, b = str(tmp_path / "a.png"), str(tmp_path / "b.png")
    return [
        {"messages": [{"role": "system", "content": "Answer in one word."},
                      {"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Red."},
                      {"role": "user", "content": "<image>And now?"}, {"role": "assistant", "content": "Blue."}],
         "images": [a, b]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Both: "}, {"type": "image", "image": a},
                                                   {"type": "image", "image": b}]},
                      {"role": "assistant", "content": "Two squares."}]},
        {"messages": [{"role": "user", "content": "No picture here."}, {"role": "assistant", "content": "Fine."}]},
    ]


def _trained_runs(labels):
    runs, current = [], []
    for label in labels:
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            current.append(label)
    return runs + ([current] if current else [])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_only_assistant_text_is_trained(tmp_path, model_type):
    processor = tiny_processor(model_type)
    encoder = VLMEncoder(processor)
    vision = vision_token_ids(processor)
    tokenizer = processor.tokenizer
    answers = [["Red.", "Blue."], ["Two squares."], ["Fine."]]
    image_token = tokenizer.convert_tokens_to_ids(processor.image_token)
    assert image_token in vision
    for sample, expected in zip(load_samples(_rows(tmp_path)), answers, strict=True):
        feature = encoder.encode(sample)
        # where the model's own per-token modality marks exist (Qwen, Gemma 3), they mark the images too
        types = feature.token_values.get("mm_token_type_ids", feature.token_values.get("token_type_ids"))
        for position, (token, label) in enumerate(zip(feature.input_ids, feature.labels, strict=True)):
            if label == IGNORE_INDEX:
                continue
            assert label == token, f"position {position}: a label must be the token itself"
            assert token not in vision, f"position {position}: vision token {token} is a label"
            assert types is None or types[position] == 0, f"position {position}: an image position is a label"
        # the trained runs are exactly the answers, each with its end-of-turn token and nothing of the prompt
        runs = _trained_runs(feature.labels)
        assert all(run[-1] in encoder.end_of_turn_ids for run in runs)
        assert [tokenizer.decode(run[:-1]) for run in runs] == expected
        assert (image_token in feature.input_ids) == bool(sample.images)
        if "image_grid_thw" in feature.vision:  # Qwen: one placeholder per merged patch
            merge = processor.image_processor.merge_size ** 2
            assert feature.input_ids.count(image_token) == int(feature.vision["image_grid_thw"].prod(-1).sum()) // merge


def test_a_vision_token_typed_into_an_answer_is_not_trained():
    processor = tiny_processor("qwen2_5_vl")
    encoder = VLMEncoder(processor)
    [sample] = load_samples([{"messages": [{"role": "user", "content": "Say the start token."},
                                           {"role": "assistant", "content": "It is <|vision_start|> ok"}]}])
    feature = encoder.encode(sample)
    start = processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert start in feature.input_ids
    assert feature.labels[feature.input_ids.index(start)] == IGNORE_INDEX
    # the rest of the answer is still trained
    trained = processor.tokenizer.decode([label for label in feature.labels if label != IGNORE_INDEX])
    assert trained == "It is  ok<|im_end|>"


def test_an_image_marker_typed_as_text_is_refused():
    encoder = VLMEncoder(tiny_processor("qwen2_5_vl"))
    [sample] = load_samples([{"messages": [{"role": "user", "content": "What is <|image_pad|>?"},
                                           {"role": "assistant", "content": "A token."}]}])
    with pytest.raises(RowError, match="image marker of this model"):
        encoder.encode(sample)
