"""Registers a loss whose implementation lives in a module that is not installed."""

from twinkle_core import LossRecord, hookimpl


@hookimpl
def twinkle_register_losses():
    yield LossRecord("ghost_loss", "twinkle_ghost_dependency.losses:GhostLoss", "needs a missing module")
