"""TP=2 with the vocabulary-parallel loss (the default) against the same runs with it off (gathered logits).

Two SFT steps (cross entropy, token accuracy) and one GRPO step (temperature 0.7, KL to a reference) give the same
losses, accuracies and gradient norms; ``forward_backward`` hands the losses a vocabulary slice, ``forward`` and
``forward_only`` return the whole vocabulary. (LoRA on the LM head on vocabulary slices: the TP=2 LoRA parity run
of test_distributed.py, which adapts the head too.)
"""

from __future__ import annotations

import json
import os

import pytest
from torchrun_job import torchrun

from twinkle_core.testing.tolerance import sum_tolerance

pytestmark = pytest.mark.distributed

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "vocab_parallel_runs.py")
VOCAB, PADDED_SHARD = 61, 31  # 61 tokens padded to 62 over two ranks
TOKENS = 8 * 12  # rows x length of make_batch: an upper bound of the tokens a loss averages


def test_vocab_parallel_loss_matches_gathered_logits_at_tp2(tmp_path):
    out = tmp_path / "results.json"
    job = torchrun([SCRIPT, "--out", str(out)], nproc=2, timeout=300)
    assert job.returncode == 0, job.output
    results = json.loads(out.read_text())
    on, off = results["on"], results["off"]
    assert on["shard"] == [0, PADDED_SHARD] and off["shard"] is None
    assert on["widths"] == {"forward_backward": PADDED_SHARD, "forward": VOCAB, "forward_only": VOCAB}
    assert off["widths"] == {"forward_backward": VOCAB, "forward": VOCAB, "forward_only": VOCAB}
    # the two differ in the order of each log-sum-exp's sum over the vocabulary (split over two ranks), for every
    # token: one-shot rounding of TOKENS x VOCAB terms of the loss's size
    for key in ("losses", "norms"):
        floor = sum_tolerance(TOKENS * VOCAB, max(abs(v) for v in off[key]))
        for got, want in zip(on[key], off[key], strict=True):
            assert abs(got - want) <= floor, (key, on[key], off[key], floor)
    assert on["accuracy"] == off["accuracy"]
