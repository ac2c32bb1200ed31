"""Twinkle backend on Hugging Face Transformers + PEFT. Importing this package imports nothing heavy."""

__version__ = "0.1.0"
