"""One training run per output directory: an exclusive lock held for the life of a run.

The main process (rank 0) takes :data:`LOCK_FILE` in ``output_dir`` with ``fcntl.flock`` before anything is
written there, and gives it back when the run ends, also on errors and signals (the kernel drops a flock when its
process dies, even on ``kill -9``). The file holds JSON naming the holder: ``pid``, ``host``, ``started`` (Unix
time) and ``run_id``. A second run on the same directory is refused at once with a
:class:`~twinkle_core.errors.ConfigError` naming that pid and host. The file is left behind only by a process that
died; the next run takes it over, with a warning, when it was written on this host by a pid no longer alive. A
file left by another host is refused (its process may still be running there on a file system whose locks do not
reach this host); the message says to delete it once that run is gone.

The lock file lies beside the checkpoints, never inside one (checkpoints are ``checkpoint-N`` subdirectories), so
it is in no checkpoint's manifest and does not change what ``--resume`` finds.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError

logger = logging.getLogger("twinkle.train")

#: the lock file's name in the output directory
LOCK_FILE = ".twinkle.lock"


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one owned by another user counts as running)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_holder(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a lock file says about its holder (``{}`` when it is empty or unreadable)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return {}
    try:
        holder = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def describe_holder(holder: dict[str, Any]) -> str:
    """``pid 123 on host 'a' (started 2026-01-01 10:00:00, run 1a2b...)`` from a lock file's JSON."""
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')!r} (started {when}, run {holder.get('run_id', '?')})"


class RunLock:
    """The exclusive lock on one output directory. ``acquire()`` takes it or raises ConfigError; ``release()``
    gives it back and removes the file. Also a context manager."""

    def __init__(self, output_dir: str | os.PathLike[str], *, run_id: str | None = None) -> None:
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILE
        #: this run's id, written into the lock file
        self.run_id = run_id or uuid.uuid4().hex
        self.holder: dict[str, Any] = {}
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> RunLock:
        if self._fd is not None:
            return self
        import fcntl

        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"train.output_dir: cannot create {self.output_dir}: {exc.strerror or exc}; "
                              f"choose a directory you can write to") from exc
        for _ in range(10):  # the file can be removed by a finishing holder between our open and our flock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise ConfigError(f"train.output_dir: cannot lock {self.path}: {exc.strerror or exc}; "
                                      f"choose an output directory on a file system that supports flock") from exc
                raise self._busy(read_holder(self.path)) from None
            if self._same_file(fd):
                break
            os.close(fd)  # we locked a file that was removed meanwhile: try the one there now
        else:
            raise ConfigError(f"train.output_dir: could not take the lock {self.path} (it kept being replaced); "
                              f"is another run starting on {self.output_dir}?")
        try:
            self._take_over(read_holder(self.path))
            self._write(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the lock back (a no-op when not held). The file goes first, then the lock."""
        if self._fd is None:
            return
        import fcntl

        fd, self._fd = self._fd, None
        try:
            if self._same_file(fd):
                self.path.unlink(missing_ok=True)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    # ------------------------------------------------------------------ helpers
    def _same_file(self, fd: int) -> bool:
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino)

    def _busy(self, holder: dict[str, Any]) -> ConfigError:
        who = describe_holder(holder) if holder else "another process (its lock file is still being written)"
        return ConfigError(f"train.output_dir: {self.output_dir} is in use by another training run, {who}. Two runs "
                           f"on one output directory would overwrite each other's checkpoints, final model and logs: "
                           f"wait for that run to finish (or stop it), or choose another train.output_dir")

    def _take_over(self, previous: dict[str, Any]) -> None:
        """The flock was free, but a file naming a holder is left: its process died without cleaning up."""
        if not previous or previous.get("pid") == os.getpid() and previous.get("host") == socket.gethostname():
            return  # nothing left, or left by this very process (an earlier run here that could not remove it)
        pid, host = previous.get("pid"), previous.get("host")
        if host != socket.gethostname():
            raise ConfigError(f"train.output_dir: {self.output_dir} holds the lock file of a run on another host, "
                              f"{describe_holder(previous)}, whose process cannot be checked from here. If that run "
                              f"is no longer running, delete {self.path} and start again; otherwise wait for it or "
                              f"choose another train.output_dir")
        if isinstance(pid, int) and pid_alive(pid):
            logger.warning("taking over the lock %s: pid %d still runs on this host but no longer holds the lock "
                           "(its id was reused, or it is not a twinkle run any more)", self.path, pid)
        else:
            logger.warning("taking over the lock %s left by %s, which is no longer running", self.path,
                           describe_holder(previous))

    def _write(self, fd: int) -> None:
        self.holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                       "run_id": self.run_id}
        data = (json.dumps(self.holder) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
