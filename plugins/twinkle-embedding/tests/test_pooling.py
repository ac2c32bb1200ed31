"""Pooling equals sentence-transformers' Pooling module, for left and right padding."""

from __future__ import annotations

import pytest
import torch
from twinkle_embedding.pooling import canonical_pooling, pool


def padded(lengths, width, side):
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        if side == "left":
            mask[row, width - n:] = 1
        else:
            mask[row, :n] = 1
    return mask


@pytest.mark.parametrize("side", ["left", "right"])
def test_manual_definitions(side):
    torch.manual_seed(0)
    lengths = [3, 5, 1]
    hidden = torch.randn(3, 5, 4)
    mask = padded(lengths, 5, side)
    mean, cls, last = (pool(hidden, mask, m) for m in ("mean", "cls", "last_token"))
    for row, n in enumerate(lengths):
        tokens = hidden[row, 5 - n:] if side == "left" else hidden[row, :n]
        assert torch.allclose(mean[row], tokens.mean(0), atol=1e-6)
        assert torch.equal(cls[row], tokens[0])
        assert torch.equal(last[row], tokens[-1])


@pytest.mark.parametrize("mode", ["mean", "cls", "last_token"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_matches_sentence_transformers_pooling(mode, side):
    from sentence_transformers.sentence_transformer.modules import Pooling
    from twinkle_embedding.pooling import ST_NAMES

    torch.manual_seed(1)
    hidden = torch.randn(4, 7, 6)
    mask = padded([7, 2, 5, 3], 7, side)
    theirs = Pooling(6, pooling_mode=ST_NAMES[mode])({"token_embeddings": hidden, "attention_mask": mask})
    assert torch.allclose(pool(hidden, mask, mode), theirs["sentence_embedding"], atol=1e-6)


def test_names_and_shape_errors():
    assert canonical_pooling("lasttoken") == canonical_pooling("LAST") == "last_token"
    assert canonical_pooling("cls_token") == "cls"
    with pytest.raises(ValueError, match="does not match"):
        pool(torch.randn(2, 3, 4), torch.ones(2, 5, dtype=torch.long), "mean")
