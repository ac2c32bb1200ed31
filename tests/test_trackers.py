"""Experiment trackers (``train.report_to``): the contract, validation, failure handling and the optional libraries
(wandb, MLflow, SwanLab) offline, each read back from what it wrote.

This module is also a Twinkle plugin (``TWINKLE_PLUGINS=twinkle_test_tracker_fakes``): it registers a recording
tracker, trackers that fail, and a task whose log line carries loss-specific metrics.
"""

from __future__ import annotations

import functools
import glob
import importlib
import json
import logging
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from twinkle_core import hookimpl
from twinkle_core.errors import ConfigError, PluginNotFoundError
from twinkle_core.plugins import get_plugins, reset_plugins
from twinkle_core.records import TaskRecord, TrackerRecord
from twinkle_core.trackers import Tracker, TrackerError, check_trackers, tracker_names
from twinkle_core.train.logging import TrainLogger, read_log

TESTS = Path(__file__).resolve().parent
FAKES = "twinkle_test_tracker_fakes"
sys.modules.setdefault(FAKES, sys.modules[__name__])  # one copy of the fakes below, whoever imports them
LOOP_FAKES = "twinkle_test_loop_fakes"


# ---------------------------------------------------------------------- plugin
@hookimpl
def twinkle_register_trackers():
    yield TrackerRecord("recording", f"{FAKES}:RecordingTracker", "keeps what it is given (test fixture)")
    yield TrackerRecord("flaky", f"{FAKES}:FlakyTracker", "raises on every log call (test fixture)")
    yield TrackerRecord("broken_start", f"{FAKES}:BrokenStartTracker", "raises in start (test fixture)")
    yield TrackerRecord("needs_lib", f"{FAKES}:NeedsLibraryTracker", "needs a library that is absent")


@hookimpl
def twinkle_register_tasks():
    yield TaskRecord("tracker_fake_task", f"{FAKES}:MetricsTask", "the loop's fake task with RL-style metrics")


class RecordingTracker(Tracker):
    runs: list[RecordingTracker] = []

    def __init__(self, tag: str = "") -> None:
        super().__init__(tag=tag)
        self.started: tuple | None = None
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.status: str | None = None
        RecordingTracker.runs.append(self)

    def start(self, run_config, output_dir, run_name):
        self.started = (run_config, str(output_dir), run_name)

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self, status):
        self.status = status


class FlakyTracker(RecordingTracker):
    def log(self, metrics, step):
        raise ConnectionError("tracking server unreachable")


class BrokenStartTracker(RecordingTracker):
    def start(self, run_config, output_dir, run_name):
        raise PermissionError("invalid API key")


class NeedsLibraryTracker(RecordingTracker):
    requires = {"twinkle_no_such_tracking_lib": "pip install no-such-tracking-lib"}


@functools.cache
def _metrics_task():
    base = importlib.import_module(LOOP_FAKES).FakeTask

    class MetricsTask(base):
        name = "tracker_fake_task"

        def step_metrics(self):
            return {"rewards/chosen": 0.75, "clip_fraction": 0.125}

    return MetricsTask


