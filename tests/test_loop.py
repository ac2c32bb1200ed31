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

from twinkle_core import ModelRecord, StrategyRecord, TaskRecord, hookimpl
from twinkle_core.errors import ConfigError, PluginNotFoundError
from twinkle_core.model.base import TwinkleModel
from twinkle_core.plugins import reset_plugins
from twinkle_core.strategy import SingleProcessStrategy
from twinkle_core.task import Task
from twinkle_core.testing.conformance import ModelContract

FAKES = "twinkle_test_loop_fakes"
sys.modules.setdefault(FAKES, sys.modules[__name__])  # a stable import name for the records below


# ---------------------------------------------------------------------- plugin
@hookimpl
def twinkle_register_models():
    yield ModelRecord("LoopFakeModel", f"{FAKES}:FakeModel", "scalar least squares (test fixture)")


@hookimpl
def twinkle_register_tasks():
    yield TaskRecord("loop_fake_task", f"{FAKES}:FakeTask", "numbers, one per token (test fixture)")


@hookimpl
def twinkle_register_strategies():
    yield StrategyRecord("loop_ranks", f"{FAKES}:RanksStrategy", "any number of ranks (test fixture)")


class RanksStrategy(SingleProcessStrategy):
    """Named by recipes of the fake model that run on several processes (the fake model builds no strategy); the
    core's 'single' refuses a job of more than one process."""

    name = "loop_ranks"

    @classmethod
    def check_world_size(cls, world_size: int) -> None:
        pass


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

        return {"labels": torch.tensor(features, dtype=torch.float64), "attention_mask": torch.ones(len(features))}

    def prepare_model(self, model: Any) -> None:
        model.calls.append(("prepare_model", type(self).__name__))

    def prepare_dataset(self, model: Any, dataset: Any, *, split: str, output_dir: str) -> Any:
        model.calls.append(("prepare_dataset", split, len(dataset), output_dir))
        return dataset

    def prepare_batch(self, model: Any, batch: dict[str, Any]) -> dict[str, Any]:
        model.calls.append(("prepare_batch", int(batch["labels"].numel())))
        return {**batch, "prepared": True}

    def evaluate(self, model: Any, dataset: Any, tokenizer: Any, **options: Any) -> dict[str, float]:
        self.evaluated = (dataset, options)
        return {"fake_metric": 0.5, "eval_already_prefixed": 1.0}


class Stop(Exception):
    pass


