"""Checkpoint integrity: a manifest of sizes and hashes, staging cleaned up on failure, a full disk named."""

from __future__ import annotations

import errno
import json
import logging
import os

import pytest

from twinkle_core import checkpoint
from twinkle_core.testing.conformance import make_batch
from twinkle_core.testing.reference import make_reference_model

WEIGHTS = "model.safetensors"


def _model(seed: int = 0):
    model = make_reference_model(seed=seed)
    model.set_optimizer("AdamW", lr=1e-2)
    return model


def _save(tmp_path, name: str = "checkpoint-1", model=None) -> str:
    model = model or _model()
    model.forward_backward(inputs=make_batch(1))
    model.clip_grad_and_step(max_grad_norm=1.0)
    return model.save(name, output_dir=str(tmp_path), extra_state={"step": 1})


def test_marker_lists_every_file_with_size_and_hash(tmp_path):
    path = _save(tmp_path)
    files = json.loads(open(os.path.join(path, checkpoint.MARKER)).read())["files"]
    assert WEIGHTS in files and f"{checkpoint.STATE_DIR}/rng-rank0.pt" in files
    for rel, entry in files.items():
        assert os.path.getsize(os.path.join(path, rel)) == entry["size"]
        assert len(entry["sha256"]) == 64
    checkpoint.verify_checkpoint(path)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def _truncate(file_path):
    with open(file_path, "r+b") as fh:
        fh.truncate(os.path.getsize(file_path) // 2)


def _zero(file_path):
    size = os.path.getsize(file_path)
    with open(file_path, "wb") as fh:
        fh.write(b"\0" * size)


def _flip_byte(file_path):
    with open(file_path, "r+b") as fh:
        fh.seek(os.path.getsize(file_path) - 3)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))


def _garbage(file_path):
    with open(file_path, "wb") as fh:
        fh.write(b"not a torch file")


@pytest.mark.parametrize(("rel", "damage"), [
    (WEIGHTS, _truncate), (WEIGHTS, _zero), (WEIGHTS, _flip_byte),
    (f"{checkpoint.STATE_DIR}/rng-rank0.pt", os.remove),
    (f"{checkpoint.STATE_DIR}/trainer_state.pt", _garbage),
], ids=["truncated", "zeroed", "flipped-byte", "rng-deleted", "garbage-trainer-state"])
def test_damaged_checkpoint_is_one_clear_error(tmp_path, rel, damage):
    path = _save(tmp_path)
    damage(os.path.join(path, rel))
    name = os.path.basename(rel).replace(".", r"\.")
    with pytest.raises(checkpoint.CheckpointError, match=name):
        checkpoint.verify_checkpoint(path)
    with pytest.raises(checkpoint.CheckpointError, match=name):
        _model(seed=3).resume_from_checkpoint(path)


def test_missing_rng_file_is_an_error_even_without_a_manifest(tmp_path):
    path = _save(tmp_path)
    marker = os.path.join(path, checkpoint.MARKER)
    meta = json.loads(open(marker).read())
    del meta["files"]  # as an older Twinkle wrote it
    with open(marker, "w") as fh:
        json.dump(meta, fh)
    os.remove(os.path.join(path, checkpoint.STATE_DIR, "rng-rank0.pt"))
    with pytest.raises(checkpoint.CheckpointError, match=r"rng-rank0\.pt is missing"):
        _model(seed=3).resume_from_checkpoint(path)


def test_latest_checkpoint_falls_back_past_a_corrupt_one(tmp_path, caplog):
    model = _model()
    good = _save(tmp_path, "checkpoint-1", model)
    newest = _save(tmp_path, "checkpoint-2", model)
    _flip_byte(os.path.join(newest, WEIGHTS))
    with caplog.at_level(logging.WARNING, logger="twinkle_core.checkpoint"):
        assert str(checkpoint.latest_checkpoint(tmp_path)) == good
    assert WEIGHTS in caplog.text and "checkpoint-2" in caplog.text


def test_failure_mid_save_removes_staging_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = _model()
    path = _save(tmp_path, "checkpoint-1", model)
    before = open(os.path.join(path, WEIGHTS), "rb").read()

    def fail(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(model.strategy, "save_optimizer_state", fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        _save(tmp_path, "checkpoint-1", model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]
    assert open(os.path.join(path, WEIGHTS), "rb").read() == before
    checkpoint.verify_checkpoint(path)


def test_disk_full_is_one_clear_error(tmp_path, monkeypatch):
    import torch

    model = _model()
    path = _save(tmp_path, "checkpoint-1", model)
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if str(f).endswith("trainer_state.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(checkpoint.CheckpointError, match="no space left on device.*full") as info:
        _save(tmp_path, "checkpoint-2", model)
    assert str(tmp_path) in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]
    checkpoint.verify_checkpoint(path)
    assert str(checkpoint.latest_checkpoint(tmp_path)) == path


@pytest.fixture
def small_tmpfs(tmp_path):
    """Mount a tmpfs of a given size (needs CAP_SYS_ADMIN; skipped with the reason otherwise)."""
    import subprocess

    mounted = []

    def mount(size_bytes: int):
        target = tmp_path / f"tmpfs{len(mounted)}"
        target.mkdir()
        pages = -(-size_bytes // 4096)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={pages * 4}k", "tmpfs", str(target)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({(done.stderr or done.stdout).strip()}); the disk-full "
                        f"case is covered by test_disk_full_is_one_clear_error with a simulated ENOSPC")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", "-l", str(target)], check=False)  # lazy: a failed writer may still hold a file


def test_a_really_full_disk_is_one_clear_error_and_keeps_the_previous_checkpoint(tmp_path, small_tmpfs):
    model = _model()
    probe = _save(tmp_path / "probe", "checkpoint-1", model)
    size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(probe) for f in files)
    disk = small_tmpfs(int(size * 1.6))  # room for one checkpoint, not for a second one staged next to it
    first = model.save("checkpoint-1", output_dir=str(disk), extra_state={"step": 1})
    with pytest.raises(checkpoint.CheckpointError, match="no space left on device") as info:
        model.save("checkpoint-2", output_dir=str(disk), extra_state={"step": 2})
    assert str(disk) in str(info.value)
    assert sorted(p.name for p in disk.iterdir()) == ["checkpoint-1"]  # no staging directory left behind
    checkpoint.verify_checkpoint(first)
    assert str(checkpoint.latest_checkpoint(disk)) == first
