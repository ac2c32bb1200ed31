"""``twinkle train RECIPE --runtime ray``: the job's ranks are Ray actors of one worker group.

Each actor runs the same per-rank code a ``torchrun`` worker runs, so logs, checkpoints and resume are the same
(a checkpoint written under one runtime resumes under the other). The controller (this process) waits on every
rank: when one dies, the others are stopped within seconds and the error names the rank; with
``--max-restarts N`` the group is rebuilt and the job resumes from its last complete checkpoint, up to N times.
Ray itself is imported only when a job launches.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_core.launch import Runtime, TrainJob

logger = logging.getLogger("twinkle.ray")

#: CPUs a local cluster offers beyond the trainer group's, for role actors (samplers, reward workers)
ROLE_CPUS = 4


class RayRuntime(Runtime):
    title = "Ray runtime (--runtime ray; pip install twinkle-ray)"

    def add_arguments(self, group: Any) -> None:
        group.add_argument("--ray-address", default=None, metavar="ADDR",
                           help="a running Ray cluster (HOST:PORT, or auto); default: RAY_ADDRESS when set, "
                                "else a local cluster started for this job and stopped after it")
        group.add_argument("--num-workers", type=int, default=1, metavar="N",
                           help="ranks, one Ray actor each (default 1)")
        group.add_argument("--cpus-per-worker", type=float, default=1.0, metavar="C",
                           help="CPUs reserved for each rank (default 1)")
        group.add_argument("--gpus-per-worker", type=float, default=0.0, metavar="G",
                           help="GPUs reserved for each rank (default 0)")
        group.add_argument("--placement", default="PACK", type=str.upper,
                           choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
                           help="how ranks are placed on nodes (Ray placement-group strategy; default PACK)")
        group.add_argument("--max-restarts", type=int, default=0, metavar="N",
                           help="when a rank dies, rebuild the group and resume from the last checkpoint, at "
                                "most N times (default 0: stop with the failing rank's error)")

    def world_size(self, args: argparse.Namespace) -> int | None:
        if args.num_workers < 1:
            raise ConfigError(f"--num-workers must be at least 1, got {args.num_workers}")
        if args.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
        return args.num_workers

    def launch(self, job: TrainJob, args: argparse.Namespace) -> int:
        from twinkle_core.commands.train import print_summary
        from twinkle_ray.cluster import connected

        # a local cluster's CPUs are scheduling tokens: the trainer group's, plus room for the actors a recipe adds
        # (a sampler, a reward pool), as torchrun would also start every process on a busy machine
        local_cpus = max(os.cpu_count() or 1, math.ceil(args.num_workers * args.cpus_per_worker)) + ROLE_CPUS
        with connected(args.ray_address, num_cpus=local_cpus):
            summary = run_with_restarts(job, args)
        if summary is not None:
            print_summary(summary)
        return 0


def run_with_restarts(job: TrainJob, args: argparse.Namespace) -> dict[str, Any] | None:
    """Run ``job`` on a fresh group; after a rank's death, again from the last checkpoint (``--max-restarts``)."""
    from twinkle_ray.worker_group import WorkerFailedError

    restarts = 0
    while True:
        try:
            return run_once(job, args)
        except WorkerFailedError as exc:
            if restarts >= args.max_restarts:
                raise
            restarts += 1
            job = resumed(job)
            print(f"twinkle: {exc}; restart {restarts}/{args.max_restarts} from "
                  f"{'the last checkpoint' if job.resume else 'the start (no checkpoint yet)'}", file=sys.stderr)


def run_once(job: TrainJob, args: argparse.Namespace) -> dict[str, Any] | None:
    from twinkle_ray.worker_group import WorkerGroup

    group = WorkerGroup(args.num_workers, role="trainer", cpus_per_worker=args.cpus_per_worker,
                        gpus_per_worker=args.gpus_per_worker, placement=args.placement)
    try:
        return group.run("run_training", job.worker_argv())[0]
    finally:
        group.shutdown()


def resumed(job: TrainJob) -> TrainJob:
    """The job that continues ``job`` after a failure: from the newest complete checkpoint of its run when one
    exists, else from the start again."""
    from twinkle_core.checkpoint import latest_checkpoint
    from twinkle_core.train.recipe import load_recipe

    recipe = load_recipe(job.recipe, list(job.overrides))
    if latest_checkpoint(recipe.train.output_dir) is None:
        return job
    return dataclasses.replace(job, resume="latest", resume_weights_only=None, overwrite=False)
