"""``task_options.sampler: {name: ray, placement: colocated}``: the sampler actor time-shares trainer rank 0's
placement-group bundle.

* A GRPO run (2 DDP ranks under ``--runtime ray``) with the colocated sampler logs the same steps, bit for bit, as
  the same run with ``placement: split``.
* The actor really is in rank 0's bundle: while each job runs, this test reads Ray's resource accounting of the
  job's placement group (every actor in a bundle holds a share of its ``bundle_group_<index>_<group>`` resource):
  colocated, bundle 0 has two holders (rank 0 and the sampler) and bundle 1 one; split, one each. The trainer's log
  names the same group and bundle 0.
* Nothing is left afterwards: the cluster's CPUs are free again, no placement group is alive, the sampler's process
  is gone.
* ``colocated`` with one-step-off rollouts is refused before the first training step; an unknown placement, and
  colocated outside a placement group, are ConfigErrors.

The jobs join this folder's local cluster (``--ray-address``) so that the test can watch it while they run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from twinkle_ray.testing import grpo_recipe

from twinkle_core.errors import ConfigError
from twinkle_core.testing.torchrun import thread_env

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

INNER = {"name": "hf_generate", "copy_weights": True}
BUNDLE = re.compile(r"^bundle_group_(\d+)_([0-9a-f]+)$")
#: what each actor in a bundle holds of the bundle's ``bundle_group_<index>_<group>`` resource (Ray's accounting)
SHARE = 0.001
COLOCATED_LINE = re.compile(r"ray sampler colocated with trainer rank 0: placement group ([0-9a-f]+) bundle (\d+), "
                            r"node \w+, pid (\d+)")


def recipe(out: Path, sampler: dict, **task_options) -> dict:
    return grpo_recipe(out, sampler=sampler, **task_options)


def bundle_holders(ray) -> dict[tuple[str, int], int]:
    """``{(placement group, bundle index): actors in it}`` from the cluster's resource accounting."""
    total, available = ray.cluster_resources(), ray.available_resources()
    found = {}
    for key, amount in total.items():
        match = BUNDLE.match(key)
        if match:
            found[match[2], int(match[1])] = round((amount - available.get(key, 0.0)) / SHARE)
    return found


def train(ray, tmp_path: Path, name: str, spec: dict) -> dict:
    """Run the job on this folder's cluster, watching the bundles' holders while it runs; what it logged and left."""
    out = tmp_path / name
    spec["train"]["output_dir"] = str(out)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "RAY_ADDRESS")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1",
                "TOKENIZERS_PARALLELISM": "false", "TWINKLE_TENSORBOARD": "0", **thread_env()})
    holders: dict[tuple[str, int], int] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            for key, count in bundle_holders(ray).items():
                holders[key] = max(holders.get(key, 0), count)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(path), "--runtime", "ray",
                                 "--ray-address", ray.get_runtime_context().gcs_address, "--num-workers", "2"],
                                capture_output=True, text=True, timeout=500, env=env)
    finally:
        done.set()
        watcher.join()
    records = []
    if (out / "logs.jsonl").is_file():
        records = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines() if line.strip()]
    return {"returncode": result.returncode, "text": result.stdout + result.stderr, "holders": holders,
            "steps": [r for r in records if r.get("event") == "train"], "seconds": time.monotonic() - start,
            "leftovers": leftovers(ray)}


def leftovers(ray, seconds: float = 30.0) -> list[str]:
    """What the last job left in the cluster (its actors' CPUs, a placement group), after up to ``seconds``."""
    from ray.util import placement_group_table

    deadline = time.monotonic() + seconds
    while True:
        found = [f"placement group {pg} {info['state']}" for pg, info in placement_group_table().items()
                 if info["state"] != "REMOVED"]
        free, total = ray.available_resources().get("CPU", 0.0), ray.cluster_resources()["CPU"]
        found += [f"{total - free:g} CPU held"] if free != total else []
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("placement")
    return {placement: train(ray_cluster, root, placement,
                             recipe(root, {"name": "ray", "placement": placement, "inner": INNER}))
            for placement in ("split", "colocated")}


