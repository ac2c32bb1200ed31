"""Kept for the tests' short import; the helper lives in the core."""

from twinkle_core.testing.torchrun import TorchrunResult, free_port, run_torchrun

__all__ = ["TorchrunResult", "free_port", "run_torchrun"]
