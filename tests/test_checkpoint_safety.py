"""Checkpoint state files are data, never code: a planted pickle is refused and never runs."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from twinkle_core import checkpoint
from twinkle_core.testing.conformance import make_batch
from twinkle_core.testing.reference import make_reference_model


class _Payload:
    """Unpickling this would create ``marker``: the code a tampered checkpoint could run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _trained_checkpoint(tmp_path) -> str:
    model = make_reference_model(seed=0)
    model.set_optimizer("AdamW", lr=1e-2)
    model.set_lr_scheduler("cosine", num_training_steps=4, num_warmup_steps=1)
    model.forward_backward(inputs=make_batch(1))
    model.clip_grad_and_step(max_grad_norm=1.0)
    return model.save("checkpoint-1", output_dir=str(tmp_path / "run"), extra_state={"step": 1})


def _fresh_model():
    model = make_reference_model(seed=3)
    model.set_optimizer("AdamW", lr=1e-2)
    model.set_lr_scheduler("cosine", num_training_steps=4, num_warmup_steps=1)
    return model


def _replace_and_rehash(path: str, rel: str, data: bytes) -> None:
    """Overwrite a checkpoint file and update the manifest, as an attacker with write access could."""
    with open(os.path.join(path, rel), "wb") as fh:
        fh.write(data)
    marker = os.path.join(path, checkpoint.MARKER)
    with open(marker) as fh:
        meta = json.load(fh)
    meta["files"][rel] = {"size": len(data), "sha256": checkpoint._sha256(os.path.join(path, rel))}
    with open(marker, "w") as fh:
        json.dump(meta, fh)


def test_state_files_load_as_data_only(tmp_path):
    import torch

    path = _trained_checkpoint(tmp_path)
    for name in ("optimizer.pt", "trainer_state.pt", "rng-rank0.pt"):
        torch.load(os.path.join(path, checkpoint.STATE_DIR, name), weights_only=True)
    assert _fresh_model().resume_from_checkpoint(path) == {"step": 1}


@pytest.mark.parametrize("name", ["optimizer.pt", "trainer_state.pt", "rng-rank0.pt"])
@pytest.mark.parametrize("rehash", [True, False], ids=["manifest-updated", "manifest-stale"])
def test_planted_pickle_is_refused_and_never_runs(tmp_path, name, rehash):
    path = _trained_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    rel = f"{checkpoint.STATE_DIR}/{name}"
    data = pickle.dumps({"state": _Payload(str(marker))})
    if rehash:
        _replace_and_rehash(path, rel, data)
    else:
        with open(os.path.join(path, rel), "wb") as fh:
            fh.write(data)
    # with a stale manifest the integrity check names the file first; otherwise weights_only refuses it
    expected = "refusing to load .*" if rehash else "checkpoint file .*"
    with pytest.raises(checkpoint.CheckpointError, match=expected + name.replace(".", r"\.")):
        _fresh_model().resume_from_checkpoint(path)
    assert not marker.exists()


def test_rng_state_round_trips():
    import random

    import numpy as np
    import torch

    state = checkpoint.capture_rng_state()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    checkpoint.restore_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
