"""One run per output directory: ``twinkle_core.train.run_lock`` and the loop taking it.

Uses the fake model, task and recipe helpers of tests/test_loop.py. This module is also a Twinkle plugin
(``TWINKLE_PLUGINS=test_run_lock`` with tests/ on PYTHONPATH): it registers the fake task and
``LockGateModel``, a fake model whose first step waits until a gate file appears, so that a test holds a real
``twinkle train`` process inside its run while it starts a second one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from twinkle_core import ModelRecord, hookimpl
from twinkle_core.errors import ConfigError
from twinkle_core.train.run_lock import LOCK_FILE, RunLock, read_holder

FAKES = "twinkle_test_loop_fakes"
if FAKES not in sys.modules:  # the same loading as tests/test_loop_reliability.py
    _spec = importlib.util.spec_from_file_location("tests.test_loop", Path(__file__).with_name("test_loop.py"))
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["tests.test_loop"] = _module
    _spec.loader.exec_module(_module)
fakes = sys.modules[FAKES]
FakeModel = fakes.FakeModel
registry = fakes.registry  # test_loop.py's autouse fixture
TESTS = Path(__file__).resolve().parent


# ---------------------------------------------------------------------- plugin (for the subprocess runs)
class GateModel(FakeModel):
    """FakeModel whose first micro-batch writes ``<gate>.reached`` and waits (up to 120 s) for ``<gate>``."""

    def forward_backward(self, **kwargs: Any) -> dict:
        gate = self.kwargs.get("gate")
        if gate and self.micro == 0:
            Path(f"{gate}.reached").write_text(str(os.getpid()))
            deadline = time.time() + 120
            while not Path(gate).exists() and time.time() < deadline:
                time.sleep(0.05)
        return super().forward_backward(**kwargs)


@hookimpl
def twinkle_register_models():
    yield ModelRecord("LockGateModel", f"{__name__}:GateModel", "fake model that waits for a gate file (test)")


@hookimpl
def twinkle_register_tasks():
    yield from fakes.twinkle_register_tasks()


# ---------------------------------------------------------------------- helpers
def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def plant_lock(output_dir: Path, **holder: Any) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_FILE
    path.write_text(json.dumps({"started": time.time(), "run_id": "old", **holder}))
    return path


def run(recipe: dict, **kwargs: Any) -> dict:
    from twinkle_core.train.loop import train

    return train(recipe, **kwargs)


# ---------------------------------------------------------------------- the lock itself
def test_a_held_lock_refuses_a_second_one_naming_the_holder(tmp_path):
    with RunLock(tmp_path / "out") as first:
        holder = read_holder(tmp_path / "out" / LOCK_FILE)
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        assert holder["run_id"] == first.run_id and isinstance(holder["started"], float)
        started = time.perf_counter()
        with pytest.raises(ConfigError) as caught:
            RunLock(tmp_path / "out").acquire()
        assert time.perf_counter() - started < 1.0
        message = str(caught.value)
        assert f"pid {os.getpid()}" in message and socket.gethostname() in message
        assert "wait for that run to finish" in message and "another train.output_dir" in message
    assert not (tmp_path / "out" / LOCK_FILE).exists()  # released: the file goes
    RunLock(tmp_path / "out").acquire().release()  # and the lock can be taken again


def test_a_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    pid = dead_pid()
    plant_lock(tmp_path, pid=pid, host=socket.gethostname())
    with caplog.at_level("WARNING", logger="twinkle.train"), RunLock(tmp_path) as lock:
        assert read_holder(tmp_path / LOCK_FILE)["pid"] == os.getpid()
        assert lock.held
    assert f"pid {pid}" in caplog.text and "no longer running" in caplog.text


def test_a_lock_file_left_by_another_host_is_refused_with_the_fix(tmp_path):
    path = plant_lock(tmp_path, pid=4242, host="some-other-node")
    with pytest.raises(ConfigError, match="some-other-node") as caught:
        RunLock(tmp_path).acquire()
    assert f"delete {path}" in str(caught.value)
    assert read_holder(path)["host"] == "some-other-node"  # left as it was


def test_a_checkpoint_written_under_the_lock_does_not_list_it(tmp_path):
    from twinkle_core import checkpoint

    with RunLock(tmp_path):
        with checkpoint.atomic_directory(str(tmp_path / "checkpoint-1"), is_main=True, metadata={"step": 1}) as tmp:
            Path(tmp, "weights.bin").write_bytes(b"w")
        files = json.loads((tmp_path / "checkpoint-1" / checkpoint.MARKER).read_text())["files"]
        assert sorted(files) == ["weights.bin"]
        assert [c[2].name for c in checkpoint.list_checkpoints(tmp_path)] == ["checkpoint-1"]
        assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"


# ---------------------------------------------------------------------- the training loop
def test_train_refuses_a_locked_output_directory_before_building_anything(tmp_path):
    recipe = fakes.make_recipe(tmp_path, train={"max_steps": 2})
    with RunLock(tmp_path / "out"):
        started = time.perf_counter()
        with pytest.raises(ConfigError, match=f"in use by another training run, pid {os.getpid()}"):
            run(recipe)
        assert time.perf_counter() - started < 1.0
    assert FakeModel.instances == []  # refused before the model (or anything else) was built
    assert not (tmp_path / "out" / "logs.jsonl").exists() and not (tmp_path / "out" / "recipe.yaml").exists()


def test_the_lock_is_held_during_the_run_and_released_after_it_and_after_an_error(tmp_path, monkeypatch):
    seen, locks = [], []
    original = FakeModel.clip_grad_and_step

    def step(self, *args, **kwargs):
        seen.append(read_holder(tmp_path / "out" / LOCK_FILE).get("pid"))
        locks.append(sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob(LOCK_FILE)))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FakeModel, "clip_grad_and_step", step)
    run(fakes.make_recipe(tmp_path, train={"max_steps": 2, "save_every": 1}))
    assert seen == [os.getpid(), os.getpid()]
    assert locks == [[LOCK_FILE], [LOCK_FILE]]  # beside the checkpoints (checkpoint-1 was there at step 2)
    assert not (tmp_path / "out" / LOCK_FILE).exists()

    with pytest.raises(fakes.Stop):
        run(fakes.make_recipe(tmp_path, out="failing", model={"options": {"fail_at": {"step": 2}}},
                              train={"max_steps": 4}))
    assert not (tmp_path / "failing" / LOCK_FILE).exists()
    with pytest.raises(KeyboardInterrupt):  # SIGTERM: stops at the step boundary, then gives the lock back
        # overwrite: the failed run left checkpoint-1-interrupted, which a new run may not silently mix with
        run(fakes.make_recipe(tmp_path, out="failing", model={"options": {"fail_at": {"step": 2, "kind": "sigterm"}}},
                              train={"max_steps": 4}), overwrite=True)
    assert not (tmp_path / "failing" / LOCK_FILE).exists()
    run(fakes.make_recipe(tmp_path, out="failing", train={"max_steps": 1}), overwrite=True)  # free again


def test_a_stale_lock_does_not_stop_resume_latest(tmp_path, caplog):
    recipe = fakes.make_recipe(tmp_path, train={"max_steps": 4, "save_every": 2})
    run(recipe)
    plant_lock(tmp_path / "out", pid=dead_pid(), host=socket.gethostname())  # as if a resumed run was killed
    with caplog.at_level("WARNING", logger="twinkle.train"):
        summary = run(fakes.merge(recipe, {"train": {"max_steps": 6}}), resume="latest")
    assert summary["resumed_from"].endswith("checkpoint-4") and summary["steps"] == 6
    assert "no longer running" in caplog.text
    assert not (tmp_path / "out" / LOCK_FILE).exists()


# ---------------------------------------------------------------------- two real `twinkle train` processes
def _cli(recipe: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "twinkle_core.cli", "train", str(recipe), *args]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TWINKLE_") and k not in ("PYTHONPATH", "WORLD_SIZE", "RANK")}
    env.update({"PYTHONPATH": str(TESTS), "TWINKLE_DISABLE_PLUGIN_AUTOLOAD": "1", "TWINKLE_PLUGINS": "test_run_lock",
                "TWINKLE_NO_PROGRESS": "1"})
    return env


def test_two_concurrent_runs_on_one_directory_the_second_is_refused_the_first_untouched(tmp_path):
    (tmp_path / "train.txt").write_text("\n".join(str(i) for i in range(1, 9)))
    (tmp_path / "model").mkdir()
    gate = tmp_path / "gate"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(textwrap.dedent(f"""
        task: loop_fake_task
        model: {{class_name: LockGateModel, model_id: model, options: {{gate: {gate}}}}}
        data: {{train: train.txt, batch_size: 2}}
        optimizer: {{lr: 0.1}}
        train: {{output_dir: out, max_steps: 3, save_every: 2, log_every: 1}}
    """))
    out = tmp_path / "out"
    first = subprocess.Popen(_cli(recipe), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.time() + 240
        while not Path(f"{gate}.reached").exists():  # the first run is inside its first step, holding the lock
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.time() < deadline, "the first run never reached its first step"
            time.sleep(0.1)
        recipe_text = (out / "recipe.yaml").read_text()

        second_gate = tmp_path / "gate2"  # the second run would never wait: it must not get that far
        # what starting the command and validating the recipe costs here (imports torch), without training
        started = time.perf_counter()
        dry = subprocess.run(_cli(recipe, "--dry-run"), capture_output=True, text=True, env=_env(), timeout=120)
        startup = time.perf_counter() - started
        assert dry.returncode == 0, dry.stderr[-3000:]
        started = time.perf_counter()
        second = subprocess.run(_cli(recipe, f"model.options.gate={second_gate}", "train.max_steps=5"),
                                capture_output=True, text=True, env=_env(), timeout=120)
        took = time.perf_counter() - started
        print(f"second run refused in {took:.2f} s; the command's start and validation alone: {startup:.2f} s")
        # refused before building anything (the in-process test above times that part: under a second); the
        # margin is for this shared machine's noise around the ~2 s of imports both commands pay
        assert took < startup + 5.0
        assert second.returncode == 2, (second.stdout + second.stderr)[-3000:]
        assert f"in use by another training run, pid {first.pid} on host {socket.gethostname()!r}" in second.stderr
        assert "Traceback" not in second.stderr
        assert not Path(f"{second_gate}.reached").exists()
        assert (out / "recipe.yaml").read_text() == recipe_text  # nothing of the first run was replaced

        gate.write_text("go")
        stdout, stderr = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, stderr[-3000:]
    assert "twinkle: done at step 3/3" in stdout
    logs = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs if r["event"] == "train"] == [1, 2, 3]
    assert sorted(p.name for p in out.iterdir() if p.is_dir() and p.name != "tensorboard") == ["checkpoint-2", "final"]
    assert json.loads((out / "final" / "state.json").read_text())["steps"] == 3
    assert not (out / LOCK_FILE).exists()


# ---------------------------------------------------------------------- one lineage for --resume latest
def _save(root: Path, name: str, run_id: str | None) -> Path:
    from twinkle_core import checkpoint

    with checkpoint.run_lineage(run_id), checkpoint.atomic_directory(str(root / name), is_main=True) as tmp:
        Path(tmp, "weights.bin").write_bytes(name.encode())
    return root / name


def test_latest_keeps_to_the_run_that_saved_last(tmp_path, caplog):
    from twinkle_core import checkpoint

    _save(tmp_path, "checkpoint-4", "run-a")
    _save(tmp_path, "checkpoint-12", "run-a")  # an older run that went further
    newer = _save(tmp_path, "checkpoint-2", "run-b")  # a later run in the same directory, crashed after step 2
    assert checkpoint.read_marker(newer)["run_id"] == "run-b"
    with caplog.at_level("WARNING"):
        assert checkpoint.latest_checkpoint(tmp_path) == newer
    assert "belongs to run run-a" in caplog.text and f"--resume {tmp_path / 'checkpoint-12'}" in caplog.text
    # a broken checkpoint of that run falls back to its own previous one, never to the other run's
    _save(tmp_path, "checkpoint-3", "run-b")
    (tmp_path / "checkpoint-3" / "weights.bin").write_bytes(b"bit rot")
    assert checkpoint.latest_checkpoint(tmp_path) == newer


def test_markers_without_a_run_id_resume_as_before(tmp_path):
    from twinkle_core import checkpoint

    _save(tmp_path, "checkpoint-2", None)
    _save(tmp_path, "checkpoint-4", None)
    assert "run_id" not in checkpoint.read_marker(tmp_path / "checkpoint-4")
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-4"


def test_resume_latest_continues_the_last_run_not_an_older_runs_later_checkpoint(tmp_path, monkeypatch):
    """Issue 27 point 3: run A reached checkpoint-4; run B in the same directory saved checkpoint-2 (its own) and
    stopped; ``--resume latest`` continues B from its checkpoint-2, not from A's later checkpoint-4."""
    pytest.importorskip("twinkle_backend_hf")
    from twinkle_backend_hf.testing import tiny_qwen2_config

    from twinkle_core import checkpoint
    from twinkle_core.plugins import reset_plugins

    monkeypatch.delenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("TWINKLE_PLUGINS", raising=False)
    reset_plugins()
    quickstart = TESTS.parent / "examples" / "quickstart"
    recipe = {
        "task": "causal_lm",
        "model": {"class_name": "TransformersModel", "tokenizer": str(quickstart / "tokenizer"),
                  "config": tiny_qwen2_config(262, bos_token_id=0, eos_token_id=0, pad_token_id=0)},
        "precision": "no",
        "data": {"train": str(quickstart / "train.jsonl"), "mode": "chat", "max_length": 32, "batch_size": 2},
        "optimizer": {"name": "AdamW", "lr": 1e-2},
        "train": {"output_dir": str(tmp_path / "out"), "max_steps": 4, "save_every": 2, "seed": 3,
                  "eval_before_training": False},
    }
    run(recipe)
    run_a = checkpoint.read_marker(tmp_path / "out" / "checkpoint-4")["run_id"]
    # run B: a fresh start that stopped at step 2. A new run is now refused there (or replaces A with --overwrite);
    # such a mixed directory comes from an older Twinkle, or by hand, so the refusal is skipped to make one
    from twinkle_core.train import loop

    with monkeypatch.context() as patch:
        patch.setattr(loop, "check_start", lambda *args, **kwargs: None)
        run(fakes.merge(recipe, {"train": {"max_steps": 2}}))
    run_b = checkpoint.read_marker(tmp_path / "out" / "checkpoint-2")["run_id"]
    assert run_b != run_a and checkpoint.read_marker(tmp_path / "out" / "final")["run_id"] == run_b

    summary = run(recipe, resume="latest")
    assert summary["resumed_from"] == str(tmp_path / "out" / "checkpoint-2") and summary["steps"] == 4
    # the continued run keeps B's id: its new checkpoint-4 (and final) are B's
    assert checkpoint.read_marker(tmp_path / "out" / "checkpoint-4")["run_id"] == run_b
    assert checkpoint.read_marker(tmp_path / "out" / "final")["run_id"] == run_b
