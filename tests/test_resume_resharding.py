"""What ``--resume`` accepts at another world size or batch layout (:mod:`twinkle_core.train.resharding`)."""

from __future__ import annotations

import pytest

from twinkle_core.data.loader import DataLoader
from twinkle_core.errors import ConfigError
from twinkle_core.train import resharding


def _layout(world=2, dp=2, batch=2, ga=1, strategy="ddp"):
    return resharding.layout(world_size=world, dp_size=dp, batch_size=batch, gradient_accumulation_steps=ga,
                             strategy=strategy)


def test_same_layout_passes():
    assert resharding.check_layout("ck", _layout(), _layout(), reshards=False) is False


def test_another_world_size_is_refused_without_resharding():
    with pytest.raises(ConfigError) as info:
        resharding.check_layout("ck", _layout(), _layout(world=1, dp=1, batch=4), reshards=False)
    text = str(info.value)
    assert "2 processes" in text and "this run has 1" in text and "'ddp'" in text
    assert "native_fsdp" in text and "megatron" in text and "--resume-weights-only ck" in text


def test_another_world_size_reshards_with_fsdp():
    saved, now = _layout(strategy="native_fsdp"), _layout(world=1, dp=1, batch=4, strategy="native_fsdp")
    assert resharding.check_layout("ck", saved, now, reshards=True) is True


def test_another_strategy_at_another_world_size_is_refused():
    with pytest.raises(ConfigError, match="same strategy"):
        resharding.check_layout("ck", _layout(strategy="ddp"), _layout(world=1, dp=1, batch=4, strategy="native_fsdp"),
                                reshards=True)


def test_changed_global_batch_is_refused_for_every_strategy():
    with pytest.raises(ConfigError) as info:
        resharding.check_layout("ck", _layout(), _layout(batch=4), reshards=True)
    text = str(info.value)
    assert "global batch of 4" in text and "this run has 8" in text and "--resume-weights-only" in text


def test_same_global_batch_split_differently_passes_everywhere():
    assert resharding.check_layout("ck", _layout(batch=4, ga=1), _layout(batch=2, ga=2), reshards=False) is False


def test_old_checkpoint_without_accumulation_uses_the_runs():
    saved = {"world_size": 1, "dp_size": 1, "batch_size": 4, "gradient_accumulation_steps": None, "strategy": None}
    assert resharding.check_layout("ck", saved, _layout(world=1, dp=1, batch=4), reshards=False) is False


@pytest.mark.parametrize("shuffle", [False, True])
def test_loader_position_maps_to_the_same_samples(shuffle):
    data = list(range(40))
    two = [DataLoader(data, 2, shuffle=shuffle, seed=5, dp_rank=r, dp_size=2) for r in range(2)]
    for loader in two:
        for _ in range(3):
            next(iter(loader))
    one = DataLoader(data, 4, shuffle=shuffle, seed=5, dp_rank=0, dp_size=1)
    one.load_state_dict(resharding.remap_loader_state("ck", two[0].state_dict(), one))
    assert one.position == 3
    # the uninterrupted 2-rank run's 4th step trains on the samples of the resumed run's next batch
    expected = sorted(two[0].batch_indices(0, 3) + two[1].batch_indices(0, 3))
    assert sorted(one.batch_indices(0, one.position)) == expected


def test_loader_position_that_is_not_a_whole_batch_is_refused():
    data = list(range(40))
    loader = DataLoader(data, 2, shuffle=False, dp_rank=0, dp_size=1)
    next(iter(loader))
    bigger = DataLoader(data, 4, shuffle=False, dp_rank=0, dp_size=1)
    with pytest.raises(ConfigError, match="not a whole number"):
        resharding.remap_loader_state("ck", loader.state_dict(), bigger)


def test_finished_epoch_stays_finished():
    data = list(range(10))
    loader = DataLoader(data, 2, shuffle=False, dp_rank=0, dp_size=2)
    state = {**loader.state_dict(), "position": len(loader)}
    one = DataLoader(data, 4, shuffle=False, dp_rank=0, dp_size=1)
    assert resharding.remap_loader_state("ck", state, one)["position"] == len(one)
