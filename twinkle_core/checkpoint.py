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
Markers written inside :func:`run_lineage` also record the run's id and save time, so that
:func:`latest_checkpoint` keeps to the checkpoints of the run that saved last. :func:`previous_run` says what an
earlier run left in an output directory (its checkpoints, its ``final`` model and its id), which a new run there
must not silently mix with (``twinkle train --overwrite``).

A checkpoint directory holding Twinkle's training state (``twinkle_state/``) but no marker lost its marker
(:func:`lost_marker`: deleted, or left out of a copy): its files cannot be verified, so :func:`latest_checkpoint`
skips it with a warning and resuming from it by path is refused.
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
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_core import distributed
from twinkle_core.accelerator import Accelerator, current_accelerator
from twinkle_core.checkpoint_layout import CheckpointLayout
from twinkle_core.errors import TwinkleError

logger = logging.getLogger(__name__)

MARKER = CheckpointLayout.MARKER
STATE_DIR = CheckpointLayout.STATE_DIR
#: the directory name of a run's trained model, written at its end
FINAL_NAME = "final"
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)(-interrupted)?$")
#: the run id written into the markers of this context (:func:`run_lineage`)
_LINEAGE: ContextVar[str | None] = ContextVar("twinkle_checkpoint_lineage", default=None)


@contextmanager
def run_lineage(run_id: str | None) -> Iterator[None]:
    """Every checkpoint marker written inside the block records ``run_id`` (and when it was saved), so that
    :func:`latest_checkpoint` resumes a run's own checkpoints and not another run's in the same directory."""
    token = _LINEAGE.set(run_id)
    try:
        yield
    finally:
        _LINEAGE.reset(token)


