"""Kept for the tests' short import; the helper lives in the core."""

from twinkle_core.testing.torchrun import run_torchrun as torchrun

__all__ = ["torchrun"]
