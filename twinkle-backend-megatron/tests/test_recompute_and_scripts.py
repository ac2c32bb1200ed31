"""Two things users hit from Python: activation recompute with bf16 / fp16 autocast (the recomputed forward must see
the forward's autocast), and saving a full fine-tune from a script without an ``if __name__ == "__main__":`` guard
(megatron-core's checkpoint writer must not re-import the script)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from twinkle_backend_megatron.model import MegatronModel

from twinkle_core.testing.conformance import make_batch

CONFIG = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


def _one_step(precision: str, recompute: str | None):
    model = MegatronModel(config=dict(CONFIG), seed=0, precision=precision, recompute=recompute)
    model.set_optimizer("AdamW", lr=1e-3)
    loss = float(model.forward_backward(inputs=make_batch(0, rows=2, length=8))["loss"])
    grads = {n: p.grad.clone() for n, p in model.module.named_parameters() if p.grad is not None}
    model.clip_grad_and_step()
    return loss, grads


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_full_recompute_under_autocast_gives_the_same_step(precision):
    loss, grads = _one_step(precision, "full")
    plain_loss, plain_grads = _one_step(precision, None)
    # the recompute runs the same operations in the same dtypes on the same inputs
    assert loss == plain_loss
    assert grads.keys() == plain_grads.keys() and grads
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name


SCRIPT = textwrap.dedent("""
    import sys
    from twinkle_backend_megatron.model import MegatronModel
    from twinkle_core.testing.conformance import make_batch

    model = MegatronModel(config={config!r}, seed=0)
    model.set_optimizer("AdamW", lr=1e-3)
    model.forward_backward(inputs=make_batch(0, rows=2, length=8))
    model.clip_grad_and_step()
    print("SAVED", model.save("ckpt", output_dir=sys.argv[1]), flush=True)
""")


@pytest.mark.timeout(300)
def test_a_script_without_a_main_guard_saves_a_full_fine_tune(tmp_path):
    script = tmp_path / "train_script.py"  # module level code only, as users write it
    script.write_text(SCRIPT.format(config=CONFIG))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("SAVED") == 1  # the script ran once: nothing re-imported it
    assert (tmp_path / "out" / "ckpt" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "ckpt" / "twinkle_checkpoint.json").is_file()
