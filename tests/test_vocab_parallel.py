"""Vocabulary-parallel losses (``LossContext.vocab_shard``): two gloo ranks against the whole-vocabulary losses.

The checks live in ``tests/vocab_parallel_job.py`` (one torchrun job, so the process group starts once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from twinkle_core.testing.torchrun import run_torchrun

pytestmark = pytest.mark.distributed  # torchrun jobs of 2 ranks: run one at a time (scripts/test.sh)

JOB = Path(__file__).with_name("vocab_parallel_job.py")


def test_sharded_losses_match_the_whole_vocabulary_on_two_ranks():
    result = run_torchrun([str(JOB)], nproc=2, timeout=180, per_rank_output=True)
    assert result.returncode == 0, result.output
    for rank, text in enumerate(result.rank_stdout):
        assert f"rank {rank}: vocab-parallel checks passed" in text, result.output
