"""Twinkle backend on NVIDIA megatron-core. Importing this package imports nothing heavy."""

__version__ = "0.1.0"
