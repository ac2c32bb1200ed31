"""Registers loss ``cross_entropy``, which the core already provides: a DuplicatePluginError."""

from twinkle_core import LossRecord, hookimpl


@hookimpl
def twinkle_register_losses():
    yield LossRecord("cross_entropy", "twinkle_duplicate_plugin:CrossEntropy", "a clashing registration")
