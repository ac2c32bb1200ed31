"""One run per output directory over time, and no ``final`` for a run that never took a finite step (issue 27).

* A new run (no ``--resume``) into a ``train.output_dir`` that holds another run's checkpoints, ``final`` or log
  (a run that saved nothing) is refused before anything is built (also by ``--dry-run``), naming that run and the
  fixes; a cache alone is no run; ``--overwrite`` removes the previous run's
  checkpoints, ``final`` and logs (caches stay) and starts afresh; ``--resume latest`` continues as before.
  ``--resume-weights-only latest --overwrite`` starts over in its own directory from the newest checkpoint there.
* A run whose every step had a non-finite loss or gradient norm, too short for the ``MAX_NONFINITE_STEPS`` guard,
  fails with ``TrainingDivergedError`` and writes no ``final``.

Uses the fake model, task and recipe helpers of tests/test_loop.py (loaded under its plugin name), and a tiny real
``TransformersModel`` through ``twinkle train`` in this process where markers with run ids matter.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time
from pathlib import Path

import pytest
import yaml

from twinkle_core import checkpoint, cli
from twinkle_core.commands.train import train_job
from twinkle_core.errors import ConfigError
from twinkle_core.launch import torchrun_argv
from twinkle_core.train import loop

FAKES = "twinkle_test_loop_fakes"
if FAKES not in sys.modules:  # the same loading as tests/test_loop_reliability.py
    _spec = importlib.util.spec_from_file_location("tests.test_loop", Path(__file__).with_name("test_loop.py"))
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["tests.test_loop"] = _module
    _spec.loader.exec_module(_module)
fakes = sys.modules[FAKES]
FakeModel = fakes.FakeModel
registry = fakes.registry  # test_loop.py's autouse fixture: the fake plugin registered, progress off
QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart"


def dirs(output_dir: Path) -> list[str]:
    return sorted(p.name for p in output_dir.iterdir() if p.is_dir() and p.name != "tensorboard")


def logged_steps(output_dir: Path) -> list[int]:
    return [r["step"] for r in fakes.train_log(output_dir)]


# ---------------------------------------------------------------------- a new run into a used directory
def test_a_new_run_into_a_used_directory_is_refused_before_anything_is_built(tmp_path):
    recipe = fakes.make_recipe(tmp_path, train={"max_steps": 2, "save_every": 1})
    fakes.run(recipe)
    out = tmp_path / "out"
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    FakeModel.instances.clear()
    started = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        fakes.run(recipe)
    elapsed = time.perf_counter() - started
    text = str(info.value)
    assert f"train.output_dir {out} already holds the checkpoints of" in text
    assert "(checkpoint-1, checkpoint-2, final)" in text
    assert "--resume latest" in text and "--overwrite" in text and "overwrite=True" in text
    assert FakeModel.instances == []  # refused before the model (or anything else) was built
    assert elapsed < 1.0, elapsed
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing touched
    assert not (out / ".twinkle.lock").exists()


def test_an_interrupted_checkpoint_alone_also_counts(tmp_path):
    with pytest.raises(fakes.Stop):
        fakes.run(fakes.make_recipe(tmp_path, model={"options": {"fail_at": {"step": 2}}}, train={"max_steps": 4}))
    assert dirs(tmp_path / "out") == ["checkpoint-1-interrupted"]
    with pytest.raises(ConfigError, match=r"\(checkpoint-1-interrupted\)"):
        fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 4}))
    summary = fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 4}), resume="latest")
    assert summary["resumed_from"].endswith("checkpoint-1-interrupted") and summary["steps"] == 4


def test_a_run_that_saved_nothing_still_counts_by_its_log(tmp_path):
    """A run that stopped before its first checkpoint left only logs.jsonl: a new run would append to it."""
    (tmp_path / "train.txt").write_text("nan nan nan nan")
    with pytest.raises(loop.TrainingDivergedError):
        fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 2}))
    out = tmp_path / "out"
    assert dirs(out) == [] and logged_steps(out) == [1, 2]
    (tmp_path / "train.txt").write_text("1 2 3 4")
    recipe = fakes.make_recipe(tmp_path, train={"max_steps": 2})
    with pytest.raises(ConfigError) as info:
        fakes.run(recipe)
    text = str(info.value)
    assert (f"train.output_dir {out} already holds the logs of an earlier run (logs.jsonl), a run that saved no "
            f"checkpoint; a new run there would append its log lines") in text
    assert "--overwrite" in text and "new directory" in text and "--resume latest" in text
    assert logged_steps(out) == [1, 2]  # nothing touched

    assert fakes.run(recipe, resume="latest")["steps"] == 2  # resume keeps appending, from step 0
    assert logged_steps(out) == [1, 2, 1, 2]
    assert fakes.run(recipe, overwrite=True)["steps"] == 2
    assert logged_steps(out) == [1, 2]


def test_the_logs_are_named_beside_the_checkpoints(tmp_path):
    fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 1, "save_every": 1}))
    with pytest.raises(ConfigError, match=r"holds the checkpoints of an earlier run \(checkpoint-1, final\) and its logs "
                                          r"\(logs.jsonl, summary.json\); a new run there would mix"):
        fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 1}))


def test_a_data_cache_or_other_files_alone_are_no_run(tmp_path):
    out = tmp_path / "out"
    (out / "data_cache" / "0123abcd").mkdir(parents=True)  # e.g. tokenised by a run that was refused or --dry-run
    (out / "notes.txt").write_text("mine")
    assert fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 1}))["steps"] == 1


def test_overwrite_discards_the_previous_run_and_keeps_caches(tmp_path, caplog):
    fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 4, "save_every": 1}))
    out = tmp_path / "out"
    (out / "data_cache").mkdir()
    (out / "data_cache" / "tokens.bin").write_text("cached")
    (out / ".checkpoint-5.incomplete").mkdir()  # what a save killed half-way leaves
    (out / "notes.txt").write_text("mine")
    assert logged_steps(out) == [1, 2, 3, 4]

    with caplog.at_level(logging.INFO, logger="twinkle.train"):
        summary = fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 2, "save_every": 1}), overwrite=True)
    assert summary["steps"] == 2
    assert dirs(out) == ["checkpoint-1", "checkpoint-2", "data_cache", "final"]
    assert (out / "data_cache" / "tokens.bin").read_text() == "cached" and (out / "notes.txt").exists()
    assert logged_steps(out) == [1, 2]  # the old run's log lines are gone with it
    removed = next(r.getMessage() for r in caplog.records if "--overwrite: removed" in r.getMessage())
    for name in ("checkpoint-3", "checkpoint-4", "final", ".checkpoint-5.incomplete", "logs.jsonl", "summary.json"):
        assert name in removed, removed
    assert "kept" in caplog.text and "data_cache" in caplog.text


def test_overwrite_into_an_empty_directory_is_a_plain_start(tmp_path):
    assert fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 1}), overwrite=True)["steps"] == 1


def test_resume_latest_still_continues_and_excludes_overwrite(tmp_path):
    fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 2, "save_every": 2}))
    summary = fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 4}), resume="latest")
    assert summary["resumed_from"] == str(tmp_path / "out" / "checkpoint-2") and summary["steps"] == 4
    assert logged_steps(tmp_path / "out") == [1, 2, 3, 4]
    with pytest.raises(ConfigError, match="--overwrite discards the previous run .* pass one of them"):
        fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 4}), resume="latest", overwrite=True)


def test_resume_latest_over_a_finished_run_without_checkpoints_is_refused(tmp_path):
    fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 2}))  # no save_every: final only
    assert dirs(tmp_path / "out") == ["final"]
    with pytest.raises(ConfigError, match="holds no checkpoint-N to continue, only the final model of .* --overwrite"):
        fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 2}), resume="latest")
    assert fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 2}), overwrite=True)["steps"] == 2


def test_weights_only_latest_starts_over_in_its_own_directory_with_overwrite(tmp_path, monkeypatch):
    fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 3, "save_every": 3}))
    out = tmp_path / "out"
    trained_w = json.loads((out / "checkpoint-3" / "state.json").read_text())["w"]
    with pytest.raises(ConfigError, match="--resume-weights-only starts a new run: with --overwrite the weights"):
        fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 2}), resume_weights_only="latest")

    loaded = []
    original = FakeModel.load

    def load(self, path, **kwargs):  # the source must still be there when its weights are read
        original(self, path, **kwargs)
        loaded.append((path, self.w))

    monkeypatch.setattr(FakeModel, "load", load)
    summary = fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 2, "save_every": 1}),
                        resume_weights_only="latest", overwrite=True)
    assert loaded == [(str(out / "checkpoint-3"), trained_w)]
    assert summary["resumed_from"] == str(out / "checkpoint-3") and summary["steps"] == 2
    assert dirs(out) == ["checkpoint-1", "checkpoint-2", "final"]  # the source went with the previous run
    assert logged_steps(out) == [1, 2]


def test_weights_only_from_another_directory_into_an_empty_one_needs_nothing(tmp_path):
    fakes.run(fakes.make_recipe(tmp_path, out="src", train={"max_steps": 2}))
    summary = fakes.run(fakes.make_recipe(tmp_path, out="dst", train={"max_steps": 1}),
                        resume_weights_only=str(tmp_path / "src" / "final"))
    assert summary["steps"] == 1 and (tmp_path / "src" / "final").is_dir()


# ---------------------------------------------------------------------- the command line
def write_recipe(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(fakes.make_recipe(tmp_path, **sections)))
    return path


def test_twinkle_train_refuses_before_importing_the_backend_and_overwrite_reaches_torchrun(tmp_path, capsys,
                                                                                           monkeypatch):
    recipe = write_recipe(tmp_path, train={"max_steps": 2, "save_every": 1})
    assert cli.main(["train", str(recipe)]) == 0
    capsys.readouterr()

    from twinkle_core.train import recipe as recipe_module

    def no_validation(*args, **kwargs):
        raise AssertionError("validated the components: the refusal came too late")

    with monkeypatch.context() as patch:
        patch.setattr(recipe_module, "validate_components", no_validation)
        started = time.perf_counter()
        assert cli.main(["train", str(recipe)]) == 2
        elapsed = time.perf_counter() - started
        err = capsys.readouterr().err
        assert "already holds the checkpoints of" in err and "--resume latest" in err and "--overwrite" in err
        # a launcher refuses before torchrun starts any process
        assert cli.main(["train", str(recipe), "--nproc-per-node", "2"]) == 2
    assert elapsed < 2.0, elapsed
    assert cli.main(["train", str(recipe), "--overwrite", "train.max_steps=1"]) == 0
    assert dirs(tmp_path / "out") == ["checkpoint-1", "final"]
    assert cli.main(["train", str(recipe), "--resume", "latest", "train.max_steps=2"]) == 0
    assert cli.main(["train", str(recipe), "--resume", "latest", "--overwrite"]) == 2
    assert "pass one of them" in capsys.readouterr().err

    args = cli.build_parser().parse_args(["train", "r.yaml", "--nproc-per-node", "2", "--overwrite"])
    assert torchrun_argv(args, train_job(args))[-1] == "--overwrite"  # every worker gets it


def test_a_dry_run_reports_the_used_directory_too(tmp_path, capsys):
    recipe = write_recipe(tmp_path, train={"max_steps": 1})
    assert cli.main(["train", str(recipe)]) == 0
    capsys.readouterr()
    assert cli.main(["train", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"train.output_dir {tmp_path / 'out'} already holds the checkpoints of" in err
    assert "--resume latest" in err and "--overwrite" in err and "new directory" in err
    assert cli.main(["train", str(recipe), "--dry-run", "--overwrite"]) == 0
    assert cli.main(["train", str(recipe), "--dry-run", "--resume", "latest"]) == 2  # only final: nothing to resume


@pytest.fixture
def real_backend(monkeypatch):
    pytest.importorskip("twinkle_backend_hf")
    from twinkle_core.plugins import reset_plugins

    monkeypatch.delenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("TWINKLE_PLUGINS", raising=False)
    reset_plugins()
    yield
    reset_plugins()


def tiny_recipe(tmp_path: Path) -> Path:
    from twinkle_backend_hf.testing import tiny_qwen2_config

    recipe = {
        "task": "causal_lm",
        "model": {"class_name": "TransformersModel", "tokenizer": str(QUICKSTART / "tokenizer"),
                  "config": tiny_qwen2_config(262, bos_token_id=0, eos_token_id=0, pad_token_id=0)},
        "precision": "no",
        "data": {"train": str(QUICKSTART / "train.jsonl"), "mode": "chat", "max_length": 32, "batch_size": 2},
        "optimizer": {"name": "AdamW", "lr": 1e-2},
        "train": {"output_dir": str(tmp_path / "out"), "max_steps": 2, "save_every": 1, "seed": 3},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_twinkle_train_end_to_end_with_a_real_model(tmp_path, capsys, caplog, real_backend):
    """The issue's scenario with real checkpoints (markers with run ids): fresh, refused, overwritten, resumed."""
    recipe, out = tiny_recipe(tmp_path), tmp_path / "out"
    assert cli.main(["train", str(recipe)]) == 0
    first = checkpoint.read_marker(out / "final")["run_id"]
    capsys.readouterr()

    started = time.perf_counter()
    assert cli.main(["train", str(recipe)]) == 2
    elapsed = time.perf_counter() - started
    err = capsys.readouterr().err
    assert f"already holds the checkpoints of run {first} (checkpoint-1, checkpoint-2, final)" in err, err
    assert elapsed < 2.0, elapsed

    assert cli.main(["train", str(recipe), "--overwrite", "train.max_steps=1"]) == 0
    second = checkpoint.read_marker(out / "final")["run_id"]
    assert second != first and dirs(out) == ["checkpoint-1", "data_cache", "final"]
    assert {checkpoint.read_marker(p)["run_id"] for p in (out / "checkpoint-1", out / "final")} == {second}

    with caplog.at_level(logging.INFO, logger="twinkle.train"):
        assert cli.main(["train", str(recipe), "--resume", "latest"]) == 0
    assert f"resumed from {out / 'checkpoint-1'} at step 1" in caplog.text
    assert checkpoint.read_marker(out / "checkpoint-2")["run_id"] == second  # the same run, continued


