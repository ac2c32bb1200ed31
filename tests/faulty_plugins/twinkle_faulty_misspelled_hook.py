"""Implements ``twinkle_register_model`` (the hook is ``twinkle_register_models``): an unknown hook."""

from twinkle_core import ModelRecord, hookimpl


@hookimpl
def twinkle_register_model():
    yield ModelRecord("MisspelledModel", "twinkle_faulty_misspelled_hook:MisspelledModel")