class FakeModel(TwinkleModel):
    """A TwinkleModel with one float64 weight ``w`` that predicts every label; records every call.

    It fits ``w`` to the batch's ``labels`` (the numbers of the data file, or the conformance suite's
    token ids) by squared error, with the real optimizer and scheduler it is given, so every loss is a
    deterministic function of the data order and the steps taken. Simplifications: the objective is
    squared error whatever ``set_loss`` names (it records the choice), adapters are names sharing
    ``w``, there is one data-parallel rank, ``w`` starts at 0 whatever the seed, and the only metric
    is the loss.
    """

    instances: list[FakeModel] = []
    #: added to the loss metric by every loss of a ``forward_only`` output, so that a test sees
    #: evaluation leaking into the training metrics (the loop must reset them after evaluating)
    EVAL_SENTINEL = 1e6

    def __init__(self, **kwargs: Any) -> None:
        import torch

        self.kwargs = kwargs
        self.fail_at = kwargs.get("fail_at")
        self.weight = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
        self.adapters: list[str] = []
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.specs: dict[str, dict[str, Any] | None] = {"loss": None, "optimizer": None, "lr_scheduler": None}
        self.gradient_accumulation_steps = 1
        self.steps = self.micro = self.accumulated_calls = 0
        self.pending_tokens = 0.0  # tokens of the gradients accumulated and not yet divided by their count
        self.metric_loss = self.metric_tokens = 0.0
        self.last_inputs: Any = None
        self.last_outputs: Any = None
        self.last_loss: Any = None
        self.calls: list[tuple] = []
        FakeModel.instances.append(self)

    @property
    def w(self) -> float:
        return float(self.weight.detach())

    @classmethod
    def load_tokenizer(cls, path: str, *, trust_remote_code: bool = False) -> FakeTokenizer:
        return FakeTokenizer(path, trust_remote_code)

    def _check_adapter(self, adapter_name: str | None) -> None:
        if adapter_name is not None and adapter_name not in self.adapters:
            raise ConfigError(f"no adapter named {adapter_name!r}; adapters: {self.adapters}")

    def _require_optimizer(self, action: str) -> None:
        if self.optimizer is None:
            raise ConfigError(f"{action} needs set_optimizer first")

    def _lr(self) -> float | None:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else None

    # configuration
    def add_adapter_to_model(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        self.calls.append(("add_adapter_to_model", adapter_name, config))
        if not adapter_name or adapter_name in self.adapters:
            raise ConfigError(f"adapter name {adapter_name!r} is empty or already in use")
        self.adapters.append(adapter_name)

    def set_loss(self, loss: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        self.calls.append(("set_loss", loss, adapter_name, kwargs))
        self._check_adapter(adapter_name)
        self.specs["loss"] = {"name": loss if isinstance(loss, str) else getattr(loss, "name", "") or repr(loss),
                              **kwargs}

    def set_optimizer(self, optimizer: Any, *, adapter_name: str | None = None, gradient_accumulation_steps: int = 1,
                      **kwargs: Any) -> None:
        from twinkle_core.optim import build_optimizer

        self.calls.append(("set_optimizer", optimizer, adapter_name, kwargs))
        self._check_adapter(adapter_name)
        self.optimizer = build_optimizer(optimizer, [self.weight], **kwargs)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.specs["optimizer"] = {"name": optimizer if isinstance(optimizer, str) else type(self.optimizer).__name__,
                                   **kwargs}

    def set_lr_scheduler(self, scheduler: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        from twinkle_core.optim import build_scheduler

        self.calls.append(("set_lr_scheduler", scheduler, adapter_name, kwargs))
        self._check_adapter(adapter_name)
        self._require_optimizer("set_lr_scheduler")
        self.scheduler = build_scheduler(scheduler, self.optimizer, **kwargs)
        self.specs["lr_scheduler"] = {"name": scheduler if isinstance(scheduler, str) else type(self.scheduler).__name__,
                                      **kwargs}

    def trainable_parameters(self, *, adapter_name: str | None = None) -> list[Any]:
        self._check_adapter(adapter_name)
        return [self.weight]

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

    def forward(self, *, inputs: dict[str, Any], adapter_name: str | None = None, **kw: Any) -> dict:
        self._check_adapter(adapter_name)
        self.last_inputs = inputs
        self.last_outputs = {"logits": self.weight.expand(inputs["labels"].shape)}
        return self.last_outputs

    def forward_only(self, *, inputs: dict[str, Any], adapter_name: str | None = None, **kw: Any) -> dict:
        self.calls.append(("forward_only", adapter_name))
        self._check_adapter(adapter_name)
        return {"logits": self.weight.detach().expand(inputs["labels"].shape)}

    def calculate_loss(self, *, inputs: dict | None = None, outputs: dict | None = None,
                       adapter_name: str | None = None, **kw: Any) -> Any:
        import torch

        from twinkle_core.loss.base import LossOutput

        self._check_adapter(adapter_name)
        inputs = self.last_inputs if inputs is None else inputs
        outputs = self.last_outputs if outputs is None else outputs
        if inputs is None or outputs is None:
            raise ConfigError("calculate_loss needs outputs: call forward first or pass outputs=")
        labels = inputs["labels"].to(torch.float64)
        loss = LossOutput(loss=((outputs["logits"] - labels) ** 2).sum(), num_tokens=labels.numel())
        evaluating = not outputs["logits"].requires_grad
        self.metric_loss += float(loss.loss.detach()) + (self.EVAL_SENTINEL if evaluating else 0.0)
        self.metric_tokens += loss.num_tokens
        self.last_loss = loss
        return loss

    def backward(self, *, loss: Any = None, adapter_name: str | None = None, **kwargs: Any) -> None:
        self._check_adapter(adapter_name)
        loss = self.last_loss if loss is None else loss
        if loss is None:
            raise ConfigError("backward needs a loss: call calculate_loss first or pass loss=")
        loss.loss.backward()
        self.pending_tokens += float(loss.num_tokens)

    def forward_backward(self, *, inputs: dict[str, Any], adapter_name: str | None = None, **kw: Any) -> dict:
        self.calls.append(("forward_backward", adapter_name))
        self._maybe_fail()
        outputs = self.forward(inputs=inputs, adapter_name=adapter_name)
        loss = self.calculate_loss(adapter_name=adapter_name)
        self.backward(loss=loss, adapter_name=adapter_name)
        self.micro += 1
        return {**outputs, "loss": loss.mean.detach(), "num_tokens": loss.num_tokens}

    # optimisation
    def _normalise_gradients(self) -> None:
        if self.pending_tokens:
            self.weight.grad /= self.pending_tokens
            self.pending_tokens = 0.0

    def clip_grad_norm(self, max_grad_norm: float | None = 1.0, norm_type: float = 2.0, *,
                       adapter_name: str | None = None) -> float:
        import torch

        self._check_adapter(adapter_name)
        self._normalise_gradients()
        limit = math.inf if max_grad_norm is None else max_grad_norm
        return float(torch.nn.utils.clip_grad_norm_([self.weight], limit, norm_type))

    def step(self, *, adapter_name: str | None = None) -> None:
        self._check_adapter(adapter_name)
        self._require_optimizer("step")
        self._normalise_gradients()
        self.optimizer.step()
        self.steps += 1
        self.micro = 0

    def zero_grad(self, *, adapter_name: str | None = None) -> None:
        self._check_adapter(adapter_name)
        self.weight.grad = None
        self.pending_tokens = 0.0
        self.accumulated_calls = 0

    def lr_step(self, *, adapter_name: str | None = None) -> None:
        self._check_adapter(adapter_name)
        if self.scheduler is not None:
            self.scheduler.step()

    def clip_grad_and_step(self, max_grad_norm: float | None = 1.0, norm_type: float = 2.0, *,
                           adapter_name: str | None = None) -> float | None:
        self.calls.append(("clip_grad_and_step", adapter_name, max_grad_norm))
        self.accumulated_calls += 1
        if self.accumulated_calls < self.gradient_accumulation_steps:
            return None
        norm = self.clip_grad_norm(max_grad_norm, norm_type, adapter_name=adapter_name)
        self.step(adapter_name=adapter_name)
        self.zero_grad(adapter_name=adapter_name)
        self.lr_step(adapter_name=adapter_name)
        return norm

    # metrics and configs
    def add_metric(self, metric: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        raise ConfigError(f"FakeModel reports only the loss; it cannot add the metric {metric!r}")

    def calculate_metric(self, *, adapter_name: str | None = None, reset: bool = True) -> dict[str, float]:
        self.calls.append(("calculate_metric", adapter_name))
        self._check_adapter(adapter_name)
        tokens = self.metric_tokens
        result = {"loss": self.metric_loss / tokens if tokens else float("nan"), "tokens": tokens}
        if self.optimizer is not None:
            result["lr"] = self._lr()
        if reset:
            self.metric_loss = self.metric_tokens = 0.0
        return result

    def get_train_configs(self, *, adapter_name: str | None = None) -> dict:
        self._check_adapter(adapter_name)
        return {"class": type(self).__name__, "adapter_name": adapter_name, "adapters": list(self.adapters),
                "strategy": {"name": self.kwargs.get("strategy", "single")},
                "precision": self.kwargs.get("precision", "no"), **self.specs, "lr": self._lr(),
                "gradient_accumulation_steps": self.gradient_accumulation_steps, "dp_rank": 0, "dp_size": 1,
                "trainable_parameters": self.weight.numel(), "step": self.steps}

    # state
    def get_state_dict(self, *, adapter_name: str | None = None) -> dict[str, Any]:
        self._check_adapter(adapter_name)
        return {"w": self.weight.detach().clone()}

    def save(self, name: str, *, output_dir: str, adapter_name: str | None = None, save_optimizer: bool = True,
             extra_state: dict | None = None) -> str:
        import torch

        self.calls.append(("save", name, adapter_name))
        self._check_adapter(adapter_name)
        path = Path(output_dir) / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "state.json").write_text(json.dumps({"w": self.w, "steps": self.steps, "save_optimizer": save_optimizer,
                                                     "extra_state": extra_state}))
        if save_optimizer and self.optimizer is not None:
            torch.save({"optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None},
                       path / "training_state.pt")
        return str(path)

    def load(self, path: str, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        import torch

        self._check_adapter(adapter_name)
        with torch.no_grad():
            self.weight.fill_(json.loads((Path(path) / "state.json").read_text())["w"])

    def resume_from_checkpoint(self, path: str, *, adapter_name: str | None = None) -> dict:
        import torch

        self.calls.append(("resume_from_checkpoint", path, adapter_name))
        self._require_optimizer("resume_from_checkpoint")
        self.load(path, adapter_name=adapter_name)
        training = torch.load(Path(path) / "training_state.pt", weights_only=False)
        self.optimizer.load_state_dict(training["optimizer"])
        if self.scheduler is not None and training["scheduler"] is not None:
            self.scheduler.load_state_dict(training["scheduler"])
        state = json.loads((Path(path) / "state.json").read_text())
        self.steps = state["steps"]
        return state["extra_state"]


class TestFakeModelConformance:
    """The conformance tests a one-weight model can pass: the others need vocabulary logits (forward,
    cross-entropy, accuracy), more than one weight (memorising token ids), a seed-dependent
    initialisation (save/load round trip) or adapters with their own weights."""

    @pytest.fixture
    def twinkle_factory(self):
        return FakeModel

    test_forward_only_matches_forward_without_grad = ModelContract.test_forward_only_matches_forward_without_grad
    test_step_by_step_equals_forward_backward = ModelContract.test_step_by_step_equals_forward_backward
    test_clip_grad_norm_returns_true_norm_and_clips = ModelContract.test_clip_grad_norm_returns_true_norm_and_clips
    test_max_grad_norm_changes_the_update = ModelContract.test_max_grad_norm_changes_the_update
    test_optimizer_by_name_class_and_instance = ModelContract.test_optimizer_by_name_class_and_instance
    test_scheduler_by_name_class_and_instance = ModelContract.test_scheduler_by_name_class_and_instance
    test_train_configs_describe_the_run = ModelContract.test_train_configs_describe_the_run
    test_train_configs_follow_the_schema = ModelContract.test_train_configs_follow_the_schema
    test_gradient_accumulation_is_exact = ModelContract.test_gradient_accumulation_is_exact
    test_resume_continues_exactly = ModelContract.test_resume_continues_exactly
    test_unknown_adapter_is_a_clear_error = ModelContract.test_unknown_adapter_is_a_clear_error


# ---------------------------------------------------------------------- helpers
@pytest.fixture(autouse=True)
def registry(monkeypatch):
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("TWINKLE_PLUGINS", FAKES)
    monkeypatch.setenv("TWINKLE_NO_PROGRESS", "1")
    monkeypatch.delenv("TWINKLE_TRUST_REMOTE_CODE", raising=False)
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
        "lr_scheduler": {"name": "constant"},  # the fake follows the schedule; the logs expect a fixed lr
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
    # the model is given the accumulation (set_optimizer) and steps on every 2nd clip_grad_and_step
    assert count("forward_backward") == 10 and count("clip_grad_and_step") == 10
    assert model().steps == 5 and model().gradient_accumulation_steps == 2
    calls = [c for c in model().calls if c[0] != "prepare_dataset"]
    assert [c[0] for c in calls[:4]] == ["prepare_model", "set_loss", "set_optimizer", "set_lr_scheduler"]
    assert calls[1] == ("set_loss", "mse", None, {})  # the task's default loss
    assert calls[2] == ("set_optimizer", "AdamW", None, {"lr": 0.1, "weight_decay": 0.0})
    assert calls[3] == ("set_lr_scheduler", "linear", None, {"num_training_steps": 5, "num_warmup_steps": 1})
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


def test_data_sets_go_through_prepare_dataset_and_every_batch_through_prepare_batch(tmp_path):
    (tmp_path / "eval.txt").write_text("2 2")
    run(make_recipe(tmp_path, data={"eval": str(tmp_path / "eval.txt")}, train={"max_steps": 3}))
    forwards = count("forward_backward") + count("forward_only")
    assert count("prepare_batch") == forwards > 3
    assert model().last_inputs["prepared"]  # the model trained on what prepare_batch returned
    prepared = [c for c in model().calls if c[0] == "prepare_dataset"]
    assert prepared == [("prepare_dataset", "train", 10, str(tmp_path / "out")),
                        ("prepare_dataset", "eval", 2, str(tmp_path / "out"))]
    assert model().calls.index(prepared[-1]) < model().calls.index(("forward_backward", None))


def test_eval_loss_only_without_evaluate_options(tmp_path):
    (tmp_path / "eval.txt").write_text("2 2")
    summary = run(make_recipe(tmp_path, data={"eval": str(tmp_path / "eval.txt")}, train={"max_steps": 1}))
    assert set(summary["eval_after"]) == {"eval_loss", "eval_ppl"}
    assert not hasattr(model().kwargs["task"], "evaluated")


def test_evaluate_options_without_a_held_out_set_skip_evaluation_with_a_warning(tmp_path, caplog):
    # `twinkle train recipe.yaml data.eval=null` on a recipe with evaluate_options must still train
    summary = run(make_recipe(tmp_path, train={"max_steps": 2, "eval_before_training": True,
                                               "evaluate_options": {"max_new_tokens": 3}}))
    assert summary["steps"] == 2 and not hasattr(model().kwargs["task"], "evaluated")
    assert "data.eval is not" in caplog.text


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


def test_tokenizers_are_loaded_by_the_model_class(tmp_path):
    with pytest.raises(ConfigError, match="FakeModel cannot load a tokenizer"):
        super(FakeModel, FakeModel).load_tokenizer(str(tmp_path))  # TwinkleModel's default


def test_nan_loss_is_logged_as_null(tmp_path):
    from twinkle_core.train.logging import TrainLogger, read_log

    with TrainLogger(tmp_path, tensorboard=False) as log:
        log.log("train", 1, {"loss": float("nan"), "x": math.inf, "ok": 1.5})
    assert read_log(tmp_path)[0] | {"time": 0} == {"event": "train", "step": 1, "loss": None, "x": None, "ok": 1.5,
                                                   "time": 0}
