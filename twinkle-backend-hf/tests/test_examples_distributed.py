"""The 2-process examples of the HF backend, run the way their READMEs say, in their smallest form.

``twinkle train examples/fsdp2_full/recipe.yaml --nproc-per-node 2`` (FSDP2, ``native_fsdp``) and
``twinkle train examples/zero3/recipe.yaml --nproc-per-node 2`` (DeepSpeed ZeRO-3, ``DS_ACCELERATOR=cpu``), with
overrides that shrink them to 2 steps: both ranks train with the recipe's strategy (as the step-2 checkpoint's
trainer state records it), and the gathered ``final`` is a full transformers checkpoint that plain
``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from twinkle_core.testing.torchrun import free_port, thread_env

pytestmark = pytest.mark.distributed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = ("train.max_steps=2", "train.log_every=1", "train.save_every=2", "train.eval_every=null",
         "train.eval_before_training=false", "train.evaluate_options.limit=4", "data.max_length=64",
         "data.batch_size=4")


def run_example(recipe: Path, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1",
                "TOKENIZERS_PARALLELISM": "false", "TWINKLE_TENSORBOARD": "0", "DS_ACCELERATOR": "cpu",
                **thread_env()})
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(recipe), "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                             f"train.output_dir={out}", *SMALL],
                            capture_output=True, text=True, timeout=420, env=env)
    print(f"{recipe.parent.name}: {time.monotonic() - start:.1f} s")
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-5000:]
    logs = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines()]
    steps = [r for r in logs if r.get("event") == "train"]
    assert [r["step"] for r in steps] == [1, 2], logs
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in steps), steps
    evals = [r for r in logs if r.get("event") == "eval"]
    assert evals and math.isfinite(evals[-1]["eval_loss"]), logs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2, summary
    return saved_configs(out / "checkpoint-2")


def saved_configs(checkpoint: Path) -> dict:
    """How the checkpoint's model was trained (``get_train_configs()`` as saved in its trainer state)."""
    import torch

    states = sorted(checkpoint.rglob("trainer_state.pt"))
    assert states, sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*"))
    return torch.load(states[0], weights_only=True)["configs"]


def check_final(final: Path) -> None:
    import torch
    import transformers

    assert (final / "model.safetensors").is_file(), sorted(p.name for p in final.iterdir())
    model = transformers.AutoModelForCausalLM.from_pretrained(str(final)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(final))
    # full (gathered) weights, not one rank's shard
    assert sum(p.numel() for p in model.parameters()) > 500_000
    with torch.no_grad():
        logits = model(**tokenizer("reverse: star", return_tensors="pt")).logits
    assert torch.isfinite(logits).all()


@pytest.mark.timeout(480)
def test_fsdp2_full(tmp_path):
    strategy = run_example(EXAMPLES / "fsdp2_full" / "recipe.yaml", tmp_path)["strategy"]
    assert strategy["name"] == "native_fsdp" and strategy["mesh"]["fsdp"] == 2, strategy  # sharded over 2 ranks
    check_final(tmp_path / "final")


@pytest.mark.timeout(480)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="DeepSpeed is not installed: pip install 'twinkle-backend-hf[deepspeed]'")
def test_zero3(tmp_path):
    strategy = run_example(EXAMPLES / "zero3" / "recipe.yaml", tmp_path)["strategy"]
    assert strategy["name"] == "deepspeed" and strategy["mesh"]["dp"] == 2, strategy
    assert strategy["stage"] == 3, strategy
    check_final(tmp_path / "final")
