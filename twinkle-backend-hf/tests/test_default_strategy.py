"""The spec's default strategy, for real: ``twinkle train --nproc-per-node 2`` with no strategy runs Accelerate FSDP.

"FSDP | ``strategy=accelerate`` | Accelerate 管理的 FSDP（默认）" — the recipe names no strategy, two ranks (CPU,
gloo) train with ``accelerate`` (on CPU it delegates to torch's ``fully_shard``, and says so), and ``dp_size``, the
spec's name for ``mesh.dp``, is accepted on the command line. The rule is :func:`twinkle_core.mesh.default_strategy`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from twinkle_core.testing.torchrun import free_port

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"

RECIPE = f"""
task: causal_lm
model:
  class_name: TransformersModel
  tokenizer: {QUICKSTART / "tokenizer"}
  config: {{model_type: qwen2, vocab_size: 262, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
           num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 256,
           bos_token_id: 0, eos_token_id: 0, pad_token_id: 0}}
data: {{train: {QUICKSTART / "train.jsonl"}, mode: chat, max_length: 32, batch_size: 2}}
optimizer: {{lr: 1.0e-2}}
train: {{max_steps: 2, log_every: 1, save_every: 2}}
"""


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_two_ranks_without_a_strategy_train_with_accelerate(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("WORLD_SIZE", None)
    result = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(recipe),
                             f"train.output_dir={tmp_path / 'out'}", "dp_size=2", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(free_port())],
                            capture_output=True, text=True, timeout=600, env=env)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-4000:]
    assert "strategy 'accelerate'" in text and "delegates to 'native_fsdp'" in text, text[-4000:]
    logs = [json.loads(line) for line in (tmp_path / "out" / "logs.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs if r.get("event") == "train"] == [1, 2]
    states = sorted((tmp_path / "out").rglob("trainer_state.pt"))
    assert states, sorted(p.name for p in (tmp_path / "out").rglob("*"))
    configs = torch.load(states[-1], weights_only=True)["configs"]  # how the saved model was trained
    assert configs["strategy"]["name"] == "accelerate" and configs["strategy"]["mesh"]["dp"] == 2, configs
