"""Runtimes: what starts the ranks of a ``twinkle train`` job.

A :class:`Runtime` is a plugin (``twinkle_register_runtimes``). It receives a :class:`TrainJob` (the recipe, its
overrides and the resume flags, already validated by the launching process) and starts one rank per process it
owns; each rank runs :func:`twinkle_core.commands.train.train_this_process` with ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` ... in its environment, so the trainer, logs, checkpoints and resume are the same whichever
runtime started it. The core registers ``torchrun``; ``twinkle-ray`` registers ``ray``::

    class MyRuntime(Runtime):
        def add_arguments(self, group):
            group.add_argument("--my-workers", type=int, default=2)
        def world_size(self, args):
            return args.my_workers
        def launch(self, job, args):
            ...  # start args.my_workers processes running job.worker_argv(); 0 when all succeeded
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from twinkle_core.errors import ConfigError, TwinkleError

DEFAULT_RUNTIME = "torchrun"


@dataclass(frozen=True)
class TrainJob:
    """One ``twinkle train`` invocation as every rank runs it."""

    recipe: str
    overrides: tuple[str, ...] = ()
    resume: str | None = None
    resume_weights_only: str | None = None
    overwrite: bool = False
    show_warnings: bool = False

    def worker_argv(self) -> list[str]:
        """``twinkle train`` arguments for one rank (no launcher flags: the rank trains in its own process)."""
        argv = ["train", os.path.abspath(self.recipe), *self.overrides]
        if self.resume:
            argv += ["--resume", self.resume]
        if self.resume_weights_only:
            argv += ["--resume-weights-only", self.resume_weights_only]
        if self.overwrite:
            argv.append("--overwrite")
        if self.show_warnings:
            argv.append("--show-warnings")
        return argv


class Runtime(ABC):
    """Starts a job's ranks. Built with no arguments; its module imports heavy dependencies in :meth:`launch`."""

    #: the flags this runtime reads, shown in ``twinkle train --help`` under its own heading
    title: ClassVar[str] = ""

    def add_arguments(self, group: Any) -> None:  # noqa: B027 - optional hook
        """Add this runtime's options to ``twinkle train`` through ``group`` (an argparse argument group; each
        runtime its own, non-clashing names)."""

    @abstractmethod
    def world_size(self, args: argparse.Namespace) -> int | None:
        """How many ranks the job will have, or ``None`` when this process trains alone (no launch)."""

    @abstractmethod
    def launch(self, job: TrainJob, args: argparse.Namespace) -> int:
        """Run ``job`` on :meth:`world_size` ranks; the exit status (0: every rank finished)."""


class TorchrunRuntime(Runtime):
    """``torch.distributed.run`` on this node (``--nproc-per-node``), or one node of several (``--nnodes``)."""

    title = "multi-process launch (torchrun)"

    def add_arguments(self, group: Any) -> None:
        group.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, metavar="N",
                           help="processes per node (default 1: train in this process)")
        group.add_argument("--nnodes", type=int, default=1, metavar="N", help="number of nodes (default 1)")
        group.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="R",
                           help="rank of this node (default 0)")
        group.add_argument("--master-addr", "--master_addr", default=None, metavar="ADDR",
                           help="address of the rank-0 node (default 127.0.0.1)")
        group.add_argument("--master-port", "--master_port", type=int, default=None, metavar="PORT",
                           help="port of the rank-0 node (default: a free port on one node, 29500 on several)")

    def world_size(self, args: argparse.Namespace) -> int | None:
        if args.nproc_per_node < 1 or args.nnodes < 1:
            raise ConfigError("--nproc-per-node and --nnodes must be at least 1")
        if not 0 <= args.node_rank < args.nnodes:
            raise ConfigError(f"--node-rank {args.node_rank} must be in 0..{args.nnodes - 1}")
        launching = args.nproc_per_node > 1 or args.nnodes > 1
        return args.nproc_per_node * args.nnodes if launching else None

    def launch(self, job: TrainJob, args: argparse.Namespace) -> int:
        """Run the job under torchrun; 1 when a rank failed (torchrun already printed its error)."""
        from torch.distributed import run as torchrun

        from twinkle_core.threads import launcher_env

        try:
            # the ranks choose their own torch threads (twinkle_core.threads): torchrun's default of 1 each, which
            # it announces with a warning, is replaced by this launch's choice, marked as not the user's
            with environment(launcher_env(args.nproc_per_node)):
                torchrun.main(torchrun_argv(args, job))
        except Exception as exc:  # ChildFailedError: torchrun already printed the failing rank's error
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            print(f"twinkle: error: distributed training failed: {type(exc).__name__}: {first}", file=sys.stderr)
            return 1
        return 0


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set (what the processes started meanwhile inherit), restored afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def torchrun_argv(args: argparse.Namespace, job: TrainJob) -> list[str]:
    """Arguments for ``torch.distributed.run.main``: launcher flags, then the worker command."""
    argv = [f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}"]
    if args.nnodes == 1 and args.master_addr is None and args.master_port is None:
        argv.append("--standalone")
    else:
        argv += [f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr or '127.0.0.1'}",
                 f"--master-port={args.master_port or 29500}"]
    return argv + ["-m", "twinkle_core.cli", *job.worker_argv()]


def load_runtimes(plugins: Any = None) -> tuple[dict[str, Runtime], dict[str, TwinkleError]]:
    """Every registered runtime, built (importing its module, which must be light), and the ones that failed to
    load with their error (named when a job asks for them; the others still work)."""
    from twinkle_core.plugins import get_plugins

    plugins = plugins if plugins is not None else get_plugins()
    runtimes: dict[str, Runtime] = {}
    broken: dict[str, TwinkleError] = {}
    for name, entry in sorted(plugins.records("runtime").items()):
        try:
            runtimes[name] = plugins.load_record("runtime", entry.record)()
        except TwinkleError as exc:  # PluginLoadError names the plugin and its distribution
            broken[name] = exc
    return runtimes, broken


def select_runtime(name: str, runtimes: dict[str, Runtime], broken: dict[str, TwinkleError]) -> Runtime:
    """The runtime called ``name``, or an error that lists the installed ones and the install for it."""
    if name in runtimes:
        return runtimes[name]
    if name in broken:
        raise broken[name]
    from twinkle_core.catalog import install_hint

    hint = install_hint("runtime", name)
    raise ConfigError(f"no runtime named {name!r} is installed (available: {', '.join(sorted(runtimes))})"
                      + (f"; {hint}" if hint else ""))
