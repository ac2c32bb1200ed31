"""The training loop against an in-memory fake model and task (no real network, no backend).

The fake model fits one scalar ``w`` to the numbers of the data file with squared error, so every
loss is a deterministic function of the data order and the number of steps taken: resuming must
reproduce an uninterrupted run's losses exactly.

This module is also a Twinkle plugin (``TWINKLE_PLUGINS=test_loop``, used by tests/test_cli.py).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from twinkle_core import ModelRecord, TaskRecord, hookimpl
from twinkle_core.errors import ConfigError, PluginNotFoundError
from twinkle_core.plugins import reset_plugins
from twinkle_core.task import Task

FAKES = "twinkle_test_loop_fakes"
sys.modules.setdefault(FAKES, sys.modules[__name__])  # a stable import name for the records below


# ---------------------------------------------------------------------- plugin
@hookimpl
def twinkle_register_models():
    yield ModelRecord("LoopFakeModel", f"{FAKES}:FakeModel", "scalar least squares (test fixture)")


@hookimpl
def twinkle_register_tasks():
    yield TaskRecord("loop_fake_task", f"{FAKES}:FakeTask", "numbers, one per token (test fixture)")


# ---------------------------------------------------------------------- fakes
class FakeTokenizer:
    def __init__(self, path: str, trust_remote_code: bool) -> None:
        self.path, self.trust_remote_code = path, trust_remote_code


class FakeTask(Task):
    name = "loop_fake_task"
    default_loss = "mse"

    def load_dataset(self, path: str, tokenizer: Any, **data_options: Any) -> list[float]:
        self.data_options = data_options
        self.tokenizer = tokenizer
        return [float(x) for x in Path(path).read_text().split()]

    def collate(self, features: list[float]) -> dict[str, Any]:
        import torch

        return {"x": torch.tensor(features, dtype=torch.float64), "attention_mask": torch.ones(len(features))}

    def prepare_model(self, model: Any) -> None:
        model.calls.append(("prepare_model", type(self).__name__))

    def evaluate(self, model: Any, dataset: Any, tokenizer: Any, **options: Any) -> dict[str, float]:
        self.evaluated = (dataset, options)
        return {"fake_metric": 0.5, "eval_already_prefixed": 1.0}


class Stop(Exception):
    pass


class FakeModel:
    """Implements the parts of the TwinkleModel API the loop uses, and records every call."""

    instances: list[FakeModel] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.fail_at = kwargs.get("fail_at")
        self.w = 0.0
        self.steps = 0
        self.micro = 0
        self.lr = None
        self.grad = self.tokens = 0.0
        self.metric_loss = self.metric_tokens = 0.0
        self.calls: list[tuple] = []
        FakeModel.instances.append(self)

    # configuration
    def add_adapter_to_model(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        self.calls.append(("add_adapter_to_model", adapter_name, config))

    def set_loss(self, loss: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        self.calls.append(("set_loss", loss, adapter_name, kwargs))

    def set_optimizer(self, optimizer: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        self.lr = kwargs["lr"]
        self.calls.append(("set_optimizer", optimizer, adapter_name, kwargs))

    def set_lr_scheduler(self, scheduler: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        self.calls.append(("set_lr_scheduler", scheduler, adapter_name, kwargs))

    # compute
    def _maybe_fail(self) -> None:
        spec = self.fail_at
        if spec and self.steps + 1 == spec["step"] and self.micro == spec.get("micro", 0):
            kind = spec.get("kind", "error")
            if kind == "interrupt":
                raise KeyboardInterrupt
            if kind == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            raise Stop(f"injected failure at step {spec['step']}")

    def forward_backward(self, *, inputs: dict[str, Any], adapter_name: str | None = None, **kw: Any) -> dict:
        self.calls.append(("forward_backward", adapter_name))
        self._maybe_fail()
        xs = inputs["x"].tolist()
        loss_sum = sum((self.w - x) ** 2 for x in xs)
        self.grad += sum(2 * (self.w - x) for x in xs)
        self.tokens += len(xs)
        self.metric_loss += loss_sum
        self.metric_tokens += len(xs)
        self.micro += 1
        return {"loss": loss_sum / len(xs), "num_tokens": len(xs)}

    def clip_grad_and_step(self, max_grad_norm: float | None = 1.0, norm_type: float = 2.0, *,
                           adapter_name: str | None = None) -> float:
        self.calls.append(("clip_grad_and_step", adapter_name, max_grad_norm))
        g = self.grad / self.tokens
        norm = abs(g)
        if max_grad_norm is not None and norm > max_grad_norm:
            g *= max_grad_norm / norm
        self.w -= self.lr * g
        self.steps += 1
        self.micro = 0
        self.grad = self.tokens = 0.0
        return norm

    def calculate_metric(self, *, adapter_name: str | None = None, reset: bool = True) -> dict[str, float]:
        self.calls.append(("calculate_metric", adapter_name))
        loss = self.metric_loss / self.metric_tokens if self.metric_tokens else float("nan")
        if reset:
            self.metric_loss = self.metric_tokens = 0.0
        return {"loss": loss, "lr": self.lr}

    def forward_only(self, *, inputs: dict[str, Any], adapter_name: str | None = None, **kw: Any) -> dict:
        self.calls.append(("forward_only", adapter_name))
        return {"prediction": self.w}

    def calculate_loss(self, *, inputs: dict | None = None, outputs: dict | None = None,
                       adapter_name: str | None = None, **kw: Any) -> Any:
        from twinkle_core.loss.base import LossOutput

        xs = inputs["x"].tolist()
        self.metric_loss += 1e6  # evaluation must not leak into the training metrics
        self.metric_tokens += 1
        return LossOutput(loss=sum((outputs["prediction"] - x) ** 2 for x in xs), num_tokens=len(xs))

    # state
    def save(self, name: str, *, output_dir: str, adapter_name: str | None = None, save_optimizer: bool = True,
             extra_state: dict | None = None) -> str:
        self.calls.append(("save", name, adapter_name))
        path = Path(output_dir) / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "state.json").write_text(json.dumps({"w": self.w, "steps": self.steps, "save_optimizer": save_optimizer,
                                                     "extra_state": extra_state}))
        return str(path)

    def resume_from_checkpoint(self, path: str, *, adapter_name: str | None = None) -> dict:
        self.calls.append(("resume_from_checkpoint", path, adapter_name))
        state = json.loads((Path(path) / "state.json").read_text())
        self.w, self.steps = state["w"], state["steps"]
        return state["extra_state"]

    def get_train_configs(self, *, adapter_name: str | None = None) -> dict:
        return {"lr": self.lr}


# ---------------------------------------------------------------------- helpers
@pytest.fixture(autouse=True)
def registry(monkeypatch):
    from twinkle_core.train import loop

    monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("TWINKLE_PLUGINS", FAKES)
    monkeypatch.setenv("TWINKLE_NO_PROGRESS", "1")
    monkeypatch.delenv("TWINKLE_TRUST_REMOTE_CODE", raising=False)
    monkeypatch.setattr(loop, "load_tokenizer", FakeTokenizer)
    FakeModel.instances.clear()
    reset_plugins()
    yield
    reset_plugins()


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out.get(key) or {}, value) if isinstance(value, dict) and key != "options" else value
    return out


def make_recipe(tmp_path: Path, n: int = 10, out: str = "out", **sections: Any) -> dict:
    data = tmp_path / "train.txt"
    if not data.exists():
        data.write_text("\n".join(str(i) for i in range(1, n + 1)))
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    base = {
        "task": "loop_fake_task",
        "model": {"class_name": "LoopFakeModel", "model_id": str(model_dir)},
        "data": {"train": str(data), "batch_size": 2},
        "optimizer": {"lr": 0.1},
        "train": {"output_dir": str(tmp_path / out), "max_grad_norm": None},
    }
    return merge(base, sections)


def run(recipe: dict, **kwargs: Any) -> dict:
    from twinkle_core.train.loop import train

    return train(recipe, **kwargs)


def train_log(output_dir: Path, event: str = "train") -> list[dict]:
    from twinkle_core.train.logging import read_log

    return [r for r in read_log(output_dir) if r["event"] == event]


def model() -> FakeModel:
    return FakeModel.instances[-1]


def count(name: str) -> int:
    return sum(1 for c in model().calls if c[0] == name)


# ---------------------------------------------------------------------- tests
def test_constructor_convention(tmp_path):
    recipe = make_recipe(tmp_path, model={"options": {"extra_option": 5}, "attn_implementation": "sdpa"},
                         mesh={"dp": 1}, precision="bf16", strategy={"name": "single", "options": {"x": 1}},
                         task_options={"flavour": "plain"}, train={"max_steps": 1})
    run(recipe)
    kwargs = model().kwargs
    assert set(kwargs) == {"model_id", "config", "strategy", "strategy_options", "mesh", "precision", "task",
                           "tokenizer", "trust_remote_code", "attn_implementation", "gradient_checkpointing",
                           "seed", "extra_option"}
    assert kwargs["model_id"] == str((tmp_path / "model").resolve())
    assert kwargs["config"] is None
    assert (kwargs["strategy"], kwargs["strategy_options"], kwargs["precision"]) == ("single", {"x": 1}, "bf16")
    assert kwargs["mesh"].to_dict()["dp"] == 1
    assert isinstance(kwargs["task"], FakeTask) and kwargs["task"].options == {"flavour": "plain"}
    assert isinstance(kwargs["tokenizer"], FakeTokenizer) and kwargs["tokenizer"].path == kwargs["model_id"]
    assert kwargs["trust_remote_code"] is False and kwargs["tokenizer"].trust_remote_code is False
    assert (kwargs["attn_implementation"], kwargs["gradient_checkpointing"], kwargs["extra_option"]) == ("sdpa",
                                                                                                          False, 5)
    assert kwargs["task"].data_options == {}  # only what the recipe sets is passed to load_dataset


def test_trust_remote_code_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TWINKLE_TRUST_REMOTE_CODE", "1")
    run(make_recipe(tmp_path, train={"max_steps": 1}))
    assert model().kwargs["trust_remote_code"] is True
    monkeypatch.setenv("TWINKLE_TRUST_REMOTE_CODE", "0")
    run(make_recipe(tmp_path, out="out2", train={"max_steps": 1}))
    assert model().kwargs["trust_remote_code"] is False
    run(make_recipe(tmp_path, out="out3", model={"trust_remote_code": True}, train={"max_steps": 1}))
    assert model().kwargs["trust_remote_code"] is True


def test_step_counting_and_gradient_accumulation(tmp_path):
    recipe = make_recipe(tmp_path, n=10, train={"num_epochs": 2, "gradient_accumulation_steps": 2},
                         lr_scheduler={"name": "linear", "warmup_ratio": 0.2}, data={"max_length": 64})
    summary = run(recipe)
    # 10 rows / batch 2 = 5 micro-batches per epoch; 2 epochs = 10 micro-batches = 5 optimizer steps
    assert summary["steps"] == summary["num_training_steps"] == 5
    assert count("forward_backward") == 10 and count("clip_grad_and_step") == 5
    assert model().steps == 5
    names = [c[0] for c in model().calls]
    assert names[:4] == ["prepare_model", "set_loss", "set_optimizer", "set_lr_scheduler"]
    assert model().calls[1] == ("set_loss", "mse", None, {})  # the task's default loss
    assert model().calls[2] == ("set_optimizer", "AdamW", None, {"lr": 0.1, "weight_decay": 0.0})
    assert model().calls[3] == ("set_lr_scheduler", "linear", None, {"num_training_steps": 5, "num_warmup_steps": 1})
    assert FakeModel.instances[-1].kwargs["task"].data_options == {"max_length": 64}
    assert summary["epoch"] == 1


def test_max_steps_wins_and_data_repeats(tmp_path):
    summary = run(make_recipe(tmp_path, n=4, train={"max_steps": 7}))  # 2 micro-batches per epoch
    assert summary["steps"] == 7 and count("forward_backward") == 7
    assert summary["epoch"] == 3


def test_jsonl_logging(tmp_path):
    summary = run(make_recipe(tmp_path, train={"max_steps": 7, "log_every": 3, "max_grad_norm": 0.5}))
    records = train_log(tmp_path / "out")
    assert [r["step"] for r in records] == [3, 6, 7]
    for record in records:
        assert {"step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s", "time"} <= set(record)
        assert record["lr"] == 0.1 and record["loss"] > 0 and record["grad_norm"] > 0
        assert record["tokens_per_s"] > 0
    assert records[-1]["elapsed_s"] >= records[0]["elapsed_s"]
    assert all(c[2] == 0.5 for c in model().calls if c[0] == "clip_grad_and_step")
    assert summary["train_metrics"]["loss"] == records[-1]["loss"]
    out = tmp_path / "out"
    assert (out / "recipe.yaml").is_file()
    assert json.loads((out / "summary.json").read_text())["steps"] == 7


def test_checkpoint_cadence_and_pruning(tmp_path):
    summary = run(make_recipe(tmp_path, train={"max_steps": 7, "save_every": 2, "save_total_limit": 2}))
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if p.is_dir() and p.name != "tensorboard") == ["checkpoint-4", "checkpoint-6", "final"]
    assert [c[1] for c in model().calls if c[0] == "save"] == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "final"]
    state = json.loads((out / "checkpoint-6" / "state.json").read_text())
    extra = state["extra_state"]
    assert extra["step"] == 6 and extra["epoch"] == 1 and extra["loader"]["position"] == 1
    assert state["save_optimizer"] is True
    final = json.loads((out / "final" / "state.json").read_text())
    assert final["extra_state"]["step"] == 7 and final["save_optimizer"] is False
    assert summary["final_checkpoint"] == str(out / "final")


def test_adapter_is_added_and_named_everywhere(tmp_path):
    run(make_recipe(tmp_path, model={"adapter": {"type": "lora", "r": 4}},
                    train={"max_steps": 2, "save_every": 1}))
    calls = model().calls
    assert calls[:2] == [("prepare_model", "FakeTask"), ("add_adapter_to_model", "default", {"type": "lora", "r": 4})]
    named = [c for c in calls if c[0] in ("set_loss", "set_optimizer", "set_lr_scheduler", "forward_backward",
                                          "clip_grad_and_step", "calculate_metric", "save")]
    assert named and all("default" in c for c in named)


def test_loss_from_the_recipe(tmp_path):
    run(make_recipe(tmp_path, loss={"name": "cross_entropy", "options": {"ignore_index": -1}},
                    train={"max_steps": 1}))
    assert ("set_loss", "cross_entropy", None, {"ignore_index": -1}) in model().calls


def _losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in train_log(output_dir)}


def test_resume_continues_the_losses_exactly(tmp_path):
    common = {"data": {"shuffle": True, "seed": 7}, "train": {"num_epochs": 3}}  # 8 rows: 4 batches per epoch
    (tmp_path / "train.txt").write_text("\n".join(str(i * 1.5) for i in range(8)))
    reference = run(make_recipe(tmp_path, out="a", **common))
    expected = _losses(tmp_path / "a")
    assert sorted(expected) == list(range(1, 13))
    final_w = model().w

    crashing = make_recipe(tmp_path, out="b", **merge(common, {
        "train": {"save_every": 5}, "model": {"options": {"fail_at": {"step": 8}}}}))
    with pytest.raises(Stop):
        run(crashing)
    names = sorted(p.name for p in (tmp_path / "b").iterdir() if p.is_dir() and p.name != "tensorboard")
    assert names == ["checkpoint-5", "checkpoint-7-interrupted"]

    summary = run(make_recipe(tmp_path, out="b", **merge(common, {"train": {"save_every": 5}})), resume="latest")
    assert summary["resumed_from"] == str(tmp_path / "b" / "checkpoint-7-interrupted")
    assert summary["steps"] == 12 and count("forward_backward") == 5
    assert model().w == final_w
    assert _losses(tmp_path / "b") == expected  # steps 1-7 from the first run, 8-12 from the resumed one

    run(make_recipe(tmp_path, out="c", **common), resume=str(tmp_path / "b" / "checkpoint-5"))
    assert _losses(tmp_path / "c") == {s: v for s, v in expected.items() if s > 5}
    assert model().w == final_w
    assert reference["steps"] == 12


def test_interrupted_checkpoint_mid_accumulation_keeps_the_step_boundary(tmp_path):
    common = {"train": {"gradient_accumulation_steps": 2, "max_steps": 4}}
    run(make_recipe(tmp_path, n=12, out="ref", **common))
    expected = _losses(tmp_path / "ref")
    recipe = make_recipe(tmp_path, n=12, out="run", **merge(common, {
        "model": {"options": {"fail_at": {"step": 3, "micro": 1}}}}))
    with pytest.raises(Stop, match="injected failure at step 3"):
        run(recipe)
    saved = tmp_path / "run" / "checkpoint-2-interrupted"
    extra = json.loads((saved / "state.json").read_text())["extra_state"]
    assert extra["step"] == 2 and extra["loader"]["position"] == 4  # not 5: the half-done step is redone
    run(make_recipe(tmp_path, n=12, out="run", **common), resume="latest")
    assert _losses(tmp_path / "run") == expected


@pytest.mark.parametrize("kind", ["interrupt", "sigterm"])
def test_ctrl_c_and_sigterm_save_before_stopping(tmp_path, kind):
    recipe = make_recipe(tmp_path, model={"options": {"fail_at": {"step": 3, "kind": kind}}},
                         train={"max_steps": 5})
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        run(recipe)
    assert (tmp_path / "out" / "checkpoint-2-interrupted" / "state.json").is_file()
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is restored


def test_no_interrupted_checkpoint_without_progress(tmp_path):
    recipe = make_recipe(tmp_path, model={"options": {"fail_at": {"step": 3}}},
                         train={"max_steps": 5, "save_every": 2})
    with pytest.raises(Stop):
        run(recipe)
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir() and p.name != "tensorboard") == ["checkpoint-2"]


def test_evaluation_before_during_and_after(tmp_path):
    (tmp_path / "eval.txt").write_text("1 2 3")
    recipe = make_recipe(tmp_path, data={"eval": str(tmp_path / "eval.txt")},
                         train={"max_steps": 4, "eval_every": 2, "eval_before_training": True,
                                "evaluate_options": {"max_new_tokens": 3}})
    summary = run(recipe)
    evals = train_log(tmp_path / "out", "eval")
    assert [e["step"] for e in evals] == [0, 2, 4]
    before = summary["eval_before"]
    assert before["eval_loss"] == pytest.approx((1 + 4 + 9) / 3)  # w = 0 before training
    assert before["eval_fake_metric"] == 0.5 and before["eval_already_prefixed"] == 1.0
    assert summary["eval_after"]["eval_loss"] < before["eval_loss"]
    assert "eval_ppl" in before
    task = model().kwargs["task"]
    assert task.evaluated[1] == {"max_new_tokens": 3} and task.evaluated[0] == [1.0, 2.0, 3.0]
    assert all(r["loss"] < 1e3 for r in train_log(tmp_path / "out"))  # evaluation did not leak


def test_eval_loss_only_without_evaluate_options(tmp_path):
    (tmp_path / "eval.txt").write_text("2 2")
    summary = run(make_recipe(tmp_path, data={"eval": str(tmp_path / "eval.txt")}, train={"max_steps": 1}))
    assert set(summary["eval_after"]) == {"eval_loss", "eval_ppl"}
    assert not hasattr(model().kwargs["task"], "evaluated")


def test_resume_latest_without_checkpoint_starts_fresh(tmp_path):
    summary = run(make_recipe(tmp_path, train={"max_steps": 2}), resume="latest")
    assert summary["resumed_from"] is None and summary["steps"] == 2


def test_resume_from_a_missing_checkpoint_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        run(make_recipe(tmp_path, train={"max_steps": 2}), resume=str(tmp_path / "nope"))


def test_unknown_model_class_fails_before_anything_is_built(tmp_path):
    with pytest.raises(PluginNotFoundError, match="model.class_name: no model named 'Nope'"):
        run(make_recipe(tmp_path, model={"class_name": "Nope"}))
    assert FakeModel.instances == []


def test_accumulation_larger_than_the_data_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=4"):
        run(make_recipe(tmp_path, n=4, train={"gradient_accumulation_steps": 4}))


def test_checkpoint_helpers(tmp_path):
    from twinkle_core.train.loop import latest_checkpoint, list_checkpoints, prune_checkpoints

    for name in ("checkpoint-2", "checkpoint-10", "checkpoint-10-interrupted", "checkpoint-3-interrupted",
                 "checkpoint-12-interrupted", "final", "checkpoint-x"):
        (tmp_path / name).mkdir()
    assert [(s, i) for s, i, _ in list_checkpoints(tmp_path)] == [(2, False), (3, True), (10, True), (10, False),
                                                                  (12, True)]
    assert latest_checkpoint(tmp_path).name == "checkpoint-12-interrupted"
    removed = prune_checkpoints(tmp_path, 1)
    assert sorted(p.name for p in removed) == ["checkpoint-10-interrupted", "checkpoint-2", "checkpoint-3-interrupted"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-12-interrupted",
                                                          "checkpoint-x", "final"]
    assert prune_checkpoints(tmp_path, None) == []


def test_nan_loss_is_logged_as_null(tmp_path):
    from twinkle_core.train.logging import TrainLogger, read_log

    with TrainLogger(tmp_path, tensorboard=False) as log:
        log.log("train", 1, {"loss": float("nan"), "x": math.inf, "ok": 1.5})
    assert read_log(tmp_path)[0] | {"time": 0} == {"event": "train", "step": 1, "loss": None, "x": None, "ok": 1.5,
                                                   "time": 0}
