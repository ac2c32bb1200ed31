"""The plugin module named by the ``twinkle`` entry point; importing it must stay cheap (no torch)."""

from twinkle_core import LossRecord, TaskRecord, hookimpl


@hookimpl
def twinkle_register_losses():
    yield LossRecord("fake_loss", "twinkle_fake_plugin.impl:FakeLoss", "mean absolute error (test fixture)")


@hookimpl
def twinkle_register_tasks():
    yield TaskRecord("fake_task", "twinkle_fake_plugin.impl:FakeTask", "rows are lists of numbers (test fixture)")
