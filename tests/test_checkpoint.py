"""The training run's checkpoint-directory policy (names, latest, pruning)."""

from __future__ import annotations


def test_checkpoint_helpers(tmp_path):
    from twinkle_core.checkpoint import latest_checkpoint, list_checkpoints, prune_checkpoints

    for name in ("checkpoint-2", "checkpoint-10", "checkpoint-10-interrupted", "checkpoint-3-interrupted",
                 "checkpoint-12-interrupted", "final", "checkpoint-x"):
        (tmp_path / name).mkdir()
    assert [(s, i) for s, i, _ in list_checkpoints(tmp_path)] == [(2, False), (3, True), (10, True), (10, False),
                                                                  (12, True)]
    assert latest_checkpoint(tmp_path).name == "checkpoint-12-interrupted"
    removed = prune_checkpoints(tmp_path, 1)
    assert sorted(p.name for p in removed) == ["checkpoint-10-interrupted", "checkpoint-2", "checkpoint-3-interrupted"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-12-interrupted",
                                                          "checkpoint-x", "final"]
    assert prune_checkpoints(tmp_path, None) == []


def test_checkpoint_names_are_the_ones_listed(tmp_path):
    from twinkle_core.checkpoint import checkpoint_name, list_checkpoints

    for name in (checkpoint_name(7), checkpoint_name(7, interrupted=True)):
        (tmp_path / name).mkdir()
    assert [(s, i) for s, i, _ in list_checkpoints(tmp_path)] == [(7, True), (7, False)]
