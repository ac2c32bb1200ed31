"""``twinkle train --runtime ray`` against ``--nproc-per-node``: the same job, another runtime.

The quickstart recipe, shrunk to 12 steps with DDP on 2 ranks, run as a user runs it (a subprocess of the
``twinkle`` command, each Ray run starting and stopping its own local cluster on loopback):
* the same losses as torchrun's, step for step;
* a checkpoint written under Ray resumes under torchrun with the uninterrupted run's losses;
* a rank killed with SIGKILL stops the job within seconds, naming the rank, with no process left behind; with
  ``--max-restarts 1`` the group is rebuilt and the job resumes from its last checkpoint with the uninterrupted
  run's losses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from twinkle_core.testing.tolerance import sum_tolerance
from twinkle_core.testing.torchrun import free_port, thread_env

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "quickstart" / "recipe.yaml"
STEPS = 12
SMALL = (f"train.max_steps={STEPS}", "train.log_every=1", "train.save_every=3", "train.save_total_limit=null",
         "train.eval_before_training=false", "train.eval_every=null", "train.evaluate_options.limit=4",
         "strategy.name=ddp", "data.batch_size=8")
RAY = ("--runtime", "ray", "--num-workers", "2")


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "RAY_ADDRESS")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1",
                "TOKENIZERS_PARALLELISM": "false", "TWINKLE_TENSORBOARD": "0", **thread_env()})
    return env


def command(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "twinkle_core.cli", "train", str(RECIPE), f"train.output_dir={out}", *SMALL, *args]


def run(out: Path, *args: str, timeout: float = 420) -> subprocess.CompletedProcess:
    result = subprocess.run(command(out, *args), capture_output=True, text=True, timeout=timeout, env=environment())
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return result


def torchrun(out: Path, *args: str) -> subprocess.CompletedProcess:
    return run(out, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args)


def losses(out: Path) -> dict[int, float]:
    """The loss of every step; a step logged twice (before a failure and again after the resume) keeps the last."""
    lines = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines() if line.strip()]
    return {line["step"]: line["loss"] for line in lines if line.get("event") == "train"}


def worker_pids() -> list[int]:
    """The processes of Ray actors running a training rank (Ray titles them after the actor and its task)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if title.startswith("ray::TwinkleWorker"):
                pids.append(int(entry.name))
    return pids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_gone(pids: list[int], seconds: float = 30.0) -> list[int]:
    """The pids still alive after up to ``seconds`` (a stopped cluster's processes exit asynchronously)."""
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [pid for pid in pids if alive(pid)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("torchrun") / "out"
    torchrun(out)
    steps = losses(out)
    assert sorted(steps) == list(range(1, STEPS + 1)), steps
    return steps


def assert_same_losses(got: dict[int, float], want: dict[int, float]) -> float:
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    # both runs do the same arithmetic in the same order; the floor is the rounding of a mean over a step's tokens
    floor = sum_tolerance(8 * 128, max(want.values()))
    delta = max(abs(got[s] - want[s]) for s in want)
    assert delta <= floor, f"losses differ by {delta:.3g} (> {floor:.3g}):\n{got}\n{want}"
    return delta


def test_ray_runtime_gives_torchruns_losses_and_its_checkpoints_resume_under_torchrun(reference, tmp_path):
    out = tmp_path / "ray"
    start = time.monotonic()
    result = run(out, *RAY)
    print(f"ray run: {time.monotonic() - start:.1f} s")
    assert "twinkle: done at step 12/12" in result.stdout, result.stdout
    print(f"max |loss ray - loss torchrun| = {assert_same_losses(losses(out), reference):.3g}")
    assert (out / "final" / "model.safetensors").is_file()
    assert wait_gone(worker_pids()) == [], "a rank outlived its job"

    # the runtime is a launcher only: a checkpoint written under Ray continues under torchrun
    torchrun(out, "--resume", str(out / "checkpoint-6"))
    assert_same_losses(losses(out), reference)


def start_and_kill_a_rank(out: Path, *args: str) -> tuple[subprocess.Popen, list[int], float]:
    """Start a Ray job, kill rank 1's actor with SIGKILL once checkpoint-3 exists; the job, the pids seen, and
    when the kill happened."""
    job = subprocess.Popen(command(out, *RAY, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=environment(), start_new_session=True)
    deadline = time.monotonic() + 300
    while not (out / "checkpoint-3").is_dir():
        if job.poll() is not None or time.monotonic() > deadline:
            os.killpg(job.pid, signal.SIGKILL)
            out_text, err_text = job.communicate()
            pytest.fail(f"the job ended or stalled before checkpoint-3:\n{(out_text + err_text)[-4000:]}")
        time.sleep(0.05)
    pids = worker_pids()
    assert len(pids) == 2, pids
    os.kill(max(pids), signal.SIGKILL)
    return job, pids, time.monotonic()


def finish(job: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        out_text, err_text = job.communicate(timeout=timeout)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return job.returncode, out_text + err_text


def test_a_killed_rank_stops_the_job_within_seconds_naming_it_and_leaves_nothing(tmp_path):
    job, pids, killed_at = start_and_kill_a_rank(tmp_path / "out")
    code, text = finish(job)
    elapsed = time.monotonic() - killed_at
    assert code != 0, text[-4000:]
    assert "trainer rank" in text and "failed: the actor died" in text, text[-4000:]
    assert "Traceback" not in text.split("trainer rank")[-1], text[-4000:]  # one error line, not a traceback
    assert elapsed < 60, f"the job took {elapsed:.0f} s to stop after the kill"
    assert wait_gone(pids) == [], "a rank outlived the job"
    assert not (tmp_path / "out" / "final").exists()
    print(f"stopped {elapsed:.1f} s after the kill")


def test_max_restarts_rebuilds_the_group_and_resumes_with_the_uninterrupted_losses(reference, tmp_path):
    out = tmp_path / "out"
    job, _, _ = start_and_kill_a_rank(out, "--max-restarts", "1")
    code, text = finish(job)
    assert code == 0, text[-6000:]
    assert "restart 1/1 from the last checkpoint" in text, text[-4000:]
    assert "twinkle: done at step 12/12" in text, text[-4000:]
    assert_same_losses(losses(out), reference)


# other strategies: the same job under both runtimes, 3 steps each (the quickstart under FSDP2, the ZeRO-3 example,
# and the Megatron examples with tensor and pipeline parallelism over the 2 ranks)
STRATEGIES = {
    "native_fsdp": (RECIPE, "strategy.name=native_fsdp", "data.batch_size=8"),
    "deepspeed_zero3": (RECIPE.parents[1] / "zero3" / "recipe.yaml", "data.batch_size=4", "data.max_length=64"),
    "megatron_tp2": (RECIPE.parents[1] / "megatron" / "recipe_tp2.yaml", "data.batch_size=8", "data.max_length=64"),
    # the final evaluation's batch must split into PP's 4 micro-batches: 4 rows, not 2
    "megatron_pp2": (RECIPE.parents[1] / "megatron" / "recipe_pp2.yaml", "data.batch_size=8", "data.max_length=64",
                     "train.evaluate_options.limit=4"),
}


#: CI runs one strategy besides DDP (Megatron TP=2); FSDP2, ZeRO-3 and PP=2 under Ray run in the slow session
SLOW_STRATEGIES = ("native_fsdp", "deepspeed_zero3", "megatron_pp2")


@pytest.mark.parametrize("strategy", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_STRATEGIES else name
                                      for name in sorted(STRATEGIES)])
def test_other_strategies_give_torchruns_losses_under_ray(tmp_path, strategy):
    pytest.importorskip("twinkle_backend_megatron" if strategy.startswith("megatron") else "twinkle_backend_hf")
    recipe, *overrides = STRATEGIES[strategy]
    shared = ["train.max_steps=3", "train.log_every=1", "train.save_every=null", "train.eval_before_training=false",
              "train.eval_every=null", "train.evaluate_options.limit=2", *overrides]

    def train(out: Path, *launch: str) -> dict[int, float]:
        result = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(recipe),
                                 f"train.output_dir={out}", *shared, *launch],
                                capture_output=True, text=True, timeout=420, env=environment())
        assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
        return losses(out)

    under_ray = train(tmp_path / "ray", *RAY)
    under_torchrun = train(tmp_path / "torchrun", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                           "--master-port", str(free_port()))
    assert sorted(under_ray) == list(range(1, len(under_ray) + 1)) and len(under_ray) >= 2, under_ray
    assert under_ray == under_torchrun, (under_ray, under_torchrun)  # the same arithmetic, another launcher
