"""The ``vlm`` task: processor loading (model directory, assembled, pixel limits), collation, truncation, export."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer
from twinkle_vlm.processor import apply_pixel_limits
from twinkle_vlm.task import VLMTask
from twinkle_vlm.testing import save_tiny_vlm

from twinkle_core.errors import ConfigError, DataFormatError

PATCH = 14  # Qwen2-VL family: 14-pixel patches, merged 2 x 2 into one vision token


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_vlm("qwen2_5_vl", tmp_path_factory.mktemp("tiny") / "model"))


def _data(tmp_path, rows):
    Image.new("RGB", (112, 112), (200, 0, 0)).save(tmp_path / "red.png")
    Image.new("RGB", (200, 120), (0, 0, 200)).save(tmp_path / "wide.png")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [
    {"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Red."}],
     "images": ["red.png"]},
    {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                               {"type": "image", "image": "wide.png"},
                                               {"type": "text", "text": "Which is wider?"}]},
                  {"role": "assistant", "content": "The second."}]},
    {"messages": [{"role": "user", "content": "No image."}, {"role": "assistant", "content": "Fine."}]},
]


def test_collation_pads_text_and_concatenates_the_images_of_all_rows(tmp_path, model_dir):
    task = VLMTask()
    features = task.load_dataset(_data(tmp_path, ROWS), AutoTokenizer.from_pretrained(model_dir))
    assert [f.num_images for f in features] == [1, 2, 0]
    batch = task.collate(features)
    longest = max(len(f.input_ids) for f in features)
    for key in ("input_ids", "labels", "attention_mask", "mm_token_type_ids"):
        assert batch[key].shape == (3, longest), key
    assert batch["attention_mask"].sum(1).tolist() == [len(f.input_ids) for f in features]
    grids = batch["image_grid_thw"]
    assert grids.shape == (3, 3)  # three images: one of row 0, two of row 1, none of row 2
    assert batch["pixel_values"].shape[0] == int(grids.prod(-1).sum())
    assert torch.equal(grids, torch.cat([features[0].vision["image_grid_thw"], features[1].vision["image_grid_thw"]]))
    assert batch["mm_token_type_ids"][2].sum() == 0  # the text-only row
    text_only = task.collate([features[2]])
    assert "pixel_values" not in text_only and "image_grid_thw" not in text_only


def test_min_and_max_pixels_bound_every_image(tmp_path, model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    Image.new("RGB", (20, 20), (0, 200, 0)).save(tmp_path / "tiny.png")  # 400 pixels
    rows = _data(tmp_path, [*ROWS[:2], {"messages": [{"role": "user", "content": "<image>"},
                                                     {"role": "assistant", "content": "x"}], "images": ["tiny.png"]}])
    low, high = 4 * 28 * 28, 8 * 28 * 28  # 3136 and 6272; red is 12544 pixels, wide 24000
    task = VLMTask(min_pixels=low, max_pixels=high)
    grids = torch.cat([f.vision["image_grid_thw"] for f in task.load_dataset(rows, tokenizer)])
    pixels = (grids.prod(-1) * PATCH * PATCH).tolist()
    assert all(low <= p <= high for p in pixels), pixels
    # the same images without the limits: the large ones stay larger than the ceiling we set
    default = VLMTask(min_pixels=low, max_pixels=100 * 28 * 28).load_dataset(rows, tokenizer)
    assert max(int(f.vision["image_grid_thw"].prod(-1).max()) for f in default) * PATCH * PATCH > high


def test_pixel_limits_are_refused_for_a_fixed_size_processor():
    from transformers.image_utils import SizeDict

    class FixedSize:
        size = SizeDict(height=224, width=224)

    with pytest.raises(ConfigError, match="fixed size"):
        apply_pixel_limits(FixedSize(), 100, None)


def test_processor_assembled_from_the_tokenizer_and_an_image_processor_config(tmp_path, model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = VLMTask(image_processor={"image_processor_type": "Qwen2VLImageProcessorPil", "min_pixels": 3136,
                                    "max_pixels": 3136})
    features = task.load_dataset(_data(tmp_path, ROWS[:1]), tokenizer)
    assert task.processor.tokenizer is tokenizer
    assert type(task.processor).__name__ == "Qwen2_5_VLProcessor"
    assert features[0].vision["image_grid_thw"].tolist() == [[1, 4, 4]]  # resized to 56 x 56 pixels
    with pytest.raises(ConfigError, match="image_processor_type"):
        VLMTask(image_processor={"image_processor_type": "NoSuchProcessor"}).load_dataset(
            _data(tmp_path, ROWS[:1]), tokenizer)


def test_truncation_never_cuts_an_image(tmp_path, model_dir, caplog):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"messages": [{"role": "user", "content": "Look closely at this picture, then answer: <image>"},
                          {"role": "assistant", "content": "A red square."}], "images": ["red.png"]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ok"}]}]
    path = _data(tmp_path, rows)
    full = VLMTask().load_dataset(path, tokenizer)
    first, short = full
    last_image_token = max(i for i, t in enumerate(first.token_values["mm_token_type_ids"]) if t)
    assert len(short.input_ids) <= last_image_token
    # a cut after the image: the sample is kept, cut on the right
    keep = len(first.input_ids) - 2
    kept = VLMTask(max_length=keep).load_dataset(path, tokenizer)
    assert kept[0].input_ids == first.input_ids[:keep] and kept[0].labels == first.labels[:keep]
    assert kept[1].input_ids == short.input_ids
    # a cut through the image's placeholder run: the sample is dropped with a warning naming it
    with caplog.at_level(logging.WARNING):
        cut = VLMTask(max_length=last_image_token).load_dataset(path, tokenizer)
    assert [f.input_ids for f in cut] == [short.input_ids]
    assert f"{path}:1: dropped: max_length={last_image_token} would cut through an image" in caplog.text
    with pytest.raises(DataFormatError, match=r"train.jsonl:1: sample has \d+ tokens"):
        VLMTask(max_length=keep, truncation="error").load_dataset(path, tokenizer)
    with pytest.raises(ConfigError, match="'right' or 'error'"):
        VLMTask(truncation="left").load_dataset(path, tokenizer)


def test_on_export_saves_a_processor_that_loads_alone(tmp_path, model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = VLMTask(max_pixels=4 * 28 * 28)
    task.load_dataset(_data(tmp_path, ROWS[:1]), tokenizer)
    out = tmp_path / "checkpoint"
    out.mkdir()
    task.on_export(None, str(out), None)
    reloaded = AutoProcessor.from_pretrained(out)
    image = Image.open(tmp_path / "wide.png")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = reloaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == task.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ours, theirs = task.processor(text=[text], images=[image]), reloaded(text=[text], images=[image])
    assert ours["input_ids"] == theirs["input_ids"]
    assert (theirs["image_grid_thw"].prod(-1) * PATCH * PATCH <= 4 * 28 * 28).all()  # the pixel limit travels


def test_bad_rows_fail_before_any_encoding(tmp_path, model_dir):
    rows = [ROWS[0], {"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}],
                      "images": ["nowhere.png"]}]
    with pytest.raises(DataFormatError, match=r"train.jsonl:2: image file not found"):
        VLMTask().load_dataset(_data(tmp_path, rows), AutoTokenizer.from_pretrained(model_dir))


def test_a_saved_checkpoint_carries_the_processor(tmp_path, tiny_vlm_dir):
    """Through the model's own save: the processor the task trained with is in the checkpoint."""
    from twinkle_vlm.testing import build_vlm_model

    model, task = build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), task_options={"train_language": "full",
                                                                           "max_pixels": 3136})
    task.load_dataset(_data(tmp_path, ROWS[:1]), model.tokenizer)
    checkpoint = model.save("final", output_dir=str(tmp_path / "out"), save_optimizer=False)
    reloaded = AutoProcessor.from_pretrained(checkpoint)
    assert type(reloaded) is type(task.processor)
    assert reloaded.image_processor.size.longest_edge == 3136
    assert reloaded.chat_template == task.processor.chat_template


def test_a_model_saved_before_any_data_still_carries_its_processor(tmp_path, tiny_vlm_dir):
    from twinkle_vlm.testing import build_vlm_model

    model, task = build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), task_options={"train_language": "full"})
    checkpoint = model.save("early", output_dir=str(tmp_path / "out"), save_optimizer=False)
    assert type(AutoProcessor.from_pretrained(checkpoint)).__name__ == "Qwen2_5_VLProcessor"
