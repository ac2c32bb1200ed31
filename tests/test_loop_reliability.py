"""The training loop's guards: signals stop at a step boundary, divergence and all-masked data stop early.

Uses the fake model, task and recipe helpers of tests/test_loop.py (loaded under its plugin name).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from twinkle_core.errors import ConfigError
from twinkle_core.train import guards, loop

FAKES = "twinkle_test_loop_fakes"
if FAKES not in sys.modules:  # test_loop.py registers itself under this name when pytest imports it first
    # under the name pytest's importlib mode gives it, so that collecting test_loop.py later reuses this
    # module (and its FakeModel class) instead of making a second one the plugin would not load
    _spec = importlib.util.spec_from_file_location("tests.test_loop", Path(__file__).with_name("test_loop.py"))
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["tests.test_loop"] = _module
    _spec.loader.exec_module(_module)
fakes = sys.modules[FAKES]
FakeModel = fakes.FakeModel


registry = fakes.registry  # test_loop.py's autouse fixture: the fake plugin registered, progress off


def dirs(output_dir: Path) -> list[str]:
    return sorted(p.name for p in output_dir.iterdir() if p.is_dir() and p.name != "tensorboard")


def signal_in_step(monkeypatch, at_step: int, signum: int, times: int = 1) -> None:
    """Deliver ``signum`` from inside the optimizer step: after the weights moved, before the counters did."""
    original = FakeModel.step

    def step(self, **kwargs):
        original(self, **kwargs)
        if self.steps == at_step:
            for _ in range(times):
                os.kill(os.getpid(), signum)

    monkeypatch.setattr(FakeModel, "step", step)


COMMON = {"data": {"shuffle": True, "seed": 3}, "train": {"max_steps": 6}}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_in_the_optimizer_step_saves_a_consistent_checkpoint(tmp_path, monkeypatch, signum):
    (tmp_path / "train.txt").write_text("\n".join(str(i * 0.7) for i in range(8)))
    fakes.run(fakes.make_recipe(tmp_path, out="ref", **COMMON))
    expected_w, expected_losses = fakes.model().w, fakes._losses(tmp_path / "ref")

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with monkeypatch.context() as patch:
        signal_in_step(patch, 3, signum)
        with pytest.raises(KeyboardInterrupt, match="stopping at step 3"):
            fakes.run(fakes.make_recipe(tmp_path, out="run", **COMMON))
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert dirs(tmp_path / "run") == ["checkpoint-3-interrupted"]
    state = json.loads((tmp_path / "run" / "checkpoint-3-interrupted" / "state.json").read_text())
    assert state["steps"] == state["extra_state"]["step"] == 3  # the weights are those of the counters' step

    summary = fakes.run(fakes.make_recipe(tmp_path, out="run", **COMMON), resume="latest")
    assert summary["steps"] == 6 and fakes.count("forward_backward") == 3
    assert fakes.model().w == expected_w  # bit-identical: no step applied twice
    assert fakes._losses(tmp_path / "run") == expected_losses


def test_a_second_signal_stops_at_once_without_saving(tmp_path, monkeypatch):
    signal_in_step(monkeypatch, 3, signal.SIGTERM, times=2)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="twice"):
        fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 6}))
    assert dirs(tmp_path / "out") == []  # the step was half done: nothing torn is saved
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_on_another_rank_stops_every_rank_at_the_same_step(tmp_path, monkeypatch):
    monkeypatch.setattr(loop.distributed, "world_size", lambda: 2)
    calls = []

    def global_sum(*values):  # the other rank got a signal before step 2 ended
        calls.append(values)
        return (values[0] + (1.0 if len(calls) >= 2 else 0.0), *values[1:])

    monkeypatch.setattr(loop.Trainer, "_global_sum", staticmethod(global_sum))
    with pytest.raises(KeyboardInterrupt, match="stopping at step 2: received a signal on another rank"):
        fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 6}))
    assert len(calls) == 2  # one reduction per step
    assert dirs(tmp_path / "out") == ["checkpoint-2-interrupted"]


def test_a_run_of_non_finite_steps_stops_as_diverged(tmp_path, monkeypatch):
    monkeypatch.setattr(guards, "MAX_NONFINITE_STEPS", 3)
    (tmp_path / "train.txt").write_text("1 2 nan 4 5 6")  # a NaN label: NaN loss, then NaN weights
    recipe = fakes.make_recipe(tmp_path, train={"max_steps": 10, "save_every": 1})
    with pytest.raises(loop.TrainingDivergedError, match="3 consecutive non-finite steps .* at step 3; lower optimizer.lr"):
        fakes.run(recipe)
    assert dirs(tmp_path / "out") == ["checkpoint-1", "checkpoint-2"]  # neither final nor a diverged checkpoint


def test_isolated_non_finite_steps_are_tolerated(tmp_path, monkeypatch):
    monkeypatch.setattr(guards, "MAX_NONFINITE_STEPS", 3)
    original = FakeModel.clip_grad_and_step

    def clip_grad_and_step(self, *args, **kwargs):  # a skipped overflow step, as fp16 loss scaling gives
        norm = original(self, *args, **kwargs)
        return float("inf") if self.steps in (2, 3, 5, 6) else norm

    monkeypatch.setattr(FakeModel, "clip_grad_and_step", clip_grad_and_step)
    summary = fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 8}))
    assert summary["steps"] == 8 and summary["final_checkpoint"]


def test_all_masked_labels_are_a_clear_error(tmp_path):
    (tmp_path / "train.txt").write_text("\n".join(["-100"] * 20))
    with pytest.raises(ConfigError, match=r"train\.txt\): all labels are masked \(-100\) in the first 5 steps"):
        fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 8}))
    assert dirs(tmp_path / "out") == []


def test_short_all_masked_run_is_caught_at_its_end(tmp_path):
    (tmp_path / "train.txt").write_text("-100 -100 -100 -100")
    with pytest.raises(ConfigError, match="first 2 steps"):
        fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 2}))
    assert dirs(tmp_path / "out") == []


def test_some_masked_labels_train_normally(tmp_path):
    (tmp_path / "train.txt").write_text("-100 -100 -100 -100 3 4")
    assert fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 6}))["steps"] == 6


@pytest.mark.parametrize("option, value", [("lr", 0.05), ("weight_decay", 0.01)])
def test_a_changed_optimizer_option_on_resume_is_refused(tmp_path, option, value):
    fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 4, "save_every": 2}))
    with pytest.raises(ConfigError, match=f"optimizer.{option}=.* there but {value} in the recipe"):
        fakes.run(fakes.make_recipe(tmp_path, optimizer={option: value}, train={"max_steps": 4}),
                  resume=str(tmp_path / "out" / "checkpoint-2"))
    # unchanged options resume as before
    summary = fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 4}),
                        resume=str(tmp_path / "out" / "checkpoint-2"))
    assert summary["steps"] == 4