def test_colocated_sampler_gives_the_split_samplers_steps(runs):
    split, colocated = runs["split"], runs["colocated"]
    for run in (split, colocated):
        assert run["returncode"] == 0, run["text"][-6000:]
    print({k: f"{run['seconds']:.1f} s" for k, run in runs.items()})
    assert [s["step"] for s in colocated["steps"]] == [s["step"] for s in split["steps"]] == [1, 2, 3]
    assert len({s["reward_mean"] for s in split["steps"]}) > 1, "the rewards carry no signal: the test would be vacuous"
    for mine, theirs in zip(colocated["steps"], split["steps"]):
        for key in ("loss", "reward_mean", "grad_norm", "completion_length_mean"):
            # the same arithmetic in the same order: only where the sampler's process runs differs
            assert mine[key] == theirs[key], (mine["step"], key, mine[key], theirs[key])


def test_the_colocated_actor_is_in_rank_0s_bundle_and_the_split_one_in_none(runs):
    split, colocated = runs["split"], runs["colocated"]
    lines = COLOCATED_LINE.findall(colocated["text"])
    assert len(lines) == 1, colocated["text"][-6000:]
    group, bundle, _ = lines[0]
    assert bundle == "0"
    # Ray's own accounting, read from outside the job while it ran
    assert colocated["holders"] == {(group, 0): 2, (group, 1): 1}, colocated["holders"]
    assert sorted(split["holders"].values()) == [1, 1], split["holders"]  # the split actor is in no bundle
    assert not COLOCATED_LINE.search(split["text"])


def test_nothing_is_left_after_either_job(runs):
    for placement, run in runs.items():
        assert run["leftovers"] == [], (placement, run["leftovers"])
    pid = int(COLOCATED_LINE.findall(runs["colocated"]["text"])[0][2])
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pid), f"the colocated sampler's process {pid} outlived its job"


def test_colocated_with_one_step_off_is_refused_before_training(ray_cluster, tmp_path):
    spec = recipe(tmp_path, {"name": "ray", "placement": "colocated", "inner": INNER}, one_step_off=True)
    run = train(ray_cluster, tmp_path, "one_step_off", spec)
    assert run["returncode"] != 0
    assert "task_options.one_step_off" in run["text"] and "placement: colocated" in run["text"], run["text"][-6000:]
    assert "ConfigError" in run["text"], run["text"][-6000:]
    assert run["steps"] == []  # not one optimizer step
    assert run["leftovers"] == []


# ---------------------------------------------------------------------------------------------- without a job
def test_an_unknown_placement_is_refused():
    from twinkle_ray.sampler import RaySampler

    with pytest.raises(ConfigError, match="placement must be one of split, colocated, got 'stacked'"):
        RaySampler(placement="stacked")
    with pytest.raises(ConfigError, match="known: inner, placement, num_cpus"):
        RaySampler(placment="colocated")
    with pytest.raises(ConfigError, match="colocated shares trainer rank 0's bundle"):
        RaySampler(placement="colocated", num_cpus=1)


def test_a_colocated_sampler_refuses_one_step_off_through_the_core_seam():
    """The RL task asks the sampler (``Sampler.overlap_refusal``) before its first asynchronous rollout: a colocated
    sampler refuses with both options named, a split one (its own copy of the weights) accepts."""
    from twinkle_ray.sampler import RaySampler
    from twinkle_rl.one_step_off import check_one_step_off

    class Engine:  # what check_one_step_off reads of the rollout engine
        dynamic_sampling = False

    engine = Engine()
    engine.sampler = RaySampler(placement="colocated")
    with pytest.raises(ConfigError, match=r"task_options.one_step_off.*task_options.sampler.placement: split"):
        check_one_step_off(engine)
    engine.sampler = RaySampler(placement="split")
    check_one_step_off(engine)


def test_visible_devices_are_rank_0s_accelerators():
    from twinkle_ray.sampler_placement import visible_devices

    assert visible_devices({"GPU": ["3"], "NPU": []}) == ({"CUDA_VISIBLE_DEVICES": "3"}, "cuda")
    assert visible_devices({"GPU": ["0", "1"]}) == ({"CUDA_VISIBLE_DEVICES": "0,1"}, "cuda")
    assert visible_devices({"NPU": ["2"]}) == ({"ASCEND_RT_VISIBLE_DEVICES": "2"}, "npu")
    assert visible_devices({"GPU": [], "TPU": []}) == ({}, "cpu")


def test_colocated_outside_a_placement_group_names_the_fix(ray_cluster):
    from twinkle_ray.sampler import RaySampler

    sampler = RaySampler(placement="colocated")
    with pytest.raises(ConfigError, match="no Ray placement group.*twinkle train --runtime ray"):
        sampler.bind(object(), None)  # this test's process is Ray's driver: in no placement group
    assert sampler.actor is None