def __getattr__(name: str) -> Any:  # MetricsTask is built on first use: it needs tests/test_loop.py importable
    if name == "MetricsTask":
        return _metrics_task()
    raise AttributeError(name)


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def registry(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("TWINKLE_PLUGINS", f"test_loop,{FAKES}")
    monkeypatch.setenv("TWINKLE_NO_PROGRESS", "1")
    RecordingTracker.runs.clear()
    reset_plugins()
    yield
    reset_plugins()


def make_recipe(tmp_path: Path, **train: Any) -> dict:
    data = tmp_path / "train.txt"
    data.write_text("\n".join(str(i) for i in range(1, 9)))
    (tmp_path / "model").mkdir(exist_ok=True)
    return {
        "task": "tracker_fake_task",
        "model": {"class_name": "LoopFakeModel", "model_id": str(tmp_path / "model")},
        "data": {"train": str(data), "batch_size": 2},
        "optimizer": {"lr": 0.1},
        "lr_scheduler": {"name": "constant"},
        "train": {"output_dir": str(tmp_path / "out"), "max_grad_norm": None, "max_steps": 2, **train},
    }


def run(recipe: dict) -> dict:
    from twinkle_core.train.loop import train

    return train(recipe)


def requires(module: str):
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure to import means the tracker cannot be tested here
        return pytest.mark.skip(reason=f"{module} is not importable here ({type(exc).__name__}: {exc}); "
                                       f"pip install {module} to run this test")
    return pytest.mark.skipif(False, reason=f"{module} is importable")


# ---------------------------------------------------------------------- contract and validation
def test_builtin_trackers_are_registered():
    names = get_plugins().names("tracker")
    assert {"tensorboard", "wandb", "mlflow", "swanlab"} <= set(names)
    for name in ("tensorboard", "wandb", "mlflow", "swanlab"):
        assert issubclass(get_plugins().load("tracker", name), Tracker)


def test_report_to_takes_a_name_or_a_list():
    assert tracker_names(None) is None
    assert tracker_names("mlflow") == ["mlflow"]
    assert tracker_names(["jsonl", "tensorboard", "wandb", "wandb"]) == ["tensorboard", "wandb"]
    assert tracker_names("none") == [] and tracker_names([]) == []


def test_recipe_accepts_report_to_and_tracker_options(tmp_path):
    from twinkle_core.train.recipe import recipe_from_dict

    recipe = recipe_from_dict(make_recipe(tmp_path, report_to="recording", tracker_options={"recording": {"tag": "x"}}))
    assert recipe.train.report_to == "recording"
    assert recipe.train.tracker_options == {"recording": {"tag": "x"}}
    assert recipe_from_dict(make_recipe(tmp_path, report_to=["jsonl", "recording"])).train.report_to == [
        "jsonl", "recording"]


def test_unknown_tracker_suggests_the_installed_one():
    with pytest.raises(PluginNotFoundError) as info:
        check_trackers(["wandbb"])
    message = str(info.value)
    assert message.startswith("train.report_to: no tracker named 'wandbb'")
    assert "did you mean 'wandb'?" in message and "mlflow" in message
    with pytest.raises(PluginNotFoundError, match="did you mean 'tensorboard'"):
        check_trackers("tb")


def test_missing_library_names_the_pip_install():
    with pytest.raises(ConfigError, match=r"train.report_to: the tracker 'needs_lib' needs a library .*pip install "
                                          r"no-such-tracking-lib"):
        check_trackers(["needs_lib"])


def test_missing_library_of_a_builtin(monkeypatch):
    import twinkle_core.trackers as trackers

    real = trackers._installed
    monkeypatch.setattr(trackers, "_installed", lambda module: module != "wandb" and real(module))
    with pytest.raises(ConfigError, match="install it with: pip install wandb"):
        check_trackers(["jsonl", "wandb"])


def test_tracker_options_are_checked_against_the_tracker():
    with pytest.raises(ConfigError, match="train.tracker_options.recording.bogus"):
        check_trackers(["recording"], {"recording": {"bogus": 1}})
    with pytest.raises(PluginNotFoundError, match="train.tracker_options.wandbb: no tracker named 'wandbb'"):
        check_trackers(["recording"], {"wandbb": {}})
    assert check_trackers([], {"recording": {"bogus": 1}}) == []  # not in use: not checked


def test_dry_run_refuses_an_unknown_or_uninstalled_tracker(tmp_path, monkeypatch, capsys):
    import yaml

    from twinkle_core import cli

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(make_recipe(tmp_path)))
    assert cli.main(["train", str(path), "train.report_to=[jsonl, recording]", "--dry-run"]) == 0
    assert cli.main(["train", str(path), "train.report_to=[wandbb]", "--dry-run"]) == 2
    assert "did you mean 'wandb'" in capsys.readouterr().err
    assert cli.main(["train", str(path), "train.report_to=needs_lib", "--dry-run"]) == 2
    assert "pip install no-such-tracking-lib" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- the logger and the loop
def test_logger_sends_every_numeric_value_to_the_trackers(tmp_path):
    with TrainLogger(tmp_path, report_to=["recording"], run_config={"optimizer": {"lr": 0.1}}) as log:
        log.log("train", 1, {"loss": 2.0, "lr": 0.1, "rewards/chosen": 0.5, "nan": float("nan"), "ok": True,
                             "note": "text", "grad_norm": None})
        log.log("eval", 1, {"eval_loss": 1.5})
    (tracker,) = RecordingTracker.runs
    assert tracker.started == ({"optimizer": {"lr": 0.1}}, str(tmp_path), tmp_path.name)
    assert tracker.logged == [(1, {"train/loss": 2.0, "train/lr": 0.1, "train/rewards/chosen": 0.5}),
                              (1, {"eval/eval_loss": 1.5})]
    assert tracker.status == "success"
    assert [r["event"] for r in read_log(tmp_path)] == ["train", "eval"]  # JSONL is always written


