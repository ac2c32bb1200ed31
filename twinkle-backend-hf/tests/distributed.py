"""Kept for the tests' short import; the helper lives in the core."""

from twinkle_core.testing.torchrun import (
    PASSED_ONLY,
    TorchrunResult,
    free_port,
    pytest_summaries,
    run_torchrun,
)

__all__ = ["PASSED_ONLY", "TorchrunResult", "free_port", "pytest_summaries", "run_torchrun"]
