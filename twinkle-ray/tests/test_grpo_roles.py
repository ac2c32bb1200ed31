"""Online RL with roles under ``--runtime ray``: a GRPO run whose trainer group (2 DDP ranks) samples through a
sampler actor (``hf_generate`` with its own copy of the weights, pushed after every step) and scores through a
pool of 2 reward actors logs the same steps as the same run under torchrun with the sampler and the reward in the
trainer processes (which the RL plugin's own tests hold equal to one process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from twinkle_ray.testing import grpo_recipe

from twinkle_core.testing.torchrun import free_port, thread_env

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

REWARD = "twinkle_ray.testing:length_reward"


def recipe(out: Path, *, sampler: dict, rewards: list) -> dict:
    return grpo_recipe(out, sampler=sampler, rewards=rewards)


def train(tmp_path: Path, name: str, spec: dict, *launch: str) -> list[dict]:
    out = tmp_path / name
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "RAY_ADDRESS")}
    env.update({"HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1", "TOKENIZERS_PARALLELISM": "false",
                "TWINKLE_TENSORBOARD": "0", **thread_env()})
    result = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(path), *launch],
                            capture_output=True, text=True, timeout=500, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    lines = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines() if line.strip()]
    return [line for line in lines if line.get("event") == "train"]


@pytest.fixture(scope="module")
def in_process_roles(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("torchrun")
    return train(root, "torchrun", recipe(root / "torchrun", sampler={"name": "hf_generate", "copy_weights": True},
                                          rewards=[REWARD]),
                 "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()))


# channel: small buckets, so that every update travels over the weight channel in several pieces
@pytest.mark.parametrize("transport", [{"weight_transport": "channel", "bucket_mb": 0.05},
                                       {"weight_transport": "object_store"}], ids=["channel", "object_store"])
def test_grpo_with_a_sampler_actor_and_a_reward_pool_equals_the_in_process_roles(tmp_path, in_process_roles,
                                                                                  transport):
    local = in_process_roles
    roles = train(tmp_path, "ray",
                  recipe(tmp_path / "ray", sampler={"name": "ray", **transport,
                                                    "inner": {"name": "hf_generate", "copy_weights": True}},
                         rewards=[{"name": "ray_pool", "options": {"reward": REWARD, "workers": 2}}]),
                  "--runtime", "ray", "--num-workers", "2")
    assert [line["step"] for line in roles] == [line["step"] for line in local] == [1, 2, 3]
    assert len({line["reward_mean"] for line in local}) > 1, "the rewards carry no signal: the test would be vacuous"
    for line in roles:  # where the time went, per role: the sampler actor, the reward pool, the weight push
        assert all(line[key] > 0 for key in ("generation_time_s", "reward_time_s", "weight_sync_time_s")), line
    print({key: roles[-1][key] for key in ("generation_time_s", "reward_time_s", "weight_sync_time_s")},
          {key: local[-1][key] for key in ("generation_time_s", "reward_time_s", "weight_sync_time_s")})
    for mine, theirs in zip(roles, local):
        for key in ("loss", "reward_mean", "grad_norm", "completion_length_mean"):
            # the same arithmetic in the same order: the sampler's copy holds the policy's exact weights
            assert mine[key] == theirs[key], (mine["step"], key, mine[key], theirs[key])