def test_trainer_reports_the_recipe_and_loss_specific_metrics(tmp_path):
    summary = run(make_recipe(tmp_path, report_to=["jsonl", "recording"], tracker_options={"recording": {"tag": "t"}}))
    assert summary["steps"] == 2
    (tracker,) = RecordingTracker.runs
    assert tracker.options == {"tag": "t"}
    config, output_dir, run_name = tracker.started
    assert config["optimizer"]["lr"] == 0.1 and config["train"]["report_to"] == ["jsonl", "recording"]
    assert output_dir == str(tmp_path / "out") and run_name == "out"
    assert [step for step, _ in tracker.logged] == [1, 2]
    step_1 = tracker.logged[0][1]
    assert step_1["train/loss"] == read_log(tmp_path / "out")[0]["loss"]
    assert step_1["train/rewards/chosen"] == 0.75 and step_1["train/clip_fraction"] == 0.125
    assert tracker.status == "success"


def test_a_tracker_failing_to_log_warns_once_and_training_goes_on(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="twinkle.train"):
        summary = run(make_recipe(tmp_path, max_steps=3, report_to=["flaky", "recording"]))
    assert summary["steps"] == 3
    warnings = [r.getMessage() for r in caplog.records if "failed to log" in r.getMessage()]
    assert len(warnings) == 1 and "'flaky'" in warnings[0] and "tracking server unreachable" in warnings[0]
    assert any("'flaky': 3 of 3 log calls failed" in r.getMessage() for r in caplog.records)
    flaky, recording = RecordingTracker.runs
    assert len(recording.logged) == 3 and flaky.status == recording.status == "success"


def test_a_tracker_failing_to_start_stops_the_run_before_training(tmp_path):
    with pytest.raises(TrackerError, match=r"the tracker 'broken_start' .*could not start: PermissionError: invalid "
                                           r"API key"):
        run(make_recipe(tmp_path, report_to=["recording", "broken_start"]))
    recording = RecordingTracker.runs[0]
    assert recording.status == "failed" and recording.logged == []
    assert not (tmp_path / "out" / "logs.jsonl").exists()


@pytest.mark.parametrize(("error", "status"), [(RuntimeError, "failed"), (KeyboardInterrupt, "interrupted")])
def test_a_run_ended_by_an_error_is_finished_as_such(tmp_path, error, status):
    with pytest.raises(error):
        with TrainLogger(tmp_path, report_to="recording"):
            raise error
    assert RecordingTracker.runs[0].status == status


def test_trackers_run_on_the_main_process_only(tmp_path):
    log = TrainLogger(tmp_path, enabled=False, report_to=["recording"])
    log.log("train", 1, {"loss": 1.0})
    log.close()
    assert RecordingTracker.runs == [] and not (tmp_path / "logs.jsonl").exists()


def test_tensorboard_default_stays_as_before(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    with TrainLogger(tmp_path / "a") as log:
        log.log("train", 1, {"loss": 1.0})
    assert list((tmp_path / "a" / "tensorboard").iterdir())
    with TrainLogger(tmp_path / "b", tensorboard=False) as log:
        log.log("train", 1, {"loss": 1.0})
    assert not (tmp_path / "b" / "tensorboard").exists()
    monkeypatch.setenv("TWINKLE_TENSORBOARD", "0")
    with TrainLogger(tmp_path / "c") as log:
        log.log("train", 1, {"loss": 1.0})
    assert not (tmp_path / "c" / "tensorboard").exists()
    with TrainLogger(tmp_path / "d", report_to=["tensorboard"]) as log:  # asked for explicitly
        log.log("train", 1, {"loss": 1.0})
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "d" / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == [1.0]


# ---------------------------------------------------------------------- the optional libraries, offline
def _log_two_steps(tmp_path: Path, name: str, options: dict) -> None:
    with TrainLogger(tmp_path / "out", report_to=[name], tracker_options={name: options},
                     run_config={"optimizer": {"lr": 0.1}, "task": "causal_lm"}) as log:
        log.log("train", 1, {"loss": 2.5, "rewards/chosen": 0.5})
        log.log("train", 2, {"loss": 2.0, "rewards/chosen": 0.625})


@requires("mlflow")
@pytest.mark.parametrize("store", ["sqlite", "file"])
def test_mlflow_with_a_local_store(tmp_path, monkeypatch, store):
    from mlflow.tracking import MlflowClient

    if store == "file":  # MLflow 3.x refuses its file store unless asked for it
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri() if store == "file" else f"sqlite:///{tmp_path / 'mlflow.db'}"
    _log_two_steps(tmp_path, "mlflow", {"tracking_uri": uri, "experiment_name": "exp",
                                        "artifact_location": (tmp_path / "artifacts").as_uri()})
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.info.run_name == "out" and run.info.status == "FINISHED"
    assert run.data.params["optimizer.lr"] == "0.1" and run.data.params["task"] == "causal_lm"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.5), (2, 2.0)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "train/rewards/chosen")] == [0.5, 0.625]
    assert json.loads(client.download_artifacts(run.info.run_id, "recipe.json", str(tmp_path)) and
                      (tmp_path / "recipe.json").read_text())["optimizer"] == {"lr": 0.1}


