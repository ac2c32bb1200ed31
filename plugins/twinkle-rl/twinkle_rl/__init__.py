"""Twinkle's preference-training plugin: the ``preference`` task and the ``dpo`` / ``simpo`` / ``orpo`` losses."""

__version__ = "0.1.0"
