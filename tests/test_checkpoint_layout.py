"""One object owns a checkpoint's file names and the keys of its training-state file: what the model writes is
exactly what :class:`~twinkle_core.checkpoint_layout.CheckpointLayout` names, and nothing else."""

from __future__ import annotations

import os

import torch

from twinkle_core.checkpoint_layout import CheckpointLayout, TrainerStateKeys
from twinkle_core.testing.conformance import make_batch
from twinkle_core.testing.reference import make_reference_model


def _keys() -> set[str]:
    return {value for name, value in vars(TrainerStateKeys).items() if name.isupper()}


def test_a_training_checkpoint_holds_exactly_what_the_layout_names(tmp_path):
    model = make_reference_model()
    model.set_optimizer("AdamW", lr=1e-3)
    model.forward_backward(inputs=make_batch(0))
    model.clip_grad_and_step()
    path = model.save("checkpoint-1", output_dir=str(tmp_path), extra_state={"step": 1})

    layout = CheckpointLayout(path)
    assert os.path.isfile(layout.marker)
    assert sorted(os.listdir(layout.state_dir)) == sorted(
        os.path.basename(p) for p in (layout.trainer_state, layout.rng_state(0),
                                      CheckpointLayout.optimizer_file(layout.state_dir)))
    trainer = torch.load(layout.trainer_state, weights_only=True)
    assert set(trainer) == _keys()
    assert trainer[TrainerStateKeys.EXTRA_STATE] == {"step": 1}
    assert trainer[TrainerStateKeys.RNG_RANKS] == 1
    assert layout.has_rng_files()


def test_a_weights_only_checkpoint_has_no_state_dir(tmp_path):
    model = make_reference_model()
    path = model.save("final", output_dir=str(tmp_path), save_optimizer=False)
    layout = CheckpointLayout(path)
    assert os.path.isfile(layout.marker) and not os.path.exists(layout.state_dir)