def read_wandb_records(path: str) -> list[Any]:
    """The protobuf records of an offline run's ``run-*.wandb`` file (a LevelDB-style log: 32 KiB blocks of chunks
    with 7-byte headers after a 7-byte file header); wandb itself no longer ships a Python reader."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, block, records, pending = Path(path).read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):  # block padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full/first start a record; middle/last extend it
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@requires("wandb")
def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log_two_steps(tmp_path, "wandb", {"project": "twinkle-test"})
    (data,) = glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    # wandb's service process writes the file; on a loaded machine its last records can land just after
    # finish() returns, so read until both steps are there (or 30 s pass)
    deadline = time.monotonic() + 30
    while True:
        rows, config = [], {}
        for record in read_wandb_records(data):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
            elif kind == "run":
                assert record.run.display_name == "out" and record.run.project == "twinkle-test"
                config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        if len(rows) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [(row["_step"], row["train/loss"], row["train/rewards/chosen"]) for row in rows] == [
        (1, 2.5, 0.5), (2, 2.0, 0.625)]
    assert config["optimizer"] == {"lr": 0.1} and config["task"] == "causal_lm"


@requires("swanlab")
def test_swanlab_offline(tmp_path):
    _log_two_steps(tmp_path, "swanlab", {"mode": "offline", "project": "twinkle-test"})
    (run_dir,) = glob.glob(str(tmp_path / "out" / "swanlog" / "run-*"))
    config = Path(run_dir, "files", "config.yaml").read_text()
    assert "optimizer" in config and "lr: 0.1" in config
    (data,) = glob.glob(os.path.join(run_dir, "*.swanlab"))
    try:  # SwanLab's own reader (internal API): the scalars as written
        from swanlab.proto.swanlab.record.v1.record_pb2 import Record
        from swanlab.sdk.internal.core_python.store import DataStoreReader
    except ImportError:
        assert b"train/loss" in Path(data).read_bytes()
        return
    reader, scalars = DataStoreReader(), []
    reader.open(data)
    while (raw := reader.scan()) is not None:
        record = Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "scalar":
            scalars.append((record.scalar.key, record.scalar.step, record.scalar.value.number))
    reader.close()
    assert ("train/loss", 1, 2.5) in scalars and ("train/loss", 2, 2.0) in scalars
    assert ("train/rewards/chosen", 2, 0.625) in scalars


# ---------------------------------------------------------------------- end to end
@requires("mlflow")
def test_twinkle_train_reports_to_mlflow(tmp_path, monkeypatch):
    """``twinkle train`` (a subprocess) with ``report_to: [jsonl, mlflow]`` for 2 steps; the metrics read back."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(textwrap.dedent(f"""
        task: tracker_fake_task
        model: {{class_name: LoopFakeModel, model_id: model}}
        data: {{train: train.txt, batch_size: 2}}
        optimizer: {{lr: 0.1}}
        lr_scheduler: {{name: constant}}
        train:
          output_dir: out
          max_steps: 2
          report_to: [jsonl, mlflow]
          tracker_options: {{mlflow: {{tracking_uri: "{uri}", experiment_name: e2e}}}}
    """))
    (tmp_path / "train.txt").write_text("\n".join(str(i) for i in range(1, 9)))
    (tmp_path / "model").mkdir()
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TWINKLE_", "MLFLOW_")) and k != "PYTHONPATH"}
    env.update({"PYTHONPATH": str(TESTS), "MLFLOW_ALLOW_FILE_STORE": "true", "TWINKLE_DISABLE_PLUGIN_AUTOLOAD": "1", "TWINKLE_NO_PROGRESS": "1",
                "TWINKLE_PLUGINS": "test_loop,test_trackers"})
    result = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(recipe)], capture_output=True,
                            text=True, env=env, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [r for r in read_log(tmp_path / "out") if r["event"] == "train"]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["train.max_steps"] == "2"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in logged]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "train/clip_fraction")] == [0.125, 0.125]
