"""Padding-free packing with Qwen's 3-D multimodal RoPE: packed logits equal the unpacked ones.

Tolerance: fp32 logits of the same tokens computed with the same weights; only the reduction order of the
attention (one block-diagonal row vs separate rows) differs, which moves results by a few ulps of fp32
(eps 1.2e-7) per accumulation over 2 layers of width 64: 1e-5 relative to the largest logit leaves room
for that and nothing else (a wrong position or a mask crossing samples changes logits by O(1e-2)).
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from twinkle_vlm.collate import collate_vlm
from twinkle_vlm.data import load_samples
from twinkle_vlm.packing import find_rope_index, multimodal_position_ids, pack_vlm_features
from twinkle_vlm.task import VLMEncoder
from twinkle_vlm.testing import build_tiny_vlm

from twinkle_core.data.formats import IGNORE_INDEX

NETWORK_KEYS = ("input_ids", "attention_mask", "position_ids", "pixel_values", "image_grid_thw", "token_type_ids")
RELATIVE_TOLERANCE = 1e-5


def _samples(tmp_path):
    a, b = str(tmp_path / "a.png"), str(tmp_path / "b.png")
    Image.new("RGB", (56, 28), (220, 30, 30)).save(a)
    Image.new("RGB", (28, 84), (30, 30, 220)).save(b)
    return load_samples([
        {"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Red."}],
         "images": [a]},
        {"messages": [{"role": "user", "content": "<image><image>Same?"}, {"role": "assistant", "content": "No."},
                      {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes, sure."}],
         "images": [a, b]},
        {"messages": [{"role": "user", "content": "Text only."}, {"role": "assistant", "content": "Fine."}]},
        {"messages": [{"role": "user", "content": "<image>Shape?"}, {"role": "assistant", "content": "Tall."}],
         "images": [b]},
    ])


def _rows(tmp_path):
    """The samples of :func:`_samples` as rows in the ``<image>`` placeholder format (what load_dataset reads)."""
    rows = [{"messages": s.messages, "images": s.images} for s in _samples(tmp_path)]
    for row in rows:
        for message in row["messages"]:
            message["content"] = "".join(p["text"] if p["type"] == "text" else "<image>" for p in message["content"])
    return rows


def _logits(model, batch):
    rope_index = find_rope_index(model)  # Qwen: 3-D positions; InternVL: the text positions of the batch
    if rope_index is not None:
        batch = {**batch, "position_ids": multimodal_position_ids(rope_index, batch)}
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k in NETWORK_KEYS}, use_cache=False).logits


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "internvl"])
def test_packed_logits_equal_unpacked(tmp_path, model_type):
    model, processor = build_tiny_vlm(model_type)
    model.eval()
    encoder = VLMEncoder(processor)
    features = [encoder.encode(s) for s in _samples(tmp_path)]
    padded = _logits(model, collate_vlm(features, encoder.pad_token_id))
    longest = max(len(f.input_ids) for f in features)
    rows = pack_vlm_features(features, longest + 8)  # several rows: some hold two samples, one is padded
    assert len(rows) < len(features) and any(len(r.parts) > 1 for r in rows)
    packed_batch = collate_vlm(rows, encoder.pad_token_id)
    assert "attention_mask" not in packed_batch
    packed = _logits(model, packed_batch)
    compared = 0
    for row, feature in enumerate(rows):
        offset = 0
        for part in feature.parts:
            n = len(part.input_ids)
            reference = padded[features.index(part), :n]
            difference = (packed[row, offset:offset + n] - reference).abs().max()
            assert difference <= RELATIVE_TOLERANCE * reference.abs().max(), (model_type, row, float(difference))
            offset += n
            compared += 1
    assert compared == len(features)


def test_padded_positions_are_the_models_own(tmp_path):
    """For a padded batch the model computes 3-D positions itself from ``mm_token_type_ids``: ours are the same."""
    model, processor = build_tiny_vlm("qwen2_5_vl")
    model.eval()
    encoder = VLMEncoder(processor)
    batch = collate_vlm([encoder.encode(s) for s in _samples(tmp_path)], encoder.pad_token_id)
    ours = _logits(model, batch)
    with torch.no_grad():
        own = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
    mask = batch["attention_mask"].bool()
    assert torch.equal(ours[mask], own[mask])


def test_packed_rows_restart_positions_and_ignore_each_first_label(tmp_path):
    from twinkle_vlm.testing import tiny_processor

    encoder = VLMEncoder(tiny_processor("qwen2_5_vl"))
    features = [encoder.encode(s) for s in _samples(tmp_path)]
    [row] = pack_vlm_features(features, sum(len(f.input_ids) for f in features))
    starts = [i for i, p in enumerate(row.position_ids) if p == 0]
    lengths = [len(p.input_ids) for p in row.parts]
    assert starts == [sum(lengths[:k]) for k in range(len(lengths))]
    assert all(row.labels[s] == IGNORE_INDEX for s in starts)
    assert row.num_images == 4
    # the images follow the samples' order: grids of the parts, concatenated
    expected = torch.cat([p.vision["image_grid_thw"] for p in row.parts if p.num_images])
    assert torch.equal(row.vision["image_grid_thw"], expected)
    with pytest.raises(ValueError, match="more than the packing max_length"):
        pack_vlm_features(features, 4)


def test_the_task_packs_for_a_twinkle_model(tmp_path, tiny_vlm_dir):
    """Through the trainer's path: ``load_dataset(packing=True)`` -> ``collate`` -> ``prepare_batch`` ->
    ``TransformersModel.forward_only`` gives the logits of the padded path, sample by sample."""
    from twinkle_vlm.testing import build_vlm_model

    model, task = build_vlm_model(tiny_vlm_dir("qwen2_5_vl"), task_options={"train_language": "full"})
    rows = _rows(tmp_path)
    padded_features = task.load_dataset(rows, model.tokenizer)
    padded = model.forward_only(inputs=task.prepare_batch(model, task.collate(padded_features)))["logits"]
    packed_features = task.load_dataset(rows, model.tokenizer, packing=True, max_length=256)
    [row] = packed_features
    batch = task.prepare_batch(model, task.collate(packed_features))
    assert batch["position_ids"].shape == (4, 1, len(row.input_ids))  # text positions + 3-D rope
    packed = model.forward_only(inputs=batch)["logits"]
    offset = 0
    for part in row.parts:
        n = len(part.input_ids)
        reference = padded[[f.input_ids for f in padded_features].index(part.input_ids), :n]
        assert (packed[0, offset:offset + n] - reference).abs().max() <= RELATIVE_TOLERANCE * reference.abs().max()
        offset += n
    # the images reach the network: other pixels, other logits
    other = model.forward_only(inputs={**batch, "pixel_values": torch.zeros_like(batch["pixel_values"])})["logits"]
    assert not torch.allclose(other, packed)


def test_packing_is_refused_where_transformers_masks_packed_images_wrongly(tmp_path, tiny_vlm_dir):
    from transformers import AutoTokenizer
    from twinkle_vlm.task import VLMTask

    from twinkle_core.errors import ConfigError

    rows = _rows(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm_dir("gemma3"))
    with pytest.raises(ConfigError, match="packing: false"):
        VLMTask().load_dataset(rows, tokenizer, packing=True, max_length=512)
    assert len(VLMTask().load_dataset(rows, tokenizer)) == 4
