"""The Megatron examples, run the way examples/megatron/README.md says, in their smallest form.

``twinkle train examples/megatron/recipe_tp2.yaml --nproc-per-node 2`` (TP=2), ``recipe_pp2.yaml`` (PP=2, 1F1B
over 4 micro-batches) and ``recipe_tp2.yaml mesh.tp=1 mesh.dp=2 strategy.options.distributed_optimizer=true``
(DP=2, megatron-core's distributed optimizer), with overrides that shrink them to 2 steps: both ranks train, and ``final`` is a
Hugging Face directory (the shards / stages gathered) that plain ``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

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
SMALL = ("train.max_steps=2", "train.log_every=1", "train.save_every=null", "train.eval_every=null",
         "train.eval_before_training=false", "train.evaluate_options.limit=4", "data.max_length=64",
         "data.batch_size=8")


# the README's three commands: TP=2, PP=2, and DP=2 with megatron-core's distributed optimizer
CASES = {"tp2": ("recipe_tp2.yaml",), "pp2": ("recipe_pp2.yaml",),
         "dp2-distributed-optimizer": ("recipe_tp2.yaml", "mesh.tp=1", "mesh.dp=2",
                                       "strategy.options.distributed_optimizer=true")}


@pytest.mark.timeout(480)
@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_example(tmp_path, case):
    recipe, *overrides = CASES[case]
    import torch
    import transformers

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1",
                "TOKENIZERS_PARALLELISM": "false", "TWINKLE_TENSORBOARD": "0", **thread_env()})
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(EXAMPLES / "megatron" / recipe),
                             "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                             f"train.output_dir={tmp_path}", *SMALL, *overrides],
                            capture_output=True, text=True, timeout=420, env=env)
    print(f"{case}: {time.monotonic() - start:.1f} s")
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    logs = [json.loads(line) for line in (tmp_path / "logs.jsonl").read_text().splitlines()]
    steps = [r for r in logs if r.get("event") == "train"]
    assert [r["step"] for r in steps] == [1, 2], logs
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in steps), steps
    evals = [r for r in logs if r.get("event") == "eval"]
    assert evals and math.isfinite(evals[-1]["eval_loss"]), logs

    final = tmp_path / "final"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(final)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(final))
    assert model.config.num_hidden_layers == 4  # every stage's layers, gathered
    assert sum(p.numel() for p in model.parameters()) > 500_000  # full weights, not one TP shard
    with torch.no_grad():
        logits = model(**tokenizer("reverse: star", return_tensors="pt")).logits
    assert torch.isfinite(logits).all()
