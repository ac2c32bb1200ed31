"""What the console shows while training (``twinkle_core.train.step_log.StepReporter``): the task's headline
metrics (``Task.console_keys``) on the step line and the progress bar, the evaluation before training, and the
per-source row counts of a mixture of several ``data.train`` sources. A fake task and model stand in for a run."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from twinkle_core.data.mixing import count_mixture, load_spec
from twinkle_core.task import Task
from twinkle_core.train.recipe import load_recipe
from twinkle_core.train.step_log import StepReporter, StepWindow

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart" / "recipe.yaml"


class HeadlineTask(Task):
    """Logs three values; two of them (and one it never logs) are its headline."""

    name = "headline_fake"
    console_keys = ("score", "rewards/accuracies", "never_logged")

    def load_dataset(self, path: str, tokenizer: Any, **data_options: Any) -> list[Any]:
        return []

    def collate(self, features: list[Any]) -> dict[str, Any]:
        return {}

    def step_metrics(self) -> dict[str, float]:
        return {"rewards/accuracies": 0.75, "hidden_metric": 7.0, "score": 0.123456}


class FakeModel:
    def calculate_metric(self, adapter_name: str | None = None, reset: bool = False) -> dict[str, float]:
        return {"loss": 1.5}

    def get_train_configs(self, adapter_name: str | None = None) -> dict[str, float]:
        return {"lr": 1e-3}


class RecordingBar:
    def __init__(self) -> None:
        self.postfixes: list[dict[str, Any]] = []

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **kwargs: Any) -> None:
        self.postfixes.append({**(ordered_dict or {}), **kwargs})

    def close(self) -> None: ...


@pytest.fixture(autouse=True)
def no_tensorboard(monkeypatch):
    monkeypatch.setenv("TWINKLE_TENSORBOARD", "0")


def make_reporter(tmp_path: Path, *, overrides: tuple[str, ...] = (), is_main: bool = True) -> StepReporter:
    recipe = load_recipe(QUICKSTART, [f"train.output_dir={tmp_path / 'run'}", *overrides])
    run = SimpleNamespace(recipe=recipe, model=FakeModel(), task=HeadlineTask(), adapter_name=None,
                          data_parallel=SimpleNamespace(size=1), total_steps=3)
    return StepReporter(run, step=0, is_main=is_main, started=0.0)


def log_lines(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "run" / "logs.jsonl").read_text().splitlines()]


def console(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "twinkle.train"]


def test_the_step_line_shows_the_headline_metrics_in_the_tasks_order_and_the_log_keeps_everything(tmp_path, caplog):
    reporter = make_reporter(tmp_path)
    reporter.show_bar = False
    with caplog.at_level(logging.INFO, logger="twinkle.train"):
        reporter.log_step(1, 0, StepWindow(), grad_norm=2.0)
    reporter.close()
    [line] = [m for m in console(caplog) if m.startswith("step 1/3")]
    assert line.endswith(" score 0.1235 rewards/accuracies 0.75"), line
    assert "hidden_metric" not in line and "never_logged" not in line
    [record] = log_lines(tmp_path)
    assert record["hidden_metric"] == 7.0 and record["score"] == 0.123456 and record["rewards/accuracies"] == 0.75


def test_the_progress_bar_shows_the_same_headline_metrics(tmp_path, caplog):
    reporter = make_reporter(tmp_path)
    reporter.show_bar, reporter.bar = True, RecordingBar()
    with caplog.at_level(logging.INFO, logger="twinkle.train"):
        reporter.log_step(1, 0, StepWindow(), grad_norm=2.0)
    reporter.close()
    assert reporter.bar.postfixes == [{"loss": 1.5, "lr": 1e-3, "score": 0.1235, "rewards/accuracies": 0.75}]
    assert not [m for m in console(caplog) if m.startswith("step 1/3")]  # the bar replaces the line


def test_the_evaluation_before_training_is_one_console_line_on_the_main_process_only(tmp_path, caplog):
    metrics = {"eval_exact_match": 0.0, "eval_loss": 5.4321}
    with caplog.at_level(logging.INFO, logger="twinkle.train"):
        make_reporter(tmp_path / "other", is_main=False).log_eval(0, metrics, before_training=True)
        assert not console(caplog)
        reporter = make_reporter(tmp_path)
        reporter.log_eval(0, metrics, before_training=True)
    reporter.close()
    assert console(caplog) == ["eval before training: exact_match 0.00, loss 5.43"]
    assert log_lines(tmp_path) == [{"event": "eval", "step": 0, **metrics, "time": log_lines(tmp_path)[0]["time"]}]


def write_rows(path: Path, n: int) -> str:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                     {"role": "assistant", "content": f"a{i}"}]}) + "\n"
                            for i in range(n)))
    return str(path)


def test_a_weighted_mixture_logs_its_per_source_counts_once(tmp_path, caplog):
    a, b = write_rows(tmp_path / "a.jsonl", 9), write_rows(tmp_path / "b.jsonl", 3)
    spec = [{"path": a, "weight": 2}, {"path": b, "weight": 1}]
    reporter = make_reporter(tmp_path, overrides=(f"data.train={json.dumps(spec)}",))
    with caplog.at_level(logging.INFO, logger="twinkle.train"):
        summary = reporter.log_mixture()
    reporter.close()
    # 12 rows split 2:1 -> a.jsonl 8 (subsampled from 9), b.jsonl 4 (3 and one repeated)
    assert console(caplog) == ["data: 2 sources, 12 rows: a.jsonl 8 (weight 2), b.jsonl 4 (weight 1)"]
    assert summary == {"rows": 12, "sources": [{"name": a, "file_rows": 9, "rows": 8, "weight": 2.0},
                                               {"name": b, "file_rows": 3, "rows": 4, "weight": 1.0}]}
    [record] = log_lines(tmp_path)
    assert record["event"] == "data" and record["mixture"] == summary
    # the counts are those of the mixture the task trains on
    mixed = Counter(r.source for r in load_spec(spec, seed=5))
    assert {s.name: s.rows for s in count_mixture(spec).sources} == dict(mixed)


def test_one_source_logs_no_mixture(tmp_path, caplog):
    reporter = make_reporter(tmp_path)
    with caplog.at_level(logging.INFO, logger="twinkle.train"):
        assert reporter.log_mixture() is None
    reporter.close()
    assert not console(caplog)
