"""The training loop's task seams for tasks that make their own batches (online RL), core only.

A task here turns every data batch into two micro-batches kept in a queue and draws only when the queue is
empty, counts what the loop calls (``after_step``, ``close``, ``evaluate``), reports a metric of its own
(``step_metrics``), keeps its queue in checkpoints (``state_dict``), defaults its loss's options
(``loss_options``) and writes a file of its own into training checkpoints (``save_training_state``).
The model is the core's reference backend (a tiny real network), so checkpoints, their integrity manifest
and exact resumption are the real ones; nothing of twinkle-rl is imported.

This module is also the Twinkle plugin that registers those fixtures (``TWINKLE_PLUGINS``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from twinkle_core import LossRecord, ModelRecord, TaskRecord, checkpoint, hookimpl
from twinkle_core.errors import ConfigError
from twinkle_core.loss.cross_entropy import CrossEntropyLoss
from twinkle_core.plugins import reset_plugins
from twinkle_core.task import Task
from twinkle_core.testing.conformance import CONFORMANCE_VOCAB_SIZE
from twinkle_core.testing.reference import ReferenceModel
from twinkle_core.train.logging import read_log

FAKES = "twinkle_test_task_seams_fakes"
sys.modules.setdefault(FAKES, sys.modules[__name__])  # a stable import name for the records below

ROW_LENGTH = 8
#: the file a task writes into every training checkpoint (a PPO critic would write its weights there)
TASK_FILE = "seam_task_state.json"


# ---------------------------------------------------------------------- plugin
@hookimpl
def twinkle_register_models():
    yield ModelRecord("SeamReferenceModel", f"{FAKES}:SeamReferenceModel", "reference backend (test fixture)")


@hookimpl
def twinkle_register_tasks():
    yield TaskRecord("seam_queue", f"{FAKES}:QueueTask", "two micro-batches per data batch (test fixture)")
    yield TaskRecord("seam_no_eval_loss", f"{FAKES}:NoEvalLossTask", "evaluates without a loss (test fixture)")


@hookimpl
def twinkle_register_losses():
    yield LossRecord("seam_ce", f"{FAKES}:OptionsRecordingLoss")


# ---------------------------------------------------------------------- fixtures of the plugin
class SeamReferenceModel(ReferenceModel):
    """The reference backend as the loop builds it: it ignores the options of a Hugging Face model and the
    model directory (its weights come from the seed), and has no tokenizer."""

    def __init__(self, *, model_id: str | None = None, trust_remote_code: bool = False,
                 attn_implementation: str | None = None, gradient_checkpointing: bool = False, **kwargs: Any) -> None:
        super().__init__(model_id=None, **kwargs)

    @classmethod
    def load_tokenizer(cls, path: str, *, trust_remote_code: bool = False) -> None:
        return None


class OptionsRecordingLoss(CrossEntropyLoss):
    """Cross-entropy that remembers the options it was built with."""

    name = "seam_ce"
    built: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, scale: float = 1.0, tag: str = "loss default", **options: Any) -> None:
        super().__init__(**options)
        OptionsRecordingLoss.built.append({"scale": scale, "tag": tag, **options})


def _row(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic token row and its labels (the first two tokens are a prompt, masked)."""
    ids = torch.randint(0, CONFORMANCE_VOCAB_SIZE, (ROW_LENGTH,), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:2] = -100
    return ids, labels


