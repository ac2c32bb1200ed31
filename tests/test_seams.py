"""Contract tests for the seams between task, model, loss and strategy (issue 8)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from twinkle_core.capabilities import check_compatible
from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import Loss, LossContext, LossOutput
from twinkle_core.mesh import DeviceMesh
from twinkle_core.model.train_state import TrainState
from twinkle_core.precision import BF16Precision, FullPrecision
from twinkle_core.strategy import OptimizerHandle, SingleProcessStrategy
from twinkle_core.task import Task, default_loss_name
from twinkle_core.testing.conformance import make_batch
from twinkle_core.testing.reference import ReferenceModel, make_reference_model


class HeadTask(Task):
    """Adds a head output on every forward and a file on every export."""

    name = "head"
    default_loss = "cross_entropy"

    def __init__(self) -> None:
        super().__init__()
        self.forwards = 0
        self.exports: list[tuple[str, str | None]] = []

    def load_dataset(self, path: str, tokenizer: Any, **data_options: Any) -> Any:
        return []

    def collate(self, features: list[Any]) -> dict[str, Any]:
        return {}

    def process_outputs(self, outputs: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
        self.forwards += 1
        return {**outputs, "last_logits": outputs["logits"][:, -1]}

    def on_export(self, model: Any, directory: str, adapter_name: str | None) -> None:
        self.exports.append((os.path.basename(directory), adapter_name))
        with open(os.path.join(directory, "head.json"), "w") as f:
            f.write("{}")


class ContextRecordingLoss(Loss):
    name = "context_recording"

    def __init__(self) -> None:
        self.contexts: list[Any] = []

    def __call__(self, outputs, inputs, context=None):
        self.contexts.append(context)
        return LossOutput(loss=outputs["last_logits"].float().pow(2).sum(), num_tokens=outputs["last_logits"].numel())


def test_task_hooks_run_on_every_forward_and_export(tmp_path):
    task = HeadTask()
    model = make_reference_model(task=task)
    loss = ContextRecordingLoss()
    model.set_loss(loss)
    model.set_optimizer("AdamW", lr=1e-3)
    batch = make_batch(0, rows=2, length=6)
    out = model.forward_backward(inputs=batch)
    assert "last_logits" in out and task.forwards == 1
    assert "last_logits" in model.forward_only(inputs=batch) and task.forwards == 2
    path = model.save("ckpt", output_dir=str(tmp_path))
    assert [adapter for _, adapter in task.exports] == [None]  # once, on the main process, for the full model
    assert os.path.exists(os.path.join(path, "head.json"))


def test_loss_receives_the_strategys_context():
    model = make_reference_model(task=HeadTask())
    loss = ContextRecordingLoss()
    model.set_loss(loss)
    model.forward_backward(inputs=make_batch(0, rows=2, length=6))
    (context,) = loss.contexts
    assert isinstance(context, LossContext)
    assert (context.dp_size, context.dp_rank, context.sp_size) == (1, 0, 1)


def test_losses_without_context_parameter_still_work():
    class OldStyleLoss(Loss):  # written before ``context=`` existed
        def __call__(self, outputs, inputs):  # type: ignore[override]
            return LossOutput(loss=outputs["logits"].float().sum() * 0.0 + 1.0, num_tokens=1)

    model = make_reference_model()
    model.set_loss(OldStyleLoss())
    out = model.forward_backward(inputs=make_batch(0, rows=2, length=6))
    assert float(out["loss"]) == 1.0
    model.set_loss(lambda outputs, inputs: outputs["logits"].float().mean())
    model.forward_backward(inputs=make_batch(0, rows=2, length=6))


def test_default_loss_rule():
    assert default_loss_name(None) == "cross_entropy"
    assert default_loss_name(HeadTask()) == "cross_entropy"

    class NoDefault(HeadTask):
        default_loss = ""

    assert default_loss_name(NoDefault()) == "cross_entropy"


@dataclass(eq=False)
class CountingHandle(OptimizerHandle):
    hooks: list = None  # type: ignore[assignment]


class HandleStrategy(SingleProcessStrategy):
    """Records which handle every gradient hook receives."""

    name = "single"

    def prepare_optimizer(self, module, optimizer, *, parameters, gradient_accumulation_steps=1):
        return module, CountingHandle(optimizer, list(parameters), gradient_accumulation_steps, hooks=[])

    def backward(self, loss, module, handle):
        if handle is not None:
            handle.hooks.append("backward")
        super().backward(loss, module, handle)

    def scale_gradients(self, module, handle, factor):
        handle.hooks.append("scale")
        super().scale_gradients(module, handle, factor)

    def clip_grad_norm(self, module, handle, max_norm, norm_type=2.0):
        handle.hooks.append("clip")
        return super().clip_grad_norm(module, handle, max_norm, norm_type)

    def optimizer_step(self, module, handle):
        handle.hooks.append("step")
        return super().optimizer_step(module, handle)

    def zero_grad(self, module, handle):
        handle.hooks.append("zero")
        super().zero_grad(module, handle)


def test_every_gradient_hook_receives_the_strategys_handle():
    model = make_reference_model(strategy=HandleStrategy())
    model.add_adapter_to_model("a", {"r": 2, "lora_alpha": 4})
    model.add_adapter_to_model("b", {"r": 2, "lora_alpha": 4})
    for name in ("a", "b"):
        model.set_optimizer("AdamW", lr=1e-3, adapter_name=name)
    model.forward_backward(inputs=make_batch(0, rows=2, length=6), adapter_name="b")
    model.clip_grad_and_step(1.0, adapter_name="b")
    handle_a, handle_b = model._states["a"].handle, model._states["b"].handle
    assert handle_a.hooks == []
    assert handle_b.hooks == ["backward", "scale", "clip", "step", "zero"]
    assert {id(p) for p in handle_b.parameters} == {id(p) for p in model.trainable_parameters(adapter_name="b")}
    assert model._states["b"].optimizer is handle_b.optimizer


def test_precision_reaches_the_strategy_at_construction():
    model = make_reference_model(precision="bf16")
    assert model.strategy.precision is model.precision
    built = SingleProcessStrategy(precision=BF16Precision())
    assert built.precision.name == "bf16"
    with pytest.raises(ConfigError, match="built with precision 'no'"):
        make_reference_model(precision="bf16", strategy=SingleProcessStrategy(precision=FullPrecision()))


def test_gradient_window_api_matches_the_generic_backward():
    """A backend that runs its own schedule (Megatron) calls the window API; the result is the generic path's."""
    batch = make_batch(3, rows=4, length=8)
    reference = make_reference_model()
    reference.set_optimizer("SGD", lr=0.1)
    reference.forward_backward(inputs=batch)
    expected = {n: p.grad.clone() for n, p in reference.module.named_parameters()}

    manual = make_reference_model()
    manual.set_optimizer("SGD", lr=0.1)
    state: TrainState = manual._states[""]
    manual._ensure_loss(state)
    outputs = manual._compute(manual._to_device(batch), None)
    result = state.apply_loss(outputs, batch, manual.loss_context)
    state.open_window(float(result.num_tokens), manual.strategy)
    manual.strategy.backward(state.scale_for_backward(result.loss), manual.wrapped, state.handle)
    state.record_backward(result.num_tokens)
    assert state.backward_calls == 1 and state.pending_tokens == float(result.num_tokens)
    for name, p in manual.module.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0)


