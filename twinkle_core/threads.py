"""How many torch intra-op threads a Twinkle process computes with.

torch starts with one thread per core of the machine. That is the fastest choice on an idle machine, and the
slowest on a busy one: every small matrix product waits at an OpenMP barrier for its slowest thread, and a
thread that shares its core with another process is slow. Measured on a 2-core machine (the quickstart,
``train.max_steps=30``, whole command): at a 1-minute load average of 1.5-5.5 from other processes one thread took
25-39 s and two 67-145 s (2.5-3.8x); at 0.9-1.7, 15.7-16.3 s and 34.9-52.9 s.

So unless the user chose (``OMP_NUM_THREADS``, or ``TWINKLE_TEST_THREADS`` of the test harness), each process
takes its share of the cores that are free when it starts: the cores available to the job
(``os.sched_getaffinity``, lowered by a cgroup CPU quota) minus the load average of the last minute, rounded to
whole cores, divided by the processes of the job on this machine (``LOCAL_WORLD_SIZE``), at least 1 and at most
its share of all the available cores: on 2 cores, 2 threads only while other processes use less than half a core.
The choice is made once, when the process starts computing. It says what it chose in one log line, and warns when the machine is oversubscribed (load
average above the cores available).

``twinkle train`` / ``chat`` / ``eval`` call :func:`configure_threads` where their computing starts (each rank
of a launched job included); the Python API leaves the threads of the program that calls it alone
(call :func:`configure_threads` yourself for the same choice). The torchrun launcher passes its ranks
:func:`launcher_env`, so that torchrun's own default (``OMP_NUM_THREADS=1`` for every rank, with a warning) is
not mistaken for the user's choice.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("twinkle.threads")

#: the thread count the user chose for every torch process
USER_VARIABLE = "OMP_NUM_THREADS"
#: the thread count of the test harness (:func:`twinkle_core.testing.torchrun.thread_env`)
TEST_VARIABLE = "TWINKLE_TEST_THREADS"
#: set by the launcher beside the ``OMP_NUM_THREADS`` it gives its ranks: that value is not the user's
LAUNCHER_VARIABLE = "TWINKLE_LAUNCHER_OMP_NUM_THREADS"


@dataclass(frozen=True)
class ThreadChoice:
    """The threads a process computes with and why."""

    threads: int
    #: ``OMP_NUM_THREADS``, ``TWINKLE_TEST_THREADS`` or ``auto``
    source: str
    cores: int
    processes: int
    #: the 1-minute load average when the choice was made (None: not known on this system)
    load: float | None

    @property
    def oversubscribed(self) -> bool:
        return self.load is not None and self.load > self.cores

    def message(self) -> str:
        cores = f"{self.cores} core{'s' if self.cores != 1 else ''}"
        where = f"{cores} available, {self.processes} process{'es' if self.processes != 1 else ''} on this machine"
        load = f", load average {self.load:.1f}" if self.load is not None else ""
        if self.source == "auto":
            return f"torch threads: {self.threads} ({where}{load}; set {USER_VARIABLE} to override)"
        return f"torch threads: {self.threads} (from {self.source}; {where}{load})"

    def oversubscription_warning(self) -> str | None:
        """What to say when other processes already keep every available core busy; None when they do not."""
        if not self.oversubscribed:
            return None
        busy = (f"the machine is oversubscribed: load average {self.load:.1f} over the last minute on "
                f"{self.cores} available core{'s' if self.cores != 1 else ''}, so steps run slower while that lasts")
        if self.threads == 1:
            return f"{busy}; this process uses 1 thread"
        return (f"{busy}; with {self.threads} threads torch also waits for the ones other processes hold up: set "
                f"{USER_VARIABLE}=1 (fewer threads are faster on a busy machine)")


def cgroup_cpu_limit(sysfs: str | os.PathLike[str] = "/sys/fs/cgroup",
                     proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup") -> int | None:
    """The whole CPUs the cgroup quota of this process allows (at least 1); None without a quota.

    cgroup v2 (``cpu.max``) and v1 (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), on this process's cgroup and
    its ancestors (the smallest quota counts). A fractional quota is rounded down: 1.5 CPUs give 1 thread."""
    root = Path(sysfs)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = []
    limits: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            for directory in _ancestors(root, path):
                limits += _quota_v2(directory / "cpu.max")
        elif "cpu" in controllers.split(","):
            for mount in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                for directory in _ancestors(root / mount, path):
                    limits += _quota_v1(directory)
    return max(1, math.floor(min(limits))) if limits else None


def _ancestors(mount: Path, path: str) -> list[Path]:
    """``mount/path`` and each parent up to ``mount`` (a container sees its own cgroup as ``/``)."""
    parts = [part for part in path.strip("/").split("/") if part]
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _quota_v2(path: Path) -> list[float]:
    try:
        quota, _, period = path.read_text().strip().partition(" ")
    except OSError:
        return []
    if quota == "max" or not period:
        return []
    return [int(quota) / int(period)]


def _quota_v1(directory: Path) -> list[float]:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return []
    return [quota / period] if quota > 0 and period > 0 else []


def available_cores() -> int:
    """The cores this process may run on (its affinity, else every core), lowered by a cgroup CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity on this platform (macOS, Windows)
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    return max(1, min(cores, quota) if quota is not None else cores)


