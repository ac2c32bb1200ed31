"""``vlm_preference`` on the Megatron backend: ``twinkle train`` with ``MegatronModel`` at TP=2 (2 processes, gloo)
trains the same DPO steps on image pairs as the HF backend in one process, from the same saved tiny Qwen2.5-VL."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from twinkle_core.testing.tolerance import forward_tolerance
from twinkle_core.testing.torchrun import run_python

pytest.importorskip("twinkle_backend_megatron")
pytest.importorskip("twinkle_rl")

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "vlm"
STEPS = 3
BETA = 1.0  # preference.yaml's


def _run(*args: str, timeout: float) -> None:
    run_python(*args, timeout=timeout, cwd=REPO)


def _train_lines(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "logs.jsonl").read_text().splitlines()) if r.get("event") == "train"]


def _log_rounding(value: float) -> float:
    """Half a unit of the 6th significant digit the log keeps."""
    return 0.5 * 10 ** (math.floor(math.log10(abs(value))) - 5) if value else 0.0


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_megatron_tp2_trains_image_pairs_as_the_hf_backend(tmp_path, tiny_vlm_dir):
    model_dir = tiny_vlm_dir("qwen2_5_vl")
    data = tmp_path / "data"
    _run(str(EXAMPLE / "make_pairs.py"), "--out", str(data), "--train", "16", "--eval", "4", timeout=120)
    common = [f"model.model_id={model_dir}", "model.config=null", "model.tokenizer=null",
              f"data.train={data / 'pairs_train.jsonl'}", f"data.eval={data / 'pairs_eval.jsonl'}", "data.batch_size=4",
              f"train.max_steps={STEPS}", "train.log_every=1", "train.eval_before_training=false", "--overwrite"]
    runs = {}
    for name, extra in (("hf", []), ("megatron", ["--nproc-per-node", "2", "model.class_name=MegatronModel",
                                                  "strategy.name=megatron", "mesh.tp=2"])):
        out = tmp_path / name
        _run("-m", "twinkle_core.cli", "train", str(EXAMPLE / "preference.yaml"), *extra, f"train.output_dir={out}",
             *common, timeout=420)
        runs[name] = _train_lines(out)
        assert [line["step"] for line in runs[name]] == list(range(1, STEPS + 1)), runs[name]
    config = json.loads((model_dir / "config.json").read_text())
    text = config["text_config"]
    width = max(text["vocab_size"], text["intermediate_size"], text["hidden_size"])
    depth = text["num_hidden_layers"] + config["vision_config"]["depth"]
    hf, megatron = runs["hf"], runs["megatron"]
    # a step's margin is four summed answer log-probs, each one forward's rounding (at the size those sums reach over
    # the steps) apart; the loss moves by at most beta times that (the sigmoid's slope is at most 1); the log keeps 6
    # significant digits of both runs' values
    magnitude = max(abs(line[key]) for line in hf for key in ("logps/chosen", "logps/rejected"))
    bound = 4 * BETA * forward_tolerance(magnitude, width=width, depth=depth)
    for got, want in zip(megatron, hf, strict=True):
        for key in ("loss", "rewards/margins"):
            slack = bound + _log_rounding(got[key]) + _log_rounding(want[key])
            assert abs(got[key] - want[key]) <= slack, (key, got["step"], got[key], want[key], slack)
    assert hf[-1]["loss"] < hf[0]["loss"], "the steps must train"
    print("losses hf", [line["loss"] for line in hf], "megatron", [line["loss"] for line in megatron])