# ---------------------------------------------------------------------- a run without a finite step
def test_a_short_run_without_one_finite_step_fails_and_writes_no_final(tmp_path):
    (tmp_path / "train.txt").write_text("nan nan nan nan")  # NaN labels: every loss is NaN, from the first step
    recipe = fakes.make_recipe(tmp_path, train={"max_steps": 2, "save_every": 1})
    with pytest.raises(loop.TrainingDivergedError) as info:
        fakes.run(recipe)
    text = str(info.value)
    assert "every one of the 2 optimizer steps of this run (up to step 2) had a non-finite loss or gradient norm" in text
    assert "no final model was written" in text and "optimizer.lr=0.1, precision='no', loss 'mse'" in text
    assert "beta" in text
    out = tmp_path / "out"
    assert dirs(out) == ["checkpoint-1", "checkpoint-2"]  # the checkpoints stay; no final, no interrupted one
    assert not (out / "summary.json").exists()


def test_the_command_line_reports_it_as_one_error(tmp_path, capsys):
    (tmp_path / "train.txt").write_text("nan nan nan nan")
    recipe = write_recipe(tmp_path, train={"max_steps": 2})
    assert cli.main(["train", str(recipe)]) == 1
    err = capsys.readouterr().err
    assert "twinkle: error: TrainingDivergedError: training diverged: every one of the 2 optimizer steps" in err
    assert "Traceback" not in err


