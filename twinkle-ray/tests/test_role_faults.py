"""Killing a role's actor in a whole GRPO job under ``--runtime ray``:
* the sampler actor: the job stops within seconds with one error naming the sampler, leaving no actor behind;
  with ``--max-restarts 1`` the group (and a new sampler) is rebuilt and the job finishes from its last checkpoint;
* a reward-pool actor: Ray restarts the worker (a call it was in scores nan with a warning naming the reward), and
  the job trains on to the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_grpo_roles import REWARD, recipe

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

RAY = ("--runtime", "ray", "--num-workers", "2")
SAMPLER = {"name": "ray", "inner": {"name": "hf_generate", "copy_weights": True}}
POOL = [{"name": "ray_pool", "options": {"reward": REWARD, "workers": 2, "timeout_s": 60}}]


def processes(title: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                first = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if first.startswith(title):
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


def start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "out"
    spec = recipe(out, sampler=SAMPLER, rewards=POOL)
    spec["train"].update({"max_steps": 40, "save_every": 2})
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "RAY_ADDRESS")}
    env.update({"HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1", "TOKENIZERS_PARALLELISM": "false",
                "TWINKLE_TENSORBOARD": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    job = subprocess.Popen([sys.executable, "-m", "twinkle_core.cli", "train", str(path), *RAY, *args],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                           start_new_session=True)
    return job, out


def kill_when_checkpointed(job: subprocess.Popen, out: Path, title: str) -> list[int]:
    deadline = time.monotonic() + 300
    while not (out / "checkpoint-2").is_dir() or not processes(title):
        if job.poll() is not None or time.monotonic() > deadline:
            os.killpg(job.pid, signal.SIGKILL)
            text = "".join(job.communicate())
            pytest.fail(f"the job ended or stalled before checkpoint-2 and a {title} process:\n{text[-4000:]}")
        time.sleep(0.05)
    pids = processes(title)
    os.kill(pids[0], signal.SIGKILL)
    assert not (out / "final").exists(), "the job had already finished: the kill tested nothing"
    return pids


def finish(job: subprocess.Popen) -> tuple[int, str]:
    try:
        out_text, err_text = job.communicate(timeout=400)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return job.returncode, out_text + err_text


def test_a_killed_sampler_actor_stops_the_job_naming_it(tmp_path):
    job, out = start(tmp_path)
    killed = kill_when_checkpointed(job, out, "ray::SamplerWorker")
    killed_at = time.monotonic()
    code, text = finish(job)
    assert code != 0, text[-4000:]
    assert "sampler actor (hf_generate) died" in text, text[-4000:]
    assert time.monotonic() - killed_at < 60
    deadline = time.monotonic() + 20
    while any(alive(p) for p in processes("ray::TwinkleWorker") + killed) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in processes("ray::TwinkleWorker")), "a trainer rank outlived the job"
    assert not (out / "final").exists()


def test_a_killed_sampler_actor_is_rebuilt_with_the_group_when_restarts_are_allowed(tmp_path):
    job, out = start(tmp_path, "--max-restarts", "1")
    kill_when_checkpointed(job, out, "ray::SamplerWorker")
    code, text = finish(job)
    assert code == 0, text[-6000:]
    assert "restart 1/1 from the last checkpoint" in text and "twinkle: done at step 40/40" in text, text[-4000:]


def test_a_killed_reward_actor_costs_its_chunk_and_the_job_trains_on(tmp_path):
    job, out = start(tmp_path)
    kill_when_checkpointed(job, out, "ray::RewardWorker")
    code, text = finish(job)
    # a worker killed between calls is restarted by Ray before the next call (nothing lost); one killed during a
    # call costs that call's chunk (nan, with a warning naming the reward): either way training goes on
    assert code == 0, text[-6000:]
    assert "twinkle: done at step 40/40" in text, text[-4000:]
    assert "scored nan" not in text or f"reward '{REWARD}': worker" in text, text[-4000:]
