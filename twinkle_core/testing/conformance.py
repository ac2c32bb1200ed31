"""The ``TwinkleModel`` conformance suite: the contract every backend must pass unchanged.

Run it against a registered target::

    pytest --pyargs twinkle_core.testing.conformance --twinkle-backend hf
    torchrun --nproc-per-node 2 -m pytest --pyargs twinkle_core.testing.conformance --twinkle-backend hf-ddp

or subclass :class:`ModelContract`, :class:`~twinkle_core.testing.conformance_tasks.TaskContract` (the task
side: one test per model kind) and :class:`~twinkle_core.testing.conformance_lora_targets.LoraTargetContract` in a
backend's tests and override the ``twinkle_factory`` fixture.

A factory is ``factory(*, seed: int = 0, **options) -> TwinkleModel`` (``task=`` among the options) building a
tiny causal LM
whose vocabulary has :data:`CONFORMANCE_VOCAB_SIZE` tokens, whose reductions sum at most
:data:`CONFORMANCE_MAX_WIDTH` terms over at most :data:`CONFORMANCE_MAX_DEPTH` layers (the bounds of the
float tolerance of forward comparisons), and that accepts the LoRA adapter config :data:`LORA_CONFIG`
(plus ``init_lora_weights=False``: B random too). Under several ranks, every rank runs every test; ranks of the same data-parallel
index get the same rows.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import pytest

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.testing.conformance_data import (
    CONFORMANCE_MAX_DEPTH,
    CONFORMANCE_MAX_WIDTH,
    CONFORMANCE_VOCAB_SIZE,
    LORA_CONFIG,
    assert_state_equal,
    forward_tolerance_of,
    local_rows,
    make_batch,
    rows,
    snapshot,
)
from twinkle_core.testing.conformance_generation import GenerationContract
from twinkle_core.testing.conformance_lora_targets import LoraTargetContract
from twinkle_core.testing.conformance_tasks import TaskContract

__all__ = ["CONFORMANCE_MAX_DEPTH", "CONFORMANCE_MAX_WIDTH", "CONFORMANCE_VOCAB_SIZE", "LORA_CONFIG",
           "LoraTargetContract", "ModelContract", "TaskContract", "TestLoraTargetContract", "TestModelContract",
           "TestTaskContract", "assert_state_equal", "local_rows", "make_batch",
           "rows", "snapshot"]

class ModelContract(GenerationContract):
    """The contract tests. Needs a ``twinkle_factory`` fixture and a ``twinkle_shared_dir`` fixture.
    The tests of the seams online RL uses (``generation_module``, ``sibling``) are inherited from
    :class:`~twinkle_core.testing.conformance_generation.GenerationContract`."""

    # ------------------------------------------------------------------ compute
    def test_forward_returns_logits(self, twinkle_factory):
        model = twinkle_factory(seed=0)
        batch = local_rows(model, make_batch(0))
        out = model.forward(inputs=batch)
        logits = out["logits"]
        assert tuple(logits.shape) == (*batch["input_ids"].shape, CONFORMANCE_VOCAB_SIZE)
        assert logits.requires_grad

    def test_forward_only_matches_forward_without_grad(self, twinkle_factory):
        import torch

        model = twinkle_factory(seed=0)
        batch = local_rows(model, make_batch(1))
        evaluated = model.forward_only(inputs=batch)["logits"]
        assert not evaluated.requires_grad
        trained = model.forward(inputs=batch)["logits"]
        torch.testing.assert_close(evaluated.float(), trained.detach().float(), atol=1e-5, rtol=1e-5)

    def test_step_by_step_equals_forward_backward(self, twinkle_factory):
        batch = make_batch(2)
        a, b = twinkle_factory(seed=0), twinkle_factory(seed=0)
        for m in (a, b):
            m.set_optimizer("SGD", lr=0.1)
        a.forward_backward(inputs=local_rows(a, batch))
        b.forward(inputs=local_rows(b, batch))
        loss = b.calculate_loss()
        assert float(loss.num_tokens) > 0
        b.backward(loss=loss)
        assert a.clip_grad_norm(math.inf) == pytest.approx(b.clip_grad_norm(math.inf), rel=1e-6)
        for m in (a, b):
            m.step()
            m.zero_grad()
        assert_state_equal(snapshot(a.get_state_dict()), snapshot(b.get_state_dict()), atol=1e-6)

    def test_a_loss_that_applies_the_lm_head_itself_gives_the_same_update(self, twinkle_factory):
        # Loss.fuses_lm_head: a backend that hands the loss hidden states and the head's weight (instead of
        # logits) must give the logits path's loss and update; one that cannot simply keeps the logits
        batch = make_batch(5)
        fused, plain = twinkle_factory(seed=0), twinkle_factory(seed=0)
        losses = []
        for m, mode in ((fused, "fused"), (plain, "logits")):
            m.set_loss("cross_entropy", lm_head=mode)
            m.set_optimizer("SGD", lr=0.1)
            losses.append(float(m.forward_backward(inputs=local_rows(m, batch))["loss"]))
            m.clip_grad_and_step(max_grad_norm=None)
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
        assert_state_equal(snapshot(fused.get_state_dict()), snapshot(plain.get_state_dict()), atol=1e-6)

    # ------------------------------------------------------------------ clipping
    def test_clip_grad_norm_returns_true_norm_and_clips(self, twinkle_factory):
        model = twinkle_factory(seed=0)
        model.set_optimizer("SGD", lr=0.1)
        model.forward_backward(inputs=local_rows(model, make_batch(3)))
        norm = model.clip_grad_norm(max_grad_norm=math.inf)
        assert math.isfinite(norm) and norm > 0, f"clip_grad_norm returned {norm}"
        params = model.trainable_parameters()
        plain = [p.grad for p in params if p.grad is not None and type(p.grad).__name__ == "Tensor"]
        if len(plain) == len(params) and int(os.environ.get("WORLD_SIZE", "1")) == 1:  # unsharded gradients
            import torch

            direct = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in plain])))
            assert norm == pytest.approx(direct, rel=1e-5)
        clipped = model.clip_grad_norm(max_grad_norm=norm / 4)
        assert clipped == pytest.approx(norm, rel=1e-5), "clip_grad_norm must return the norm before clipping"
        assert model.clip_grad_norm(max_grad_norm=math.inf) == pytest.approx(norm / 4, rel=1e-3), \
            "clip_grad_norm did not clip to max_grad_norm"

    def test_max_grad_norm_changes_the_update(self, twinkle_factory):
        batch = make_batch(4)
        free, clipped = twinkle_factory(seed=0), twinkle_factory(seed=0)
        before = snapshot(free.get_state_dict())
        for m, limit in ((free, 1e6), (clipped, 1e-3)):
            m.set_optimizer("SGD", lr=1.0)
            m.forward_backward(inputs=local_rows(m, batch))
            m.clip_grad_and_step(max_grad_norm=limit)
        moved_free = _distance(before, snapshot(free.get_state_dict()))
        moved_clipped = _distance(before, snapshot(clipped.get_state_dict()))
        assert moved_clipped == pytest.approx(1e-3, rel=1e-2), moved_clipped
        assert moved_free > moved_clipped * 10

    # ------------------------------------------------------------------ configuration
    def test_optimizer_by_name_class_and_instance(self, twinkle_factory):
        import torch

        by_name, by_class, by_instance = (twinkle_factory(seed=0) for _ in range(3))
        by_name.set_optimizer("SGD", lr=0.05)
        by_class.set_optimizer(torch.optim.SGD, lr=0.05)
        by_instance.set_optimizer(torch.optim.SGD(by_instance.trainable_parameters(), lr=0.05))
        batch = make_batch(5)
        for m in (by_name, by_class, by_instance):
            m.forward_backward(inputs=local_rows(m, batch))
            m.clip_grad_and_step(max_grad_norm=None)
        reference = snapshot(by_name.get_state_dict())
        assert_state_equal(reference, snapshot(by_class.get_state_dict()), atol=1e-6)
        assert_state_equal(reference, snapshot(by_instance.get_state_dict()), atol=1e-6)
        assert by_name.get_train_configs()["optimizer"]["name"] == "SGD"

    @pytest.mark.parametrize("how", ["name", "class", "instance"])
    def test_scheduler_by_name_class_and_instance(self, twinkle_factory, how):
        import torch

        model = twinkle_factory(seed=0)
        if how == "instance":
            optimizer = torch.optim.SGD(model.trainable_parameters(), lr=0.1)
            model.set_optimizer(optimizer)
            model.set_lr_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
        else:
            model.set_optimizer("SGD", lr=0.1)
            if how == "name":
                model.set_lr_scheduler("linear", num_training_steps=4)
            else:
                model.set_lr_scheduler(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
        lrs = []
        for _ in range(3):
            model.forward_backward(inputs=local_rows(model, make_batch(6)))
            model.clip_grad_and_step()
            lrs.append(model.calculate_metric()["lr"])
        assert lrs[0] > lrs[1] > lrs[2], lrs

    def test_loss_by_name_class_instance_and_callable(self, twinkle_factory):
        from twinkle_core.loss.base import Loss, LossOutput

        class TokenSum(Loss):
            def __call__(self, outputs, inputs):
                logits = outputs["logits"].float()
                mask = inputs["labels"] != IGNORE_INDEX
                return LossOutput(loss=(logits.mean(-1) * mask).sum(), num_tokens=int(mask.sum()))

        values = []
        for spec in ("cross_entropy", TokenSum, TokenSum(), lambda outputs, inputs: TokenSum()(outputs, inputs)):
            model = twinkle_factory(seed=0)
            model.set_loss(spec)
            out = model.forward_backward(inputs=local_rows(model, make_batch(7)))
            values.append(float(out["loss"]))
        assert math.isfinite(values[0]) and values[0] > 0
        assert values[1] == pytest.approx(values[2], rel=1e-6) == pytest.approx(values[3], rel=1e-6)

    def test_train_configs_describe_the_run(self, twinkle_factory):
        model = twinkle_factory(seed=0)
        model.set_optimizer("AdamW", lr=3e-4)
        model.set_lr_scheduler("constant")
        cfg = model.get_train_configs()
        assert cfg["optimizer"]["name"] == "AdamW" and cfg["optimizer"]["lr"] == 3e-4
        assert cfg["lr_scheduler"]["name"] == "constant"
        assert cfg["step"] == 0 and cfg["dp_size"] >= 1

    def test_train_configs_follow_the_schema(self, twinkle_factory):
        from twinkle_core.model.train_configs import check_train_configs

        model = twinkle_factory(seed=0)
        fresh = model.get_train_configs()
        assert check_train_configs(fresh) == []
        assert fresh["optimizer"] is None and fresh["lr"] is None
        model.set_optimizer("SGD", lr=0.1)
        model.set_lr_scheduler("linear", num_training_steps=4)
        configured = model.get_train_configs()
        assert check_train_configs(configured) == []
        assert configured["lr"] == configured["optimizer"]["lr"] == 0.1
        model.forward_backward(inputs=local_rows(model, make_batch(14)))
        model.clip_grad_and_step()
        stepped = model.get_train_configs()
        assert check_train_configs(stepped) == []
        assert stepped["step"] == 1
        assert stepped["lr"] == pytest.approx(0.1 * 3 / 4, rel=1e-6), "lr must follow the scheduler"
        assert stepped["lr"] == model.calculate_metric()["lr"]

    # ------------------------------------------------------------------ task and loss seams
    def test_task_hooks_and_loss_context_are_honoured(self, twinkle_factory, twinkle_shared_dir):
        """Every forward goes through ``task.process_outputs``; a save calls ``task.on_export`` once, on the
        main process; every loss call receives the strategy's ``LossContext``."""
        from twinkle_core import distributed
        from twinkle_core.loss.base import Loss, LossContext, LossOutput
        from twinkle_core.task import Task

        class HeadTask(Task):
            name = "conformance_head"

            def __init__(self):
                super().__init__()
                self.forwards, self.exports = 0, []

            def load_dataset(self, path, tokenizer, **data_options):
                return []

            def collate(self, features):
                return {}

            def process_outputs(self, outputs, inputs):
                self.forwards += 1
                return {**outputs, "head": outputs["logits"][..., 0]}

            def on_export(self, model, directory, adapter_name):
                self.exports.append(adapter_name)
                with open(os.path.join(directory, "head.txt"), "w") as f:
                    f.write("head")

        class HeadLoss(Loss):
            def __init__(self):
                self.contexts = []

            def __call__(self, outputs, inputs, context=None):
                self.contexts.append(context)
                return LossOutput(loss=outputs["head"].float().pow(2).sum(), num_tokens=outputs["head"].numel())

        task, loss = HeadTask(), HeadLoss()
        model = twinkle_factory(seed=0, task=task)
        model.set_loss(loss)
        model.set_optimizer("SGD", lr=0.1)
        batch = local_rows(model, make_batch(15))
        assert "head" in model.forward_backward(inputs=batch)
        assert "head" in model.forward_only(inputs=batch)
        assert task.forwards >= 2
        assert loss.contexts and all(isinstance(c, LossContext) for c in loss.contexts)
        context = loss.contexts[0]
        assert context.dp_size == model.get_train_configs()["dp_size"]
        assert context.dp_rank == model.get_train_configs()["dp_rank"]
        path = model.save("task-seams", output_dir=str(twinkle_shared_dir))
        if distributed.is_main_process():
            assert task.exports == [None]
            assert os.path.exists(os.path.join(path, "head.txt"))
        else:
            assert task.exports == []

    # ------------------------------------------------------------------ accumulation
    def test_gradient_accumulation_is_exact(self, twinkle_factory):
        batch = make_batch(8, rows=8)
        whole, accumulated = twinkle_factory(seed=0), twinkle_factory(seed=0)
        whole.set_optimizer("SGD", lr=0.5)
        accumulated.set_optimizer("SGD", lr=0.5, gradient_accumulation_steps=4)
        whole.forward_backward(inputs=local_rows(whole, batch))
        norm_whole = whole.clip_grad_and_step(max_grad_norm=math.inf)
        local = local_rows(accumulated, batch)
        per = local["input_ids"].shape[0] // 4
        norms = []
        for i in range(4):
            accumulated.forward_backward(inputs=rows(local, i * per, (i + 1) * per))
            norms.append(accumulated.clip_grad_and_step(max_grad_norm=math.inf))
        assert norms[:3] == [None, None, None]
        assert norms[3] == pytest.approx(norm_whole, rel=1e-5)
        assert_state_equal(snapshot(whole.get_state_dict()), snapshot(accumulated.get_state_dict()), atol=1e-6)

    # ------------------------------------------------------------------ learning
    def test_memorises_a_batch(self, twinkle_factory):
        model = twinkle_factory(seed=0)
        model.set_optimizer("AdamW", lr=1e-2)
        batch = local_rows(model, make_batch(9, rows=4 * 1))
        losses = []
        for _ in range(30):
            out = model.forward_backward(inputs=batch)
            model.clip_grad_and_step(max_grad_norm=1.0)
            losses.append(float(out["loss"]))
        assert losses[-1] <= losses[0] / 2, losses

    def test_metrics_aggregate_micro_batches(self, twinkle_factory):
        model = twinkle_factory(seed=0)
        model.add_metric("accuracy")
        model.set_optimizer("SGD", lr=0.0)
        batch = local_rows(model, make_batch(10))
        half = batch["input_ids"].shape[0] // 2
        losses, tokens = [], []
        for part in (rows(batch, 0, half), rows(batch, half, 2 * half)):
            out = model.forward_backward(inputs=part)
            losses.append(float(out["loss"]) * float(out["num_tokens"]))
            tokens.append(float(out["num_tokens"]))
        metrics = model.calculate_metric()
        assert 0.0 <= metrics["accuracy"] <= 1.0
        if model.get_train_configs()["dp_size"] == 1:
            assert metrics["loss"] == pytest.approx(sum(losses) / sum(tokens), rel=1e-5)
        assert model.calculate_metric()["tokens"] == 0  # reset after reading

    # ------------------------------------------------------------------ state
    def test_save_load_round_trip(self, twinkle_factory, twinkle_shared_dir):
        import torch

        model = twinkle_factory(seed=0)
        model.set_optimizer("AdamW", lr=1e-2)
        batch = local_rows(model, make_batch(11))
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
        path = model.save("round-trip", output_dir=str(twinkle_shared_dir))
        assert os.path.isdir(path)
        fresh = twinkle_factory(seed=123)
        assert not torch.equal(fresh.forward_only(inputs=batch)["logits"], model.forward_only(inputs=batch)["logits"])
        fresh.load(path)
        torch.testing.assert_close(fresh.forward_only(inputs=batch)["logits"],
                                   model.forward_only(inputs=batch)["logits"], atol=0, rtol=0)

    def test_resume_continues_exactly(self, twinkle_factory, twinkle_shared_dir):
        batches = [make_batch(20 + i) for i in range(4)]

        def run(model, steps):
            out = []
            for b in steps:
                res = model.forward_backward(inputs=local_rows(model, b))
                model.clip_grad_and_step(max_grad_norm=1.0)
                out.append(float(res["loss"]))
            return out

        straight = twinkle_factory(seed=0)
        straight.set_optimizer("AdamW", lr=1e-2)
        straight.set_lr_scheduler("cosine", num_training_steps=4, num_warmup_steps=1)
        expected = run(straight, batches)

        first = twinkle_factory(seed=0)
        first.set_optimizer("AdamW", lr=1e-2)
        first.set_lr_scheduler("cosine", num_training_steps=4, num_warmup_steps=1)
        run(first, batches[:2])
        path = first.save("resume", output_dir=str(twinkle_shared_dir), extra_state={"position": 2})

        resumed = twinkle_factory(seed=7)
        resumed.set_optimizer("AdamW", lr=1e-2)
        resumed.set_lr_scheduler("cosine", num_training_steps=4, num_warmup_steps=1)
        extra = resumed.resume_from_checkpoint(path)
        assert extra == {"position": 2}
        assert resumed.get_train_configs()["step"] == 2
        assert run(resumed, batches[2:]) == expected[2:], "resumed losses must equal the uninterrupted run's bit for bit"

    # ------------------------------------------------------------------ adapters
    def test_adapters_are_isolated(self, twinkle_factory):
        import torch

        model = twinkle_factory(seed=0)
        model.add_adapter_to_model("a", copy.deepcopy(LORA_CONFIG))
        model.add_adapter_to_model("b", copy.deepcopy(LORA_CONFIG))
        model.set_optimizer("AdamW", lr=1e-2, adapter_name="a")
        model.set_optimizer("AdamW", lr=1e-2, adapter_name="b")
        batch = local_rows(model, make_batch(12))
        logits_b = model.forward_only(inputs=batch, adapter_name="b")["logits"].clone()
        weights_b = snapshot(model.get_state_dict(adapter_name="b"))
        weights_a = snapshot(model.get_state_dict(adapter_name="a"))
        for _ in range(3):
            model.forward_backward(inputs=batch, adapter_name="a")
            model.clip_grad_and_step(adapter_name="a")
        assert_state_equal(weights_b, snapshot(model.get_state_dict(adapter_name="b")))
        torch.testing.assert_close(model.forward_only(inputs=batch, adapter_name="b")["logits"], logits_b,
                                   atol=0, rtol=0)
        changed = snapshot(model.get_state_dict(adapter_name="a"))
        assert any(not torch.equal(changed[k], weights_a[k]) for k in changed)
        assert model.get_train_configs(adapter_name="a")["step"] == 3
        assert model.get_train_configs(adapter_name="b")["step"] == 0

    def test_adapter_save_load_round_trip(self, twinkle_factory, twinkle_shared_dir):
        import torch

        model = twinkle_factory(seed=0)
        model.add_adapter_to_model("tenant", copy.deepcopy(LORA_CONFIG))
        model.set_optimizer("AdamW", lr=1e-2, adapter_name="tenant")
        batch = local_rows(model, make_batch(13))
        for _ in range(2):
            model.forward_backward(inputs=batch, adapter_name="tenant")
            model.clip_grad_and_step(adapter_name="tenant")
        path = model.save("adapter", output_dir=str(twinkle_shared_dir), adapter_name="tenant")
        other = twinkle_factory(seed=0)
        other.add_adapter_to_model("tenant", copy.deepcopy(LORA_CONFIG))
        other.load(path, adapter_name="tenant")
        torch.testing.assert_close(other.forward_only(inputs=batch, adapter_name="tenant")["logits"],
                                   model.forward_only(inputs=batch, adapter_name="tenant")["logits"],
                                   atol=1e-6, rtol=1e-6)

    def test_forward_only_with_adapters_disabled_is_the_base_model(self, twinkle_factory):
        """DPO's reference with LoRA: ``disable_adapters=True`` is the base model, and only for that call."""
        import torch

        from twinkle_core.testing.tolerance import max_abs_diff

        failing = _FailingTask()
        base_model = twinkle_factory(seed=0, task=failing)
        model = twinkle_factory(seed=0, task=failing)
        model.add_adapter_to_model("policy", {**LORA_CONFIG, "init_lora_weights": False})
        model.add_adapter_to_model("other", {**LORA_CONFIG, "init_lora_weights": False})  # adapter_name picks
        batch = local_rows(model, make_batch(16))
        base = base_model.forward_only(inputs=batch)["logits"].float()
        plain = base_model.forward_only(inputs=batch, disable_adapters=True)["logits"].float()
        torch.testing.assert_close(plain, base, atol=0, rtol=0, msg="without adapters the flag changes nothing")
        tolerance = forward_tolerance_of(base)
        adapted = model.forward_only(inputs=batch, adapter_name="policy")["logits"].float()
        assert max_abs_diff(adapted, base) > 100 * tolerance, "the adapter (B != 0) must change the logits"
        disabled = model.forward_only(inputs=batch, adapter_name="policy", disable_adapters=True)["logits"]
        assert not disabled.requires_grad
        assert max_abs_diff(disabled.float(), base) <= tolerance, (
            f"disabled adapters must give the base model's logits: {max_abs_diff(disabled.float(), base):.3g} > "
            f"{tolerance:.3g}")
        assert all(p.grad is None for p in model.trainable_parameters(adapter_name="policy")), "no gradients"
        again = model.forward_only(inputs=batch, adapter_name="policy")["logits"].float()
        torch.testing.assert_close(again, adapted, atol=0, rtol=0, msg="the adapter must be active again")
        failing.fail = True
        with pytest.raises(RuntimeError, match="conformance: failing forward"):
            model.forward_only(inputs=batch, adapter_name="policy", disable_adapters=True)
        failing.fail = False
        torch.testing.assert_close(model.forward_only(inputs=batch, adapter_name="policy")["logits"].float(), adapted,
                                   atol=0, rtol=0, msg="the adapter must be active again after a failed forward")
        assert all(p.requires_grad for p in model.trainable_parameters(adapter_name="policy")), \
            "the adapter must stay trainable"
        model.set_optimizer("SGD", lr=0.1, adapter_name="policy")
        out = model.forward_backward(inputs=batch, adapter_name="policy")
        assert math.isfinite(float(out["loss"]))
        assert model.clip_grad_and_step(adapter_name="policy") > 0, "the adapter must still train"

    def test_frozen_copy_matches_and_refuses_to_train(self, twinkle_factory, twinkle_shared_dir):
        """A full-model reference: the policy's current weights, placed like it, that never trains."""
        import torch

        from twinkle_core.errors import ConfigError
        from twinkle_core.testing.tolerance import max_abs_diff

        policy = twinkle_factory(seed=0)
        policy.set_optimizer("AdamW", lr=1e-2)
        batch = local_rows(policy, make_batch(17))
        policy.forward_backward(inputs=batch)
        policy.clip_grad_and_step()  # the copy must hold the current weights, not the initial ones
        reference = policy.frozen_copy()
        assert type(reference) is type(policy)
        want = policy.forward_only(inputs=batch)["logits"].float()
        got = reference.forward_only(inputs=batch)["logits"]
        assert not got.requires_grad
        assert max_abs_diff(got.float(), want) <= forward_tolerance_of(want)
        assert_state_equal(snapshot(reference.get_state_dict()), snapshot(policy.get_state_dict()))
        assert reference.trainable_parameters() == [], "a frozen copy has no parameter that requires a gradient"
        configs, policy_configs = reference.get_train_configs(), policy.get_train_configs()
        for key in ("strategy", "precision", "dp_size", "dp_rank"):
            assert configs[key] == policy_configs[key], key
        assert configs["optimizer"] is None and configs["trainable_parameters"] == 0
        for refused in (lambda: reference.forward_backward(inputs=batch),
                        lambda: reference.set_optimizer("SGD", lr=0.1),
                        reference.step,
                        lambda: reference.save("frozen", output_dir=str(twinkle_shared_dir))):
            with pytest.raises(ConfigError, match="a frozen copy does not train"):
                refused()
        policy.forward_backward(inputs=batch)
        policy.clip_grad_and_step()
        torch.testing.assert_close(reference.forward_only(inputs=batch)["logits"], got, atol=0, rtol=0,
                                   msg="the copy must not follow the policy's training")
        with_adapter = twinkle_factory(seed=0)
        with_adapter.add_adapter_to_model("policy", copy.deepcopy(LORA_CONFIG))
        with pytest.raises(ConfigError, match="disable_adapters=True"):
            with_adapter.frozen_copy()

    def test_unknown_adapter_is_a_clear_error(self, twinkle_factory):
        model = twinkle_factory(seed=0)
        with pytest.raises(Exception, match="no adapter named 'missing'"):
            model.forward(inputs=make_batch(0), adapter_name="missing")


def _FailingTask() -> Any:
    """A task whose ``process_outputs`` raises while ``fail`` is set (after the network ran on every rank)."""
    from twinkle_core.task import Task

    class FailingTask(Task):
        name = "conformance_failing"
        fail = False

        def load_dataset(self, path, tokenizer, **data_options):
            return []

        def collate(self, features):
            return {}

        def process_outputs(self, outputs, inputs):
            if self.fail:
                raise RuntimeError("conformance: failing forward")
            return outputs

    return FailingTask()


def _distance(a: dict[str, Any], b: dict[str, Any]) -> float:
    import torch

    return float(torch.sqrt(sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a)))


class TestModelContract(ModelContract):
    """Collected when the suite runs with ``--pyargs twinkle_core.testing.conformance``."""


class TestTaskContract(TaskContract):
    """Collected when the suite runs with ``--pyargs twinkle_core.testing.conformance``."""


class TestLoraTargetContract(LoraTargetContract):
    """Collected when the suite runs with ``--pyargs twinkle_core.testing.conformance``."""
