"""The single-process examples under examples/, each run the way its README says, in its smallest form.

``lora_sft`` and ``pretrain`` (packed, and streamed) through ``twinkle train RECIPE`` with overrides that shrink
them to 2 steps; ``multi_tenant`` through ``python examples/multi_tenant/train.py --steps 2``. Each test checks
that the run trained (losses in ``logs.jsonl``) and that what it saved loads with plain transformers / peft.
The multi-process examples are tested in twinkle-backend-hf/tests/test_examples_distributed.py (FSDP2,
ZeRO-3) and twinkle-backend-megatron/tests/test_examples_megatron.py (TP=2, PP=2).
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

from twinkle_core.testing.torchrun import thread_env

pytest.importorskip("twinkle_backend_hf")  # every example here trains a TransformersModel

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SMALL = ("train.max_steps=2", "train.log_every=1", "train.save_every=null", "train.eval_every=null",
         "train.eval_before_training=false")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1",
                "TOKENIZERS_PARALLELISM": "false", "TWINKLE_TENSORBOARD": "0", **thread_env()})
    return env


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    start = time.monotonic()
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=_env())
    print(f"{' '.join(args[:4])}: {time.monotonic() - start:.1f} s")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def train(recipe: Path, out: Path, *overrides: str) -> list[dict]:
    _run("-m", "twinkle_core.cli", "train", str(recipe), f"train.output_dir={out}", *SMALL, *overrides)
    logs = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines()]
    steps = [r for r in logs if r.get("event") == "train"]
    assert [r["step"] for r in steps] == [1, 2], logs
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in steps), steps
    return logs


def _generate_one_token(model, tokenizer) -> None:
    import torch

    ids = tokenizer("reverse: star", return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape[-1] >= len(tokenizer) and torch.isfinite(logits).all()


def test_lora_sft(tmp_path):
    """The README's road: train, move the run folder, chat with the adapter, export it merged; the merged model
    loads in plain transformers with the logits of the saved base plus the adapter (plain peft)."""
    import peft
    import torch
    import transformers

    recipe = EXAMPLES / "lora_sft" / "recipe.yaml"
    logs = train(recipe, tmp_path / "run", "train.evaluate_options.limit=4")
    evals = [r for r in logs if r.get("event") == "eval"]
    assert evals and math.isfinite(evals[-1]["eval_loss"]) and "eval_exact_match" in evals[-1], evals
    # the base is built from the recipe's config, so the run saves it (OUTPUT_DIR/base) and the adapter names
    # it relative to itself: the run folder may move
    config = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == os.path.join("..", "base"), config
    run = tmp_path / "moved" / "lora_sft"
    run.parent.mkdir()
    (tmp_path / "run").rename(run)
    final = run / "final"
    assert (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()
    answer = _run("-m", "twinkle_core.cli", "chat", str(final), "--prompt", "reverse: galaxy", "--max-new-tokens", "4")
    assert answer.stdout.strip(), answer.stderr
    _run("-m", "twinkle_core.cli", "export", str(final), "--merge-lora", "--output", str(tmp_path / "merged"))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(run / "base"), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(final)).eval()
    assert model.peft_config["default"].r == 16
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(final))
    _generate_one_token(model, tokenizer)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    ids = tokenizer("reverse: star", return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(merged(**ids).logits, model(**ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("streaming", [False, True], ids=["packed", "streaming"])
def test_pretrain(tmp_path, streaming):
    import transformers

    extra = ("data.streaming=true", "data.packing=false") if streaming else ()
    logs = train(EXAMPLES / "pretrain" / "recipe.yaml", tmp_path, *extra)
    steps = [r for r in logs if r.get("event") == "train"]
    # every token is trained; streamed rows are exactly max_length (512) tokens, the first of each has no label
    trained = [r["tokens"] for r in steps]
    assert trained == [8 * 511] * 2 if streaming else all(t > 8 * 128 for t in trained), steps
    evals = [r for r in logs if r.get("event") == "eval"]
    assert evals and math.isfinite(evals[-1]["eval_loss"]), logs
    final = tmp_path / "final"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(final)).eval()
    _generate_one_token(model, transformers.AutoTokenizer.from_pretrained(str(final)))


def test_pretrain_data_is_small_and_regenerates(tmp_path):
    import importlib.util

    folder = EXAMPLES / "pretrain"
    assert sum((folder / name).stat().st_size for name in ("train.jsonl", "eval.jsonl")) < 200_000
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    assert len(rows) >= 300 and all(set(row) == {"text"} and row["text"] for row in rows)
    spec = importlib.util.spec_from_file_location("pretrain_make_data", folder / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    make_data.main(str(tmp_path))  # deterministic: the committed files are what the script writes
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (folder / name).read_bytes(), name


def test_multi_tenant(tmp_path):
    import peft
    import transformers

    result = _run(str(EXAMPLES / "multi_tenant" / "train.py"), "--steps", "2", "--output-dir", str(tmp_path))
    assert "step 2/2" in result.stdout, result.stdout
    held_out = json.loads((tmp_path / "results.json").read_text())["held_out_loss"]
    assert sorted(held_out) == ["tenant_double", "tenant_reverse", "tenant_upper"]
    assert all(math.isfinite(v) for row in held_out.values() for v in row.values()), held_out
    for name in held_out:  # plain PEFT directories that name the saved base: no Twinkle needed to use them
        adapter = tmp_path / name
        base_path = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert base_path == os.path.join("..", "base")  # inside the run folder: relative to the adapter directory
        base = transformers.AutoModelForCausalLM.from_pretrained(str(adapter / base_path))
        model = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
        _generate_one_token(model, transformers.AutoTokenizer.from_pretrained(str(adapter)))
