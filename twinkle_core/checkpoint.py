"""Checkpoint directories that are complete or absent, the run's checkpoint policy, and RNG state capture.

A checkpoint is written into ``.NAME.incomplete`` beside its final place and renamed once every
rank has finished, so a crash mid-save never leaves a directory that looks complete. The marker
file ``twinkle_checkpoint.json`` is written last; it lists every file with its size and sha256, so
:func:`verify_checkpoint` can tell a truncated or corrupted checkpoint from a good one.

Checkpoint state files are data, never code: :func:`load_state_file` reads them with
``torch.load(weights_only=True)``, and :func:`capture_rng_state` stores plain types and tensors only.

A training run keeps its checkpoints in its output directory as ``checkpoint-N`` (after optimizer
step N) and ``checkpoint-N-interrupted`` (saved when training stopped early); see
:func:`checkpoint_name`, :func:`list_checkpoints`, :func:`latest_checkpoint` and :func:`prune_checkpoints`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from twinkle_core import distributed
from twinkle_core.accelerator import Accelerator, current_accelerator
from twinkle_core.checkpoint_layout import CheckpointLayout
from twinkle_core.errors import TwinkleError

logger = logging.getLogger(__name__)

MARKER = CheckpointLayout.MARKER
STATE_DIR = CheckpointLayout.STATE_DIR
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)(-interrupted)?$")


class CheckpointError(TwinkleError, RuntimeError):
    """A checkpoint that cannot be written (disk full) or read back (missing, short, corrupt or unsafe file)."""


@contextmanager
def atomic_directory(final_path: str, *, is_main: bool, metadata: dict[str, Any] | None = None) -> Iterator[str]:
    """Yield a temporary directory that becomes ``final_path`` when the block succeeds (on all ranks).

    On any failure the staging directory is removed and an existing ``final_path`` stays as it was."""
    parent, name = os.path.split(os.path.abspath(final_path))
    staging = os.path.join(parent, f".{name}.incomplete")
    try:
        if is_main:
            os.makedirs(parent, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        distributed.barrier()
        yield staging
        distributed.barrier()
        if is_main:
            # the manifest is computed once every rank has written its files (the barrier above)
            manifest = _manifest(staging)
            _write_synced(os.path.join(staging, MARKER),
                          json.dumps({"format": 2, **(metadata or {}), "files": manifest}, indent=2, default=str))
            _fsync_directories(staging)
            if os.path.exists(final_path):
                retired = os.path.join(parent, f".{name}.replaced")
                shutil.rmtree(retired, ignore_errors=True)
                os.replace(final_path, retired)
                os.replace(staging, final_path)
                shutil.rmtree(retired, ignore_errors=True)
            else:
                os.replace(staging, final_path)
            _fsync(parent)
    except BaseException as exc:
        # judged before the staging directory is removed, which frees the space again
        full = _is_disk_full(exc) or _out_of_space(parent)
        if is_main:
            shutil.rmtree(staging, ignore_errors=True)
        if full:
            raise CheckpointError(f"no space left on device: the disk holding {parent} is full, so checkpoint "
                                  f"{final_path} was not saved (any previous checkpoint there is intact); free "
                                  f"space or set a smaller save_total_limit") from exc
        raise
    distributed.barrier()


def _is_disk_full(exc: BaseException | None) -> bool:
    # torch.save and other writers wrap the OSError, so look down the chain of causes
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


#: a filesystem with less free space than this after a failed write is taken as full
_FULL_BELOW_BYTES = 64 * 1024


def _out_of_space(directory: str) -> bool:
    """Whether ``directory``'s filesystem is (nearly) full. torch.save on a full disk raises a bare
    RuntimeError ("iostream error", "unexpected pos") without the ENOSPC behind it, so look at the disk."""
    try:
        return shutil.disk_usage(directory).free < _FULL_BELOW_BYTES
    except OSError:
        return False


def _files(root: str) -> list[str]:
    """Every file under ``root`` except the marker, as sorted ``/``-separated relative paths."""
    found = []
    for directory, _, names in os.walk(root):
        for file_name in names:
            rel = os.path.relpath(os.path.join(directory, file_name), root).replace(os.sep, "/")
            if rel != MARKER:
                found.append(rel)
    return sorted(found)


def _sha256(path: str, *, sync: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
        if sync:
            # other ranks wrote these files; fsync flushes them to disk before the rename publishes them
            os.fsync(fh.fileno())
    return digest.hexdigest()


def _manifest(root: str) -> dict[str, dict[str, Any]]:
    return {rel: {"size": os.path.getsize(os.path.join(root, rel)), "sha256": _sha256(os.path.join(root, rel), sync=True)}
            for rel in _files(root)}


def _write_synced(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directories(root: str) -> None:
    for directory, _, _ in os.walk(root):
        _fsync(directory)


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def verify_on_main(path: str | os.PathLike[str], is_main: bool) -> None:
    """:func:`verify_checkpoint` on the main process only; every rank raises the same :class:`CheckpointError`
    (the main process reads every file once, the other ranks get its verdict instead of rereading it all)."""
    from twinkle_core import distributed

    problem = None
    if is_main:
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            problem = str(exc)
    problem = distributed.broadcast_object(problem)
    if problem is not None:
        raise CheckpointError(problem)


def verify_checkpoint(path: str | os.PathLike[str]) -> None:
    """Raise :class:`CheckpointError` naming the first missing, short or corrupt file of the checkpoint at ``path``.

    Checkpoints written before the marker listed its files (no ``files`` entry) are only checked for the marker."""
    path = str(path)
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise CheckpointError(f"{path} is not a complete Twinkle checkpoint: {marker} is missing (the save did not "
                              f"finish)")
    try:
        with open(marker) as fh:
            manifest = json.load(fh).get("files")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{marker} is corrupt: {exc}") from exc
    if manifest is None:
        return
    for rel, expected in manifest.items():
        file_path = os.path.join(path, *rel.split("/"))
        if not os.path.isfile(file_path):
            raise CheckpointError(f"checkpoint file {file_path} is missing")
        size = os.path.getsize(file_path)
        if size != expected["size"]:
            raise CheckpointError(f"checkpoint file {file_path} is {size} bytes, but {expected['size']} were "
                                  f"written: the file is truncated or was replaced")
        if _sha256(file_path) != expected["sha256"]:
            raise CheckpointError(f"checkpoint file {file_path} is corrupt: its sha256 does not match the one "
                                  f"recorded in {MARKER}")


def load_state_file(path: str, **kwargs: Any) -> Any:
    """``torch.load`` a Twinkle state file as data only (``weights_only=True``): a file that needs arbitrary
    unpickling (an old-format checkpoint, or a planted file) is refused with an error naming it."""
    import torch

    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"refusing to load {path}: it holds objects other than tensors and plain data, which "
                              f"Twinkle never writes (a checkpoint from an older Twinkle version, or a tampered "
                              f"file); details: {exc}") from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {exc}") from exc


def checkpoint_name(step: int, *, interrupted: bool = False) -> str:
    """The directory name of the checkpoint after optimizer step ``step``."""
    return f"checkpoint-{step}-interrupted" if interrupted else f"checkpoint-{step}"


def list_checkpoints(output_dir: str | os.PathLike[str]) -> list[tuple[int, bool, Path]]:
    """``(step, interrupted, path)`` of every checkpoint under ``output_dir``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _CHECKPOINT_NAME.match(child.name)
        if match:
            found.append((int(match.group(1)), bool(match.group(2)), child))
    # at equal steps the regular checkpoint counts as newer than an interrupted one
    return sorted(found, key=lambda item: (item[0], not item[1]))


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint under ``output_dir`` that passes :func:`verify_checkpoint`; broken ones are skipped
    with a warning. Directories without a marker were not written by :func:`atomic_directory` (another model
    implementation's format) and cannot be checked here, so they count as they are."""
    for _, _, path in reversed(list_checkpoints(output_dir)):
        if not is_complete(str(path)):
            return path
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            logger.warning("skipping checkpoint %s: %s", path, exc)
            continue
        return path
    return None


def prune_checkpoints(output_dir: str | os.PathLike[str], limit: int | None) -> list[Path]:
    """Keep the newest ``limit`` ``checkpoint-N`` directories; interrupted ones older than the
    newest kept checkpoint are superseded and go too. Returns what was removed."""
    if not limit:
        return []
    checkpoints = list_checkpoints(output_dir)
    regular = [c for c in checkpoints if not c[1]]
    doomed = regular[:-limit] if len(regular) > limit else []
    if regular:
        newest = regular[-1][0]
        doomed += [c for c in checkpoints if c[1] and c[0] <= newest]
    removed = []
    for _, _, path in doomed:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def capture_rng_state(accelerator: Accelerator | None = None) -> dict[str, Any]:
    """The python, numpy, torch and device RNG states as tensors and plain types (loadable with ``weights_only=True``).

    The device state is the accelerator's (default: :func:`~twinkle_core.accelerator.current_accelerator`),
    stored under its name (``cuda``, ``npu`` ...) when it has one.
    """
    import numpy as np
    import torch

    version, internal, gauss_next = random.getstate()
    bit_generator, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        # int64: numpy's uint32 keys fit, and every torch version loads int64 tensors
        "numpy": {"bit_generator": bit_generator, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
    }
    accelerator = accelerator if accelerator is not None else current_accelerator()
    device_state = accelerator.get_rng_state()
    if device_state is not None:
        state[accelerator.name] = device_state
    return state


def restore_rng_state(state: dict[str, Any], accelerator: Accelerator | None = None) -> None:
    """Undo :func:`capture_rng_state`; a device state saved by another accelerator is left alone."""
    import numpy as np
    import torch

    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["bit_generator"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    accelerator = accelerator if accelerator is not None else current_accelerator()
    if accelerator.name in state:
        accelerator.set_rng_state(state[accelerator.name])