def load_average() -> float | None:
    """The load average of the last minute; None where the system has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def local_processes(environ: Mapping[str, str] | None = None) -> int:
    """The processes of this job on this machine: ``LOCAL_WORLD_SIZE`` (torchrun, Ray runtime), else 1."""
    environ = os.environ if environ is None else environ
    value = environ.get("LOCAL_WORLD_SIZE", "1")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def explicit_threads(environ: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """The thread count the user (``OMP_NUM_THREADS``) or the test harness (``TWINKLE_TEST_THREADS``) chose, and
    which; None when neither did. The ``OMP_NUM_THREADS`` a launcher set for its ranks (:func:`launcher_env`) is
    not a choice. A value that is not a positive integer is refused with the fix."""
    from twinkle_core.errors import ConfigError

    environ = os.environ if environ is None else environ
    for name in (USER_VARIABLE, TEST_VARIABLE):
        raw = environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        if name == USER_VARIABLE and environ.get(LAUNCHER_VARIABLE) == raw:
            continue
        value = raw.split(",")[0].strip()  # OpenMP's nested form "4,2": the outer level is torch's
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"{name}={raw!r} is not a positive number of threads; set it to 1 or more, or unset "
                              f"it to let Twinkle choose from the cores available")
        return int(value), name
    return None


def auto_threads(cores: int, processes: int, load: float | None) -> int:
    """The free cores (``cores`` minus ``load``, rounded to the nearest whole core) per process, at least 1 and at
    most ``cores // processes`` (without a load average: ``cores // processes``, as torchrun divides)."""
    share = max(1, cores // max(1, processes))
    if load is None:
        return share
    free = math.floor(cores - load + 0.5)
    return max(1, min(share, free // max(1, processes)))


def choose_threads(environ: Mapping[str, str] | None = None) -> ThreadChoice:
    """What :func:`configure_threads` applies: an explicit choice, else :func:`auto_threads` on this machine's
    :func:`available_cores` and :func:`load_average`."""
    environ = os.environ if environ is None else environ
    cores, load, processes = available_cores(), load_average(), local_processes(environ)
    explicit = explicit_threads(environ)
    if explicit is not None:
        return ThreadChoice(explicit[0], explicit[1], cores, processes, load)
    return ThreadChoice(auto_threads(cores, processes, load), "auto", cores, processes, load)


def configure_threads(environ: Mapping[str, str] | None = None, *,
                      say: Callable[[str], None] | None = None) -> ThreadChoice:
    """Set torch's intra-op threads for this process (:func:`choose_threads`), log the choice in one line and warn
    when the machine is oversubscribed (once per machine: the first local process). ``say``: where both lines go
    instead of the ``twinkle.threads`` logger (a command that prints its notes itself). Returns the choice."""
    import torch

    environ = os.environ if environ is None else environ
    choice = choose_threads(environ)
    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    (say or logger.info)(choice.message())
    warning = choice.oversubscription_warning()
    if warning is not None and environ.get("LOCAL_RANK", "0") == "0":
        (say or logger.warning)(warning)
    return choice


@contextlib.contextmanager
def threads_for_run(environ: Mapping[str, str] | None = None) -> Iterator[ThreadChoice]:
    """:func:`configure_threads` for the length of a run; the thread count before it comes back afterwards (a
    program or test that runs ``twinkle`` in its own process keeps its own setting)."""
    import torch

    before = torch.get_num_threads()
    try:
        yield configure_threads(environ)
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def launcher_env(processes: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a launcher of ``processes`` ranks on this machine adds to their environment: when the user set no
    ``OMP_NUM_THREADS``, this launch's choice for it (so torchrun does not set its own default of 1 with a warning)
    marked as the launcher's (each rank then chooses for itself, :func:`explicit_threads`). Empty when the user
    chose."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(USER_VARIABLE, "").strip()
    if chosen and environ.get(LAUNCHER_VARIABLE) != chosen:
        return {}
    threads = str(auto_threads(available_cores(), processes, load_average()))
    return {USER_VARIABLE: threads, LAUNCHER_VARIABLE: threads}


__all__ = ["LAUNCHER_VARIABLE", "TEST_VARIABLE", "USER_VARIABLE", "ThreadChoice", "auto_threads",
           "available_cores", "cgroup_cpu_limit", "choose_threads", "configure_threads", "explicit_threads",
           "launcher_env", "load_average", "local_processes", "threads_for_run"]
