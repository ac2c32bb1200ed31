"""A cluster of two Ray nodes on this machine (``ray start --head`` plus ``ray start --address``, each with its
own resources, on loopback addresses 127.0.0.2 and 127.0.0.3): ``twinkle train --runtime ray --ray-address``
places one rank on each node (``STRICT_SPREAD``) and the job gives torchrun's losses.

Ray treats ``127.0.0.1`` as "this machine" and refuses a second node there, so each node gets its own loopback
address. Both ``ray start`` processes run in their own session and are killed with their whole process group
afterwards, also when the test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from twinkle_core.testing.torchrun import free_port, thread_env

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "quickstart" / "recipe.yaml"
SMALL = ("train.max_steps=4", "train.log_every=1", "train.save_every=null", "train.eval_before_training=false",
         "train.eval_every=null", "train.evaluate_options.limit=4", "strategy.name=ddp", "data.batch_size=8")
HEAD, SECOND = "127.0.0.2", "127.0.0.3"


def ray_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "RAY_ADDRESS")}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # a local-only switch: it refuses a second node
    env.update({"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TWINKLE_NO_PROGRESS": "1", "TOKENIZERS_PARALLELISM": "false", "TWINKLE_TENSORBOARD": "0",
                **thread_env()})
    return env


def wait_for_port(host: str, port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {host}:{port} after {seconds:.0f} s")


@pytest.fixture
def two_nodes(tmp_path):
    ray = str(Path(sys.executable).with_name("ray"))
    port = free_port()
    common = ["--block", "--num-cpus", "2", "--disable-usage-stats"]
    started: list[subprocess.Popen] = []
    logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]
    try:
        started.append(subprocess.Popen(
            [ray, "start", "--head", "--port", str(port), "--node-ip-address", HEAD, "--include-dashboard", "false",
             "--ray-client-server-port", str(free_port()), "--resources", '{"node_a": 1}', *common],
            start_new_session=True, stdout=logs[0], stderr=subprocess.STDOUT, env=ray_environment()))
        wait_for_port(HEAD, port, 120)
        started.append(subprocess.Popen(
            [ray, "start", "--address", f"{HEAD}:{port}", "--node-ip-address", SECOND, "--resources",
             '{"node_b": 1}', *common],
            start_new_session=True, stdout=logs[1], stderr=subprocess.STDOUT, env=ray_environment()))
        yield f"{HEAD}:{port}"
    finally:
        for process in started:
            with contextlib.suppress(ProcessLookupError):  # the group is already gone
                os.killpg(process.pid, signal.SIGKILL)
        for process in started:
            process.wait(timeout=30)
        for log in logs:
            log.close()


def test_one_rank_per_node_gives_the_losses_of_torchrun(two_nodes, tmp_path):
    def train(out: Path, *launch: str) -> tuple[str, dict[int, float]]:
        result = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(RECIPE),
                                 f"train.output_dir={out}", *SMALL, *launch],
                                capture_output=True, text=True, timeout=420, env=ray_environment())
        text = result.stdout + result.stderr
        assert result.returncode == 0, text[-6000:]
        lines = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines() if line.strip()]
        return text, {line["step"]: line["loss"] for line in lines if line.get("event") == "train"}

    text, spread = train(tmp_path / "ray", "--runtime", "ray", "--ray-address", two_nodes, "--num-workers", "2",
                         "--placement", "STRICT_SPREAD")
    assert "trainer group: 2 workers on 2 node(s)" in text, text[-4000:]
    assert f"rendezvous {HEAD}:" in text or f"rendezvous {SECOND}:" in text, text[-4000:]  # rank 0's node
    _, local = train(tmp_path / "torchrun", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                     "--master-port", str(free_port()))
    assert sorted(spread) == sorted(local) == [1, 2, 3, 4]
    assert spread == local, (spread, local)  # the same arithmetic; only the processes' placement differs