def test_apply_loss_rejects_a_loss_that_returns_a_bare_value():
    state = TrainState(name="")
    state.loss = lambda outputs, inputs, context=None: 1.0
    with pytest.raises(TypeError, match="expected LossOutput"):
        state.apply_loss({}, {})


class OnlyOnSingle(ReferenceModel):
    supported_strategies = ("single",)
    strategy_note = "Tenants come and go at run time."


class DataParallelOnly(SingleProcessStrategy):
    name = "ddp_like"
    mesh_dimensions = ("dp",)


class DrivesOtherModels(SingleProcessStrategy):
    name = "megatron_like"
    supported_models = ("MegatronModel",)


def test_impossible_combinations_fail_before_anything_is_built():
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"runs on the 'single' strategy only; got strategy 'ddp_like': use strategy 'single'"):
        check_compatible(OnlyOnSingle, DataParallelOnly, DeviceMesh(dp=2))
    with pytest.raises(ConfigError, match=r"strategy 'ddp_like' implements only the mesh dimension\(s\) dp; "
                                          r"this mesh has tp=2"):
        check_compatible(ReferenceModel, DataParallelOnly, DeviceMesh(dp=1, tp=2))
    with pytest.raises(ConfigError, match="drives MegatronModel only; ReferenceModel cannot run on it"):
        check_compatible(ReferenceModel, DrivesOtherModels, None)
    with pytest.raises(ConfigError, match="implements only the mesh dimension"):
        check_compatible(ReferenceModel, SingleProcessStrategy, DeviceMesh(vpp=2, pp=2))
    check_compatible(ReferenceModel, DataParallelOnly, DeviceMesh(dp=4))
    assert time.perf_counter() - started < 1.0


def test_the_model_checks_capabilities_before_building():
    class Exploding(OnlyOnSingle):
        def build_network(self):  # pragma: no cover - must never run
            raise AssertionError("built the network before checking capabilities")

    with pytest.raises(ConfigError, match="Tenants come and go at run time"):
        Exploding(strategy=DataParallelOnly())


def test_a_strategy_explains_the_dimensions_it_lacks():
    class Explains(DataParallelOnly):
        dimension_notes = {"sp": "no sequence parallelism here (mesh.sp={size}); use mesh.cp"}

    with pytest.raises(ConfigError, match=r"no sequence parallelism here \(mesh.sp=2\); use mesh.cp"):
        check_compatible(ReferenceModel, Explains, DeviceMesh(dp=1, sp=2))
    with pytest.raises(ConfigError, match="implements only the mesh dimension"):  # no note: the generic refusal
        check_compatible(ReferenceModel, Explains, DeviceMesh(dp=1, tp=2))
