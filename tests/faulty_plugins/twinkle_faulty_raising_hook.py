"""Registers a task, but its ``twinkle_register_losses`` raises when called."""

from twinkle_core import TaskRecord, hookimpl


@hookimpl
def twinkle_register_tasks():
    yield TaskRecord("raising_task", "twinkle_core.task:Task")


@hookimpl
def twinkle_register_losses():
    raise RuntimeError("the loss registry of twinkle-faulty-raising-hook is corrupt")