def read_marker(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The marker of the checkpoint at ``path`` without its file list (``{}`` when it is missing or unreadable)."""
    try:
        with open(os.path.join(path, MARKER)) as fh:
            marker = json.load(fh)
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in marker.items() if k != "files"} if isinstance(marker, dict) else {}


class CheckpointError(TwinkleError, RuntimeError):
    """A checkpoint that cannot be written (disk full) or read back (missing, short, corrupt or unsafe file)."""


@contextmanager
def atomic_directory(final_path: str, *, is_main: bool, metadata: dict[str, Any] | None = None,
                     marker: str = MARKER) -> Iterator[str]:
    """Yield a temporary directory that becomes ``final_path`` when the block succeeds (on all ranks), with
    ``marker`` (every file's size and sha256, and ``metadata``) written last.

    On any failure the staging directory is removed and an existing ``final_path`` stays as it was. ``marker``
    names what the directory is: a training checkpoint (:data:`MARKER`) or another kind (an export)."""
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
            files = manifest(staging, marker=marker, sync=True)
            lineage = {"run_id": _LINEAGE.get(), "saved_at": time.time()} if _LINEAGE.get() else {}
            _write_synced(os.path.join(staging, marker),
                          json.dumps({"format": 2, **lineage, **(metadata or {}), "files": files}, indent=2,
                                     default=str))
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


def _files(root: str, marker: str) -> list[str]:
    """Every file under ``root`` except the marker, as sorted ``/``-separated relative paths."""
    found = []
    for directory, _, names in os.walk(root):
        for file_name in names:
            rel = os.path.relpath(os.path.join(directory, file_name), root).replace(os.sep, "/")
            if rel != marker:
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


def manifest(root: str | os.PathLike[str], *, marker: str = MARKER, sync: bool = False) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "sha256"}}`` of every file under ``root`` but ``marker`` (``/``-separated,
    sorted); ``sync`` also flushes each file to disk (other ranks wrote them)."""
    root = os.fspath(root)
    return {rel: {"size": os.path.getsize(os.path.join(root, rel)),
                  "sha256": _sha256(os.path.join(root, rel), sync=sync)}
            for rel in _files(root, marker)}


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
    verify_files(path)


def verify_files(path: str | os.PathLike[str], *, marker: str = MARKER) -> int | None:
    """Check every file the ``marker`` of the directory at ``path`` lists (size, then sha256); return how many, or
    ``None`` for a marker of an older format that lists none. Raises :class:`CheckpointError` naming the first
    missing, short or altered file."""
    path = os.fspath(path)
    marker_path = os.path.join(path, marker)
    try:
        with open(marker_path) as fh:
            files = json.load(fh).get("files")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{marker_path} is corrupt: {exc}") from exc
    if files is None:
        return None
    if not isinstance(files, dict):
        raise CheckpointError(f"{marker_path} is corrupt: its 'files' entry is not a mapping")
    for rel, expected in files.items():
        file_path = os.path.join(path, *str(rel).split("/"))
        if not isinstance(expected, dict):
            raise CheckpointError(f"{marker_path} is corrupt: it records no size and sha256 for {rel}")
        if not os.path.isfile(file_path):
            raise CheckpointError(f"checkpoint file {file_path} is missing")
        size = os.path.getsize(file_path)
        if size != expected.get("size"):
            raise CheckpointError(f"checkpoint file {file_path} is {size} bytes, but {expected.get('size')} were "
                                  f"written: the file is truncated or was replaced")
        if _sha256(file_path) != expected.get("sha256"):
            raise CheckpointError(f"checkpoint file {file_path} is corrupt: its sha256 does not match the one "
                                  f"recorded in {marker}")
    return len(files)


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


def _newest_run_id(paths: list[Path]) -> str | None:
    """The run id of whichever of ``paths`` was saved last (None when no marker records one)."""
    saved = []
    for path in paths:
        marker = read_marker(path)
        if marker.get("run_id") and isinstance(marker.get("saved_at"), (int, float)):
            saved.append((marker["saved_at"], marker["run_id"]))
    return max(saved)[1] if saved else None


def latest_lineage(output_dir: str | os.PathLike[str]) -> str | None:
    """The run id of the checkpoint saved last under ``output_dir`` (None when no marker records one)."""
    return _newest_run_id([path for _, _, path in list_checkpoints(output_dir)])


def lost_marker(path: str | os.PathLike[str]) -> bool:
    """Whether the directory at ``path`` holds Twinkle's training state (``twinkle_state/``) but no marker: a
    checkpoint written by :func:`atomic_directory` (which writes the marker last) whose marker was then deleted or
    left out of a copy. Its files cannot be verified. A directory with neither is another implementation's format
    (or an exported model) and is not judged here."""
    return os.path.isdir(os.path.join(path, STATE_DIR)) and not is_complete(os.fspath(path))


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint under ``output_dir`` that passes :func:`verify_checkpoint`; broken ones are skipped
    with a warning, and so are those that lost their marker (:func:`lost_marker`). Other directories without a
    marker were not written by :func:`atomic_directory` (another model implementation's format) and cannot be
    checked here, so they count as they are.

    When the markers record run ids (:func:`run_lineage`), only the checkpoints of the run that saved last are
    candidates: a later step of an older run in the same directory is another run's state, skipped with a warning
    that says how to resume it explicitly."""
    lineage = latest_lineage(output_dir)
    for _, _, path in reversed(list_checkpoints(output_dir)):
        run_id = read_marker(path).get("run_id") if lineage is not None else None
        if run_id is not None and run_id != lineage:
            logger.warning("skipping checkpoint %s: it belongs to run %s, not to run %s that saved last here; "
                           "to continue that run, resume it by path (--resume %s)", path, run_id, lineage, path)
            continue
        if lost_marker(path):
            logger.warning("skipping checkpoint %s: its marker %s is missing (deleted, or left out of a copy), so "
                           "its files cannot be verified", path, MARKER)
            continue
        if not is_complete(str(path)):
            return path
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            logger.warning("skipping checkpoint %s: %s", path, exc)
            continue
        return path
    return None


def marker_problem(path: str | os.PathLike[str]) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed from for want of its marker (None: it has one). A checkpoint
    that lost it (:func:`lost_marker`) and a directory that never had one are told apart, each with its fix."""
    path = os.fspath(path)
    if is_complete(path):
        return None
    if not os.path.isdir(path):
        return f"checkpoint {path} does not exist"
    if lost_marker(path):
        return (f"{path} has lost its marker {MARKER} (deleted, or left out when the directory was copied), so its "
                f"files cannot be verified and it is not resumed from. Resume from another checkpoint (twinkle train "
                f"--resume latest skips this one), or put the marker back from the original copy")
    return (f"{path} is not a Twinkle training checkpoint: it has no {MARKER} (a save that did not finish, or a "
            f"directory of another kind; an exported model's weights load with load())")


def check_marker(path: str | os.PathLike[str]) -> None:
    """Raise :class:`CheckpointError` with :func:`marker_problem`'s reason when the checkpoint at ``path`` has no
    marker; cheap (nothing is hashed, :func:`verify_checkpoint` does that)."""
    problem = marker_problem(path)
    if problem is not None:
        raise CheckpointError(problem)


@dataclass(frozen=True)
class PreviousRun:
    """What an earlier run left in an output directory: its checkpoints (``checkpoint-N`` and
    ``checkpoint-N-interrupted``, oldest first), its ``final`` model, and the run id their markers record (``None``
    when none records one: markers of an older Twinkle, or another model implementation's format). ``records``: the
    files the trainer reads as a run's trace besides checkpoints (its log, :func:`twinkle_core.train.checkpointing.
    check_start` fills them in), so a run that stopped before its first checkpoint counts too."""

    output_dir: Path
    checkpoints: tuple[Path, ...]
    final: Path | None
    run_id: str | None
    records: tuple[Path, ...] = ()

    @property
    def paths(self) -> list[Path]:
        """The checkpoint directories, then ``final``."""
        return [*self.checkpoints, *([self.final] if self.final is not None else [])]

    @property
    def label(self) -> str:
        """``run 1a2b...``, or ``an earlier run`` when no marker records its id."""
        return f"run {self.run_id}" if self.run_id else "an earlier run"

    def describe(self, most: int = 4) -> str:
        """``run 1a2b... (checkpoint-2, checkpoint-4, final)``, naming at most ``most`` directories (the records when
        there are none: ``an earlier run (logs.jsonl)``)."""
        names = [path.name for path in self.paths or self.records]
        shown = ", ".join(names if len(names) <= most else [*names[:most - 1], "...", names[-1]])
        count = f"; {len(names)} in all" if len(names) > most else ""
        return f"{self.label} ({shown}{count})"


def previous_run(output_dir: str | os.PathLike[str]) -> PreviousRun | None:
    """The checkpoints and ``final`` model an earlier run left under ``output_dir``, complete or not; None when
    there are none. Read-only and quick: it lists directories and reads markers, hashing nothing."""
    root = Path(output_dir)
    checkpoints = tuple(path for _, _, path in list_checkpoints(root) if path.is_dir())
    final = root / FINAL_NAME if (root / FINAL_NAME).is_dir() else None
    if not checkpoints and final is None:
        return None
    run_id = _newest_run_id([*checkpoints, *([final] if final is not None else [])])
    return PreviousRun(output_dir=root, checkpoints=checkpoints, final=final, run_id=run_id)


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
