"""Implements ``twinkle_registr_losses`` (a typo of ``twinkle_register_losses``) next to a valid hook."""

from twinkle_core import LossRecord, TaskRecord, hookimpl


@hookimpl
def twinkle_register_tasks():
    yield TaskRecord("typo_task", "twinkle_core.task:Task")


@hookimpl
def twinkle_registr_losses():
    yield LossRecord("typo_loss", "twinkle_core.loss.mse:MSELoss")