def test_a_real_model_that_never_takes_a_finite_step(tmp_path, capsys, real_backend):
    """A real route to it: weights initialised far too large, so every gradient norm is NaN from the first step."""
    recipe, out = tiny_recipe(tmp_path), tmp_path / "out"
    assert cli.main(["train", str(recipe), "model.config.initializer_range=1.0e+30", "train.max_steps=2"]) == 1
    err = capsys.readouterr().err
    assert "TrainingDivergedError: training diverged: every one of the 2 optimizer steps of this run" in err, err
    assert "optimizer.lr=0.01, precision='no', loss 'cross_entropy'" in err
    assert dirs(out) == ["checkpoint-1", "checkpoint-2", "data_cache"]  # no final


def test_one_finite_step_is_a_trained_run(tmp_path):
    (tmp_path / "train.txt").write_text("1 2 nan nan")  # step 1 trains, then the weight is NaN
    summary = fakes.run(fakes.make_recipe(tmp_path, data={"shuffle": False}, train={"max_steps": 2}))
    assert summary["steps"] == 2 and summary["final_checkpoint"]


def test_every_rank_fails_alike_when_only_another_rank_was_non_finite(tmp_path, monkeypatch):
    monkeypatch.setattr(loop.distributed, "world_size", lambda: 2)

    def global_sum(*values):  # this rank is finite; the other rank's loss is NaN at every step
        return (values[0], values[1] + 1.0, values[2] * 2) if len(values) == 3 else values

    monkeypatch.setattr(loop.Trainer, "_global_sum", staticmethod(global_sum))
    with pytest.raises(loop.TrainingDivergedError, match="every one of the 3 optimizer steps"):
        fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 3}))
    assert not (tmp_path / "out" / "final").exists()


def test_a_resumed_run_with_nothing_left_to_do_is_not_judged(tmp_path):
    fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 2, "save_every": 2}))
    summary = fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 2}), resume="latest")
    assert summary["steps"] == 2 and summary["final_checkpoint"]
