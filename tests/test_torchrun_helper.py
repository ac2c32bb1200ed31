"""``twinkle_core.testing.torchrun``: per-rank output and the pytest summary every multi-rank test checks."""

from __future__ import annotations

import sys

from twinkle_core.testing.torchrun import PASSED_ONLY, pytest_summaries, run_torchrun

RANK_SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
# both ranks print at once: on a shared stdout their lines interleave
for i in range(50):
    sys.stdout.write(f"rank {rank} line {i}\\n")
summary = "3 passed, 1 warning in 0.50s" if rank == 0 else "1 failed, 2 passed in 0.61s"
print(summary)
"""


def test_each_rank_output_is_kept_apart(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(RANK_SCRIPT)
    result = run_torchrun([str(script)], nproc=2, timeout=120, per_rank_output=True)
    assert result.returncode == 0, result.output
    assert len(result.rank_stdout) == 2
    for rank, text in enumerate(result.rank_stdout):
        lines = text.splitlines()
        assert lines[:50] == [f"rank {rank} line {i}" for i in range(50)], result.output
    assert pytest_summaries(result) == ["3 passed, 1 warning in 0.50s", "1 failed, 2 passed in 0.61s"]
    assert "--- stdout of rank 1 ---" in result.output


def test_passed_only_accepts_clean_summaries_and_nothing_else():
    assert PASSED_ONLY.fullmatch("19 passed, 161 warnings in 21.76s")
    assert PASSED_ONLY.fullmatch("19 passed in 301.20s (0:05:01)")
    assert PASSED_ONLY.fullmatch("4 passed, 15 deselected in 10.87s")
    for bad in ("1 failed, 18 passed in 2.0s", "18 passed, 1 skipped in 2.0s", "18 passed, 1 error in 2s", "",
                ".19 passed, 161 warnings in 21.74s"):
        assert not PASSED_ONLY.fullmatch(bad), bad


def test_a_rank_without_summary_counts_as_missing(tmp_path):
    script = tmp_path / "silent.py"
    script.write_text("import os\nprint('5 passed in 1.00s' if os.environ['RANK'] == '0' else 'crashed early')\n")
    result = run_torchrun([str(script)], nproc=2, timeout=120, per_rank_output=True)
    assert pytest_summaries(result) == ["5 passed in 1.00s", ""], result.output
    assert sys.executable in result.args
