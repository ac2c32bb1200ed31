"""Start-up timing: where the time before the first optimizer step goes (``summary["startup"]``).

No assertion is about how long anything takes: only which phases are reported, that every duration is
non-negative and that the phases add up to no more than the total.
"""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest

from twinkle_core.plugins import reset_plugins
from twinkle_core.train import logging as train_logging
from twinkle_core.train.logging import StartupTimer, process_age, start_startup_timer, take_startup_timer

TESTS = Path(__file__).resolve().parent
BUILD_PHASES = ["plugins", "imports", "tokenizer", "data", "model", "setup"]
SLACK = 1e-3  # the report rounds every phase to 0.1 ms


def check_report(report: dict, phases: list[str]) -> None:
    assert set(report) == {"phases", "total_s", "cpu", "cpu_total_s"}
    assert list(report["phases"]) == phases
    assert list(report["cpu"]) == phases
    for key in ("phases", "cpu"):
        assert all(seconds >= 0 for seconds in report[key].values()), report
    assert report["total_s"] >= 0 and report["cpu_total_s"] >= 0
    assert sum(report["phases"].values()) <= report["total_s"] + SLACK
    assert sum(report["cpu"].values()) <= report["cpu_total_s"] + SLACK


# ---------------------------------------------------------------------- the timer
def test_phases_add_up_and_repeat_phases_accumulate():
    timer = StartupTimer()
    with timer.phase("a"):
        sum(range(1000))
    with timer.phase("b"):
        pass
    first_a = timer.phases["a"]
    with timer.phase("a"):
        sum(range(1000))
    assert timer.phases["a"] >= first_a
    timer.add("c", 0.0)
    report = timer.report()
    check_report(report, ["a", "b", "c"])
    assert "a 0." in StartupTimer.format(report) and "total" in StartupTimer.format(report)


def test_a_phase_that_raises_is_still_counted():
    timer = StartupTimer()
    with pytest.raises(ValueError), timer.phase("broken"):
        raise ValueError("x")
    check_report(timer.report(), ["broken"])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process start time comes from /proc")
def test_counting_from_the_process_start_adds_python_startup():
    age = process_age()
    assert age is not None and age >= 0
    timer = StartupTimer(since_process_start=True)
    with timer.phase("work"):
        pass
    report = timer.report()
    check_report(report, ["python_startup", "work"])
    assert report["total_s"] >= report["phases"]["python_startup"]


def test_the_command_hands_its_timer_to_one_trainer():
    started = start_startup_timer(since_process_start=False)
    assert take_startup_timer() is started
    fresh = take_startup_timer()  # the next run in the same process starts its own clock
    assert fresh is not started and fresh.phases == {}
    assert train_logging._pending_timer is None


# ---------------------------------------------------------------------- a run reports it
@pytest.fixture
def fake_registry(monkeypatch):
    """The fake model and task of tests/test_loop.py as the only plugin (what tests/test_cli.py uses)."""
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("TWINKLE_PLUGINS", "test_loop")
    monkeypatch.setenv("TWINKLE_NO_PROGRESS", "1")
    monkeypatch.delenv("TWINKLE_TRUST_REMOTE_CODE", raising=False)
    monkeypatch.setattr(train_logging, "_pending_timer", None)
    reset_plugins()
    yield
    reset_plugins()


def write_recipe(tmp_path: Path, **train: object) -> Path:
    (tmp_path / "train.txt").write_text("\n".join(str(i) for i in range(1, 9)))
    (tmp_path / "model").mkdir()
    extra = "".join(f", {key}: {json.dumps(value)}" for key, value in train.items())
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent(f"""\
        task: loop_fake_task
        model: {{class_name: LoopFakeModel, model_id: ./model}}
        data: {{train: train.txt, eval: train.txt, batch_size: 2}}
        optimizer: {{lr: 0.1}}
        lr_scheduler: {{name: constant}}
        train: {{output_dir: out, max_steps: 3, max_grad_norm: null{extra}}}
    """))
    return path


def test_a_run_reports_its_startup_in_the_summary(tmp_path, fake_registry):
    from twinkle_core.train.loop import train

    summary = train(str(write_recipe(tmp_path, eval_before_training=True)))
    check_report(summary["startup"], [*BUILD_PHASES, "eval_before", "first_step"])
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert saved["startup"] == summary["startup"]


def test_twinkle_train_times_its_own_phases_and_logs_them_at_debug_level(tmp_path, fake_registry, caplog):
    from twinkle_core import cli

    caplog.set_level(logging.DEBUG, logger="twinkle.train")
    assert cli.main(["train", str(write_recipe(tmp_path))]) == 0
    startup = json.loads((tmp_path / "out" / "summary.json").read_text())["startup"]
    proc = ["python_startup"] if process_age() is not None else []
    # the trainer's own plugin look-up adds to the command's
    check_report(startup, [*proc, "recipe", "plugins", "validate", *BUILD_PHASES[1:], "first_step"])
    assert any(r.getMessage().startswith("start-up (s): ") for r in caplog.records)


def test_a_run_that_makes_no_step_reports_no_startup(tmp_path, fake_registry):
    from twinkle_core.train.loop import train

    recipe = str(write_recipe(tmp_path, max_steps=2, save_every=2))
    assert train(recipe)["startup"] is not None
    again = train(recipe, resume="latest")  # already at max_steps: nothing to time up to a first step
    assert again["steps"] == 2 and again["startup"] is None
