"""The recipe's ``model.trust_remote_code`` reaches a task that loads repository files itself (the VLM task's
processor) through ``load_dataset(trust_remote_code=)``; a task without that parameter is not given it."""

from __future__ import annotations

from pathlib import Path

from twinkle_core.task import Task
from twinkle_core.train.build import data_options
from twinkle_core.train.recipe import recipe_from_dict


class LoadsFiles(Task):
    name = "loads_files"

    def load_dataset(self, path, tokenizer, *, trust_remote_code=None):
        return []

    def collate(self, features):
        return {}


class PlainTask(LoadsFiles):
    def load_dataset(self, path, tokenizer, **data_options):
        return []


def _recipe(trust):
    return recipe_from_dict({"model": {"model_id": "m", "trust_remote_code": trust}, "data": {"train": "d"}})


def test_the_resolved_switch_is_passed_to_a_task_that_takes_it(tmp_path, monkeypatch):
    monkeypatch.delenv("TWINKLE_TRUST_REMOTE_CODE", raising=False)
    assert data_options(_recipe(True), LoadsFiles(), Path(tmp_path))["trust_remote_code"] is True
    assert data_options(_recipe(None), LoadsFiles(), Path(tmp_path))["trust_remote_code"] is False
    monkeypatch.setenv("TWINKLE_TRUST_REMOTE_CODE", "1")
    assert data_options(_recipe(None), LoadsFiles(), Path(tmp_path))["trust_remote_code"] is True
    assert data_options(_recipe(False), LoadsFiles(), Path(tmp_path))["trust_remote_code"] is False


def test_a_task_without_the_parameter_is_not_given_it(tmp_path):
    assert "trust_remote_code" not in data_options(_recipe(True), PlainTask(), Path(tmp_path))