class QueueTask(Task):
    """Makes two micro-batches (the halves of the rows) of every data batch and draws only when its queue is
    empty; records every call the loop makes to it. ``fail_at_draw``: raise on that draw (1-based)."""

    name = "seam_queue"
    default_loss = "seam_ce"
    curve_keys = ("seam_metric",)
    instances: ClassVar[list[QueueTask]] = []

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.queue: list[dict[str, torch.Tensor]] = []
        self.draws = 0  # over the whole run, resumed runs included (part of the state)
        self.draws_this_process = 0
        self.micro_batches = 0
        self.after_steps: list[int] = []
        self.loaded_states: list[dict[str, Any]] = []
        self.saved_training_states: list[str] = []
        self.loaded_training_states: list[tuple[str, dict[str, Any]]] = []
        self.evaluated: list[tuple[Any, dict[str, Any]]] = []
        self.prepared_batches = 0
        self.closes = 0
        QueueTask.instances.append(self)

    # data
    def load_dataset(self, path: str, tokenizer: Any, **data_options: Any) -> list[int]:
        return [int(x) for x in Path(path).read_text().split()]

    def collate(self, features: list[int]) -> dict[str, torch.Tensor]:
        ids, labels = zip(*(_row(seed) for seed in features), strict=True)
        input_ids = torch.stack(ids)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": torch.stack(labels)}

    def prepare_batch(self, model: Any, batch: dict[str, Any]) -> dict[str, Any]:
        self.prepared_batches += 1
        return batch

    # the seams
    def micro_batches_per_data_batch(self, batch_size: int, *, gradient_accumulation_steps: int = 1) -> int:
        return 2

    def next_training_batch(self, model: Any, draw: Any) -> dict[str, Any]:
        if not self.queue:
            self.draws += 1
            self.draws_this_process += 1
            if self.draws == self.options.get("fail_at_draw"):
                raise RuntimeError(f"injected failure at draw {self.draws}")
            batch = draw()
            half = batch["input_ids"].shape[0] // 2
            self.queue = [{k: v[:half] for k, v in batch.items()}, {k: v[half:] for k, v in batch.items()}]
        self.micro_batches += 1
        return self.queue.pop(0)

    def after_step(self, model: Any, *, step: int) -> None:
        self.after_steps.append(step)

    def step_metrics(self) -> dict[str, float]:
        # something only the task knows: the last step it saw, and how full its queue is
        return {"seam_metric": 0.5 * self.after_steps[-1], "seam_queue_length": float(len(self.queue))}

    def state_dict(self) -> dict[str, Any]:
        return {"queue": [dict(b) for b in self.queue], "draws": self.draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded_states.append(state)
        self.queue = [dict(b) for b in state.get("queue", [])]
        self.draws = int(state.get("draws", 0))

    def save_training_state(self, model: Any, directory: str) -> None:
        self.saved_training_states.append(directory)
        Path(directory, TASK_FILE).write_text(json.dumps({"draws": self.draws}))

    def load_training_state(self, model: Any, directory: str) -> None:
        self.loaded_training_states.append((directory, json.loads(Path(directory, TASK_FILE).read_text())))

    def loss_options(self, loss_name: str) -> dict[str, Any]:
        return {"scale": 2.0, "tag": "from the task"} if loss_name == "seam_ce" else {}

    def evaluate(self, model: Any, dataset: Any, tokenizer: Any, **options: Any) -> dict[str, float]:
        self.evaluated.append((dataset, options))
        return {"seam_score": 0.25}

    def close(self) -> None:
        self.closes += 1


class NoEvalLossTask(QueueTask):
    """Its evaluation rows are not training batches: no eval loss, only :meth:`evaluate`."""

    name = "seam_no_eval_loss"
    has_eval_loss = False


# ---------------------------------------------------------------------- helpers
@pytest.fixture(autouse=True)
def registry(monkeypatch):
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("TWINKLE_PLUGINS", FAKES)
    monkeypatch.setenv("TWINKLE_NO_PROGRESS", "1")
    QueueTask.instances.clear()
    OptionsRecordingLoss.built.clear()
    reset_plugins()
    yield
    reset_plugins()


def make_recipe(tmp_path: Path, *, out: str = "out", rows: int = 6, task: str = "seam_queue",
                train: dict[str, Any] | None = None, **sections: Any) -> dict[str, Any]:
    data = tmp_path / "train.txt"
    if not data.exists():
        data.write_text("\n".join(str(i) for i in range(rows)))
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    return {
        "task": task,
        "model": {"class_name": "SeamReferenceModel", "model_id": str(model_dir)},
        "data": {"train": str(data), "batch_size": 2, **sections.pop("data", {})},
        "optimizer": {"lr": 1e-2},
        "lr_scheduler": {"name": "constant"},
        "train": {"output_dir": str(tmp_path / out), "max_grad_norm": 1.0, **(train or {})},
        **sections,
    }


def run(recipe: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    from twinkle_core.train.loop import train

    return train(recipe, **kwargs)


def task() -> QueueTask:
    return QueueTask.instances[-1]


def records(output_dir: Path, event: str = "train") -> list[dict[str, Any]]:
    return [r for r in read_log(output_dir) if r["event"] == event]


def losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(output_dir)}


# ---------------------------------------------------------------------- batches and steps
def test_a_task_makes_its_own_micro_batches_and_draws_when_its_queue_is_empty(tmp_path):
    # 6 rows in data batches of 2: 3 data batches per epoch, 2 micro-batches each, 2 accumulated per step
    summary = run(make_recipe(tmp_path, train={"num_epochs": 2, "gradient_accumulation_steps": 2}))
    assert summary["num_training_steps"] == summary["steps"] == 6  # 2 epochs * 3 * 2 // 2, without max_steps
    seams = task()
    assert seams.micro_batches == 12 and seams.draws == 6, "one draw per two micro-batches"
    assert seams.after_steps == [1, 2, 3, 4, 5, 6], "after_step: once per optimizer step, with the new count"
    assert summary["epoch"] == 1
    assert seams.prepared_batches == 0, "next_training_batch replaces prepare_batch for training"


def test_step_metrics_are_in_the_train_log_lines(tmp_path):
    run(make_recipe(tmp_path, train={"max_steps": 4, "log_every": 2}))
    lines = records(tmp_path / "out")
    assert [(r["step"], r["seam_metric"]) for r in lines] == [(2, 1.0), (4, 2.0)]
    assert all(r["seam_queue_length"] == 0.0 for r in lines)  # an even step empties the queue
    assert all(r["loss"] > 0 for r in lines)


# ---------------------------------------------------------------------- loss options
def test_loss_options_default_the_loss_and_the_recipe_overrides_them(tmp_path):
    run(make_recipe(tmp_path, train={"max_steps": 1}))
    assert OptionsRecordingLoss.built[-1] == {"scale": 2.0, "tag": "from the task"}
    run(make_recipe(tmp_path, out="override", loss={"options": {"tag": "from the recipe", "label_smoothing": 0.1}},
                    train={"max_steps": 1}))
    assert OptionsRecordingLoss.built[-1] == {"scale": 2.0, "tag": "from the recipe", "label_smoothing": 0.1}
    run(make_recipe(tmp_path, out="other-loss", loss={"name": "cross_entropy"}, train={"max_steps": 1}))
    assert len(OptionsRecordingLoss.built) == 2, "options for another loss are not passed to it"


# ---------------------------------------------------------------------- checkpoints and resumption
def test_task_state_is_checkpointed_and_an_exact_resume_continues_a_half_used_queue(tmp_path):
    common = {"num_epochs": 1, "save_every": 3}  # 6 steps; at step 3 one micro-batch of the 2nd draw is queued
    run(make_recipe(tmp_path, out="straight", train=common))
    expected = losses(tmp_path / "straight")
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    saved = tmp_path / "straight" / "checkpoint-3"
    trainer_state = checkpoint.load_state_file(str(saved / checkpoint.STATE_DIR / "trainer_state.pt"))
    (task_state,) = trainer_state["extra_state"]["task"]["per_rank"]  # one process: one rank's state
    assert task_state["draws"] == 2 and len(task_state["queue"]) == 1, "the queue at the step is in the checkpoint"

    summary = run(make_recipe(tmp_path, out="resumed", train=common), resume=str(saved))
    resumed = task()
    assert summary["resumed_from"] == str(saved)
    (state,) = resumed.loaded_states
    assert state["draws"] == 2 and len(state["queue"]) == 1
    torch.testing.assert_close(state["queue"][0], task_state["queue"][0], rtol=0, atol=0)
    assert resumed.draws_this_process == 1, "the queued micro-batch is trained first, then one draw is enough"
    assert resumed.after_steps == [4, 5, 6]
    assert losses(tmp_path / "resumed") == {s: v for s, v in expected.items() if s > 3}


def test_training_state_files_are_part_of_the_checkpoint_and_come_back_on_resume(tmp_path):
    run(make_recipe(tmp_path, train={"max_steps": 2, "save_every": 2}))
    saved = tmp_path / "out" / "checkpoint-2"
    # written inside the staging directory, which is then renamed to its final name
    (staging,) = task().saved_training_states
    assert Path(staging).name != saved.name and not Path(staging).exists()
    assert json.loads((saved / TASK_FILE).read_text()) == {"draws": 1}
    manifest = json.loads((saved / checkpoint.MARKER).read_text())["files"]
    assert TASK_FILE in manifest, "the task's file is covered by the checkpoint's integrity manifest"
    checkpoint.verify_checkpoint(saved)
    assert not (tmp_path / "out" / "final" / TASK_FILE).exists(), "only checkpoints with optimizer state"

    run(make_recipe(tmp_path, train={"max_steps": 3}), resume="latest")
    assert task().loaded_training_states == [(str(saved), {"draws": 1})]

    (saved / TASK_FILE).write_text(json.dumps({"draws": 7}))  # same size, other content
    with pytest.raises(checkpoint.CheckpointError, match=TASK_FILE.replace(".", r"\.")):
        checkpoint.verify_checkpoint(saved)


# ---------------------------------------------------------------------- evaluation
def test_a_task_without_eval_loss_is_evaluated_by_its_evaluate(tmp_path):
    (tmp_path / "eval.txt").write_text("100 101 102")
    summary = run(make_recipe(tmp_path, task="seam_no_eval_loss", data={"eval": str(tmp_path / "eval.txt")},
                              train={"max_steps": 2, "eval_every": 1, "eval_before_training": True}))
    evals = records(tmp_path / "out", "eval")
    assert [e["step"] for e in evals] == [0, 1, 2]
    assert all("eval_loss" not in e and e["eval_seam_score"] == 0.25 for e in evals)
    seams = task()
    assert [(dataset, options) for dataset, options in seams.evaluated] == [([100, 101, 102], {})] * 3
    assert seams.prepared_batches == 0, "no evaluation batch was prepared for a loss"
    assert summary["eval_after"] == {"eval_seam_score": 0.25}


def test_a_task_with_eval_loss_keeps_it(tmp_path):
    (tmp_path / "eval.txt").write_text("100 101")
    summary = run(make_recipe(tmp_path, data={"eval": str(tmp_path / "eval.txt")}, train={"max_steps": 1}))
    assert summary["eval_after"]["eval_loss"] > 0
    assert task().evaluated == [], "without evaluate_options only the loss is evaluated"


# ---------------------------------------------------------------------- close
def test_close_is_called_at_the_end(tmp_path):
    run(make_recipe(tmp_path, train={"max_steps": 2}))
    assert task().closes == 1


def test_close_is_called_when_training_raises(tmp_path):
    with pytest.raises(RuntimeError, match="injected failure at draw 2"):
        run(make_recipe(tmp_path, task_options={"fail_at_draw": 2}, train={"max_steps": 4}))
    assert task().closes == 1
    assert (tmp_path / "out" / "checkpoint-2-interrupted").is_dir()  # the queue's last micro-batch was trained


# ---------------------------------------------------------------------- curves
def test_curves_are_drawn_from_the_log(tmp_path):
    pytest.importorskip("matplotlib")
    from twinkle_core.train.curves import CURVES_FILE, read_series, write_curves

    run(make_recipe(tmp_path, train={"max_steps": 3}))
    out = tmp_path / "out"
    assert (out / CURVES_FILE).stat().st_size > 0
    log = out / "logs.jsonl"
    with log.open("a") as fh:
        fh.write('{"event": "train", "step": 4, "loss": 0.1')  # a line cut by a crash
    series = read_series(log, ["loss", "seam_metric"])
    assert [step for step, _ in series["seam_metric"]] == [1, 2, 3]
    (out / CURVES_FILE).unlink()
    assert write_curves(out, ["loss", "seam_metric"]) == out / CURVES_FILE
    assert (out / CURVES_FILE).stat().st_size > 0
    assert write_curves(out, ["not_logged"]) is None, "nothing to draw: no picture"
    assert not os.path.exists(tmp_path / "nowhere" / CURVES_FILE) and write_curves(tmp_path / "nowhere", ["loss"]) is None


def test_close_is_called_when_building_or_resuming_fails(tmp_path):
    run(make_recipe(tmp_path, train={"max_steps": 1, "save_every": 1}))
    # the task is built (and prepare_model has run) before the resume is refused
    with pytest.raises(ConfigError, match="optimizer.lr"):
        run(make_recipe(tmp_path, optimizer={"lr": 0.5}, train={"max_steps": 2}), resume="latest")
    assert task().closes == 1
