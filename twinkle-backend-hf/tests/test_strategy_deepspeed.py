"""DeepSpeed ZeRO 1/2/3 on 2 CPU ranks (gloo, ``DS_ACCELERATOR=cpu``): conformance, loss parity, engine behaviour.

The multi-process tests launch torchrun through ``distributed.run_torchrun`` with a hard timeout and
are skipped when DeepSpeed is not installed. The engine scenarios run this file itself as the torchrun
script (``python test_strategy_deepspeed.py scenario STAGE OUT_DIR``). Nothing is JIT-compiled: the
strategy uses torch optimizers and skips DeepSpeed's CPU inference all-reduce op.

The configuration and ``OptimizerGroup`` tests at the top need neither DeepSpeed nor several processes.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from parity_helpers import ParityRuns

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed: "
                                     "pip install 'twinkle-backend-hf[deepspeed]' (deepspeed, ninja)")


#: ZeRO-3 keeps parameters below ``stage3_param_persistence_threshold`` (1e5 elements by default)
#: unpartitioned; every weight of the tiny test model is below it, so tests that must see real
#: parameter partitioning set it to 0 (the hf-zero3 conformance target does too).
PARTITION_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def _strategy_options(stage: int) -> dict[str, Any]:
    return {"stage": stage, **({"config": PARTITION_ALL} if stage == 3 else {})}


def _job_env() -> dict[str, str]:
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
    return env


# ====================================================================== no DeepSpeed needed
def test_generated_config_leaves_optimizer_clipping_and_schedule_to_twinkle():
    from twinkle_backend_hf.strategies.deepspeed_config import build_config

    config = build_config(stage=3, offload_optimizer=True, offload_param=True, gradient_accumulation_steps=4,
                          bf16=False, user_config={"zero_optimization": {"stage3_max_live_parameters": 10},
                                                   "wall_clock_breakdown": True})
    assert config["gradient_clipping"] == 0.0
    assert "optimizer" not in config and "scheduler" not in config
    assert config["zero_allow_untested_optimizer"] is True
    assert config["gradient_accumulation_steps"] == 4
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert zero["stage3_max_live_parameters"] == 10, "a user config is merged key by key"
    assert config["wall_clock_breakdown"] is True
    assert config["bf16"] == {"enabled": False} and config["fp16"] == {"enabled": False}


@pytest.mark.parametrize(("user_config", "match"), [
    ({"gradient_clipping": 1.0}, "gradient_clipping must be 0"),
    ({"optimizer": {"type": "AdamW"}}, "set_optimizer"),
    ({"scheduler": {"type": "WarmupLR"}}, "set_lr_scheduler"),
    ({"fp16": {"enabled": True}}, "fp16 is not supported"),
    ({"zero_optimization": {"stage": 1}}, "contradicts strategy_options.stage=2"),
])
def test_contradicting_user_config_is_a_clear_error(user_config, match):
    from twinkle_backend_hf.strategies.deepspeed_config import build_config

    from twinkle_core.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        build_config(stage=2, offload_optimizer=False, offload_param=False, gradient_accumulation_steps=1,
                     bf16=False, user_config=user_config)


@pytest.mark.parametrize(("options", "match"), [
    ({"stage": 4}, "must be 1, 2 or 3"),
    ({"stage": 2, "offload_param": True}, "needs ZeRO stage 3"),
    ({"stage": 2, "zero_stage": 3}, "unknown option"),
    ({"config": "ds.json"}, "must be a dict"),
])
def test_strategy_options_are_validated(options, match):
    from twinkle_backend_hf.strategies.deepspeed import DeepSpeedStrategy

    from twinkle_core.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        DeepSpeedStrategy(**options)


def test_strategy_is_registered():
    from twinkle_backend_hf.strategies.deepspeed import DeepSpeedStrategy

    from twinkle_core.plugins import get_plugins

    assert get_plugins().load("strategy", "deepspeed") is DeepSpeedStrategy
    assert DeepSpeedStrategy.averages_gradients, "ZeRO averages over data-parallel ranks"


def test_optimizer_group_steps_only_the_active_member():
    """Several adapters' optimizers on one engine: a step moves only the optimizer being stepped."""
    from twinkle_backend_hf.strategies.deepspeed_optimizer_group import OptimizerGroup

    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt_a, opt_b = torch.optim.AdamW([a], lr=0.1), torch.optim.AdamW([b], lr=0.1)
    group = OptimizerGroup([opt_a, opt_b])
    assert group.param_groups[0] is opt_a.param_groups[0] and group.param_groups[1] is opt_b.param_groups[0]
    a.grad, b.grad = torch.ones(4), torch.ones(4)
    group.active = opt_a
    group.step()
    assert not torch.equal(a.detach(), torch.ones(4)) and torch.equal(b.detach(), torch.ones(4))
    assert a in group.state and b not in group.state and group.state[a] is opt_a.state[a]
    # DeepSpeed steps one group at a time by narrowing param_groups: only that group moves
    before = a.detach().clone()
    group.active = None
    group.param_groups = [opt_b.param_groups[0]]
    group.step()
    group.refresh_groups()
    assert torch.equal(a.detach(), before) and not torch.equal(b.detach(), torch.ones(4))
    # a member's scheduler changes the lr DeepSpeed sees
    opt_a.param_groups[0]["lr"] = 0.5
    assert group.param_groups[0]["lr"] == 0.5
    # state round trip, member by member
    state = copy.deepcopy(group.state_dict())
    a2, b2 = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    fresh = OptimizerGroup([torch.optim.AdamW([a2], lr=0.1), torch.optim.AdamW([b2], lr=0.1)])
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["lr"] == 0.5
    assert fresh.param_groups[0] is fresh.optimizers[0].param_groups[0], "groups re-linked after loading"
    torch.testing.assert_close(fresh.state[a2]["exp_avg"], opt_a.state[a]["exp_avg"])


# ====================================================================== 2 ranks
@pytest.mark.distributed
@needs_deepspeed
@pytest.mark.timeout(720)
@pytest.mark.parametrize("target", ["hf-zero2", "hf-zero3"])
def test_conformance_suite_on_two_ranks(target, tmp_path):
    """The core's suite, unchanged, every rank running every test (resume, adapters, clipping ...)."""
    from distributed import PASSED_ONLY, pytest_summaries, run_torchrun

    result = run_torchrun(["-m", "pytest", "--pyargs", "twinkle_core.testing.conformance", "--twinkle-backend",
                           target, "-p", "no:cacheprovider", "-q"], nproc=2, timeout=660, cwd=str(tmp_path),
                          env=_job_env(), per_rank_output=True)
    assert result.returncode == 0, result.output
    summaries = pytest_summaries(result)
    assert all(PASSED_ONLY.fullmatch(line) for line in summaries), \
        f"expected every test to pass on each rank, got {summaries}\n{result.output}"
    print(f"{target}: {summaries[0]} on each rank in {result.seconds:.0f} s")


class DeepSpeedRuns(ParityRuns):
    """The ZeRO parity runs."""

    def deepspeed(self, **options: Any) -> dict[str, Any]:
        key = "deepspeed-" + "-".join(f"{k}={v}" for k, v in sorted(options.items()))
        return self.get(key, "--strategy", "deepspeed", "--strategy-options", json.dumps(options))


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> DeepSpeedRuns:
    return DeepSpeedRuns(tmp_path_factory.mktemp("deepspeed-parity"), env=_job_env())


@pytest.mark.parity
@pytest.mark.distributed
@needs_deepspeed
@pytest.mark.timeout(660)
@pytest.mark.parametrize("stage", [2, 3])
def test_loss_parity_with_one_process(parity, stage):
    """10 AdamW steps, fp32, accumulation 2, clipping: ZeRO on 2 ranks gives the single process's losses
    (ZeRO-3 with every parameter partitioned)."""
    reference = parity.single()
    assert reference["world_size"] == 1 and reference["strategy"] == "single"
    assert reference["losses"][-1] < reference["losses"][0] - 0.5, f"the model did not learn: {reference['losses']}"
    assert max(reference["grad_norms"]) > 1.0, "no step was clipped: the parity run would not cover clipping"
    run = parity.deepspeed(**_strategy_options(stage))
    assert run["world_size"] == 2 and run["dp_size"] == 2, run
    assert run["strategy_class"].endswith(":DeepSpeedStrategy") and run["wrapped_class"] == "DeepSpeedModule"
    delta = parity.assert_matches_single(run, f"zero{stage}")
    print(f"zero{stage}: max |loss - single| = {delta:.3g} ({run['seconds']:.0f} s)")


@pytest.mark.distributed
@pytest.mark.slow
@needs_deepspeed
@pytest.mark.timeout(660)
@pytest.mark.parametrize("options", [{"stage": 1}, {"stage": 2, "offload_optimizer": True},
                                     {"stage": 3, "offload_optimizer": True, "offload_param": True,
                                      "config": PARTITION_ALL}],
                         ids=["zero1", "zero2-offload", "zero3-offload"])
@pytest.mark.parity
def test_loss_parity_of_other_configurations(parity, options):
    delta = parity.assert_matches_single(parity.deepspeed(**options), json.dumps(options))
    print(f"{options}: max |loss - single| = {delta:.3g}")


@pytest.mark.distributed
@needs_deepspeed
@pytest.mark.timeout(420)
@pytest.mark.parametrize("stage", [2, 3])
def test_engine_scenarios_on_two_ranks(stage, tmp_path):
    """Sharding, exported checkpoints, accumulation edge cases, per-adapter resume and bf16 (see _scenarios)."""
    from distributed import run_torchrun

    out = tmp_path / "facts.json"
    result = run_torchrun([__file__, "scenario", str(stage), str(tmp_path)], nproc=2, timeout=360, env=_job_env())
    assert result.returncode == 0, result.output
    facts = json.loads(out.read_text())
    assert facts["optimizer_files"] == 2, f"each rank writes its optimizer partition: {facts}"
    assert facts["local_numel"] * 2 == pytest.approx(facts["global_numel"], rel=0.05), \
        f"each rank should own about half of the {'weights' if stage == 3 else 'fp32 master weights'}: {facts}"
    print(f"zero{stage} scenarios in {result.seconds:.0f} s: {facts}")


# ====================================================================== the torchrun side
def _scenarios(stage: int, out_dir: str) -> None:
    """Run on every rank; rank 0 writes ``OUT_DIR/facts.json``. Each check asserts with a message."""
    import transformers
    from twinkle_backend_hf.testing import make_tiny_model

    from twinkle_core import distributed
    from twinkle_core.testing.conformance import (
        LORA_CONFIG,
        assert_state_equal,
        local_rows,
        make_batch,
        rows,
        snapshot,
    )

    options = {"strategy": "deepspeed", "strategy_options": _strategy_options(stage)}
    facts: dict[str, Any] = {"stage": stage}

    def step(model: Any, seed: int, adapter: str | None = None) -> float:
        out = model.forward_backward(inputs=local_rows(model, make_batch(seed)), adapter_name=adapter)
        model.clip_grad_and_step(adapter_name=adapter)
        return float(out["loss"])

    # --- the engine really shards, and what is saved loads with plain transformers
    model = make_tiny_model(seed=0, **options)
    model.set_optimizer("AdamW", lr=1e-2)
    step(model, 0)
    engine = model.wrapped.engine
    assert engine is not None and engine.zero_optimization_stage() == stage, "no ZeRO engine of that stage"
    params = model.trainable_parameters()
    if stage == 3:
        assert all(p.numel() == 0 for p in params), "ZeRO-3 parameters should be partitioned outside the forward"
        facts["local_numel"] = sum(p.ds_tensor.numel() for p in params)
        facts["global_numel"] = sum(p.ds_numel for p in params)
    else:
        facts["local_numel"] = sum(t.numel() for t in engine.optimizer.single_partition_of_fp32_groups)
        facts["global_numel"] = sum(p.numel() for p in params)
    path = model.save("full", output_dir=out_dir)
    state_dir = Path(path) / "twinkle_state" / "deepspeed" / "twinkle"
    facts["optimizer_files"] = len(list(state_dir.glob("*optim_states.pt")))
    batch = make_batch(7)
    logits = model.forward_only(inputs=batch)["logits"]
    exported = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = exported(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(plain, logits, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"the exported checkpoint is not the trained model: {m}")

    # --- two boundary backwards before one step (accumulation without gradient_accumulation_steps)
    whole, twice = make_tiny_model(seed=0, **options), make_tiny_model(seed=0, **options)
    for m in (whole, twice):
        m.set_optimizer("SGD", lr=0.5)
    b = make_batch(3)
    whole.forward_backward(inputs=local_rows(whole, b))
    norm_whole = whole.clip_grad_and_step(max_grad_norm=math.inf)
    local = local_rows(twice, b)
    half = local["input_ids"].shape[0] // 2
    twice.forward_backward(inputs=rows(local, 0, half))
    twice.forward_backward(inputs=rows(local, half, 2 * half))
    norm_twice = twice.clip_grad_and_step(max_grad_norm=math.inf)
    assert abs(norm_twice - norm_whole) <= 1e-5 * norm_whole, (norm_whole, norm_twice)
    assert_state_equal(snapshot(whole.get_state_dict()), snapshot(twice.get_state_dict()), atol=1e-6)

    # --- zero_grad without step discards the reduced gradients; nothing moves
    dropped, clean = make_tiny_model(seed=0, **options), make_tiny_model(seed=0, **options)
    for m in (dropped, clean):
        m.set_optimizer("AdamW", lr=1e-2)
    dropped.forward_backward(inputs=local_rows(dropped, make_batch(5)))
    dropped.zero_grad()
    for m in (dropped, clean):
        step(m, 6)
    assert_state_equal(snapshot(clean.get_state_dict()), snapshot(dropped.get_state_dict()), atol=1e-6)

    # --- zero_grad in the middle of an accumulation window drops the micro-steps taken so far
    mid, fresh = make_tiny_model(seed=0, **options), make_tiny_model(seed=0, **options)
    for m in (mid, fresh):
        m.set_optimizer("SGD", lr=0.5, gradient_accumulation_steps=2)
    mid.forward_backward(inputs=local_rows(mid, make_batch(5)))
    mid.zero_grad()
    for m in (mid, fresh):
        for seed in (1, 2):
            m.forward_backward(inputs=local_rows(m, make_batch(seed)))
            m.clip_grad_and_step(max_grad_norm=math.inf)
    assert_state_equal(snapshot(fresh.get_state_dict()), snapshot(mid.get_state_dict()), atol=1e-6)

    # --- two adapters, one engine: resuming one restores only that one
    def tenants() -> Any:
        m = make_tiny_model(seed=0, **options)
        for name in ("a", "b"):
            m.add_adapter_to_model(name, copy.deepcopy(LORA_CONFIG))
        for name in ("a", "b"):
            m.set_optimizer("AdamW", lr=1e-2, adapter_name=name)
        return m

    straight, resumed, stopped = tenants(), tenants(), tenants()
    for m in (straight, resumed, stopped):
        step(m, 11, "a")
        step(m, 12, "b")
    checkpoint = resumed.save("tenant-a", output_dir=out_dir, adapter_name="a")
    saved_a = snapshot(resumed.get_state_dict(adapter_name="a"))
    for m in (straight, resumed):
        step(m, 13, "a")
        step(m, 14, "b")
    b_now = snapshot(resumed.get_state_dict(adapter_name="b"))
    resumed.resume_from_checkpoint(checkpoint, adapter_name="a")
    assert_state_equal(saved_a, snapshot(resumed.get_state_dict(adapter_name="a")))
    assert_state_equal(b_now, snapshot(resumed.get_state_dict(adapter_name="b")))  # b's weights kept
    for m in (straight, resumed):
        step(m, 15, "b")
    assert_state_equal(snapshot(straight.get_state_dict(adapter_name="b")),  # b's optimizer state kept
                       snapshot(resumed.get_state_dict(adapter_name="b")))
    for m in (stopped, resumed):
        step(m, 16, "a")
    assert_state_equal(snapshot(stopped.get_state_dict(adapter_name="a")),  # a continues from its checkpoint
                       snapshot(resumed.get_state_dict(adapter_name="a")), atol=1e-6)
    assert resumed.get_train_configs(adapter_name="a")["step"] == 2
    assert resumed.get_train_configs(adapter_name="b")["step"] == 3
    # one set of partitioned gradients: interleaving two adapters' backwards is refused, not mixed
    from twinkle_core.errors import ConfigError

    mixed = tenants()
    mixed.forward_backward(inputs=local_rows(mixed, make_batch(17)), adapter_name="a")
    with pytest.raises(ConfigError, match="finish one adapter's optimizer step"):
        mixed.forward_backward(inputs=local_rows(mixed, make_batch(18)), adapter_name="b")
    mixed.clip_grad_and_step(adapter_name="b")  # b has no gradients: a no-op that keeps a's
    assert mixed.get_train_configs(adapter_name="b")["step"] == 1
    before_b = snapshot(mixed.get_state_dict(adapter_name="b"))
    step(mixed, 19, "a")  # a's first micro-batch plus this one
    assert_state_equal(before_b, snapshot(mixed.get_state_dict(adapter_name="b")))

    # --- bf16: DeepSpeed's bf16 mode (bf16 weights, fp32 master weights), exported in fp32
    facts["bf16"] = None
    from twinkle_core.accelerator import current_accelerator

    if current_accelerator().supports_bf16():
        half_model = make_tiny_model(seed=0, precision="bf16", **options)
        half_model.set_optimizer("AdamW", lr=1e-2)
        losses = [step(half_model, 9) for _ in range(6)]
        described = half_model.get_train_configs()["strategy"]
        assert described["bf16"] is True, described
        weight = next(iter(half_model.module.parameters()))
        assert (weight.ds_tensor if stage == 3 else weight).dtype == torch.bfloat16
        assert losses[-1] < losses[0] and all(math.isfinite(x) for x in losses), losses
        state = half_model.get_state_dict()
        assert all(v.dtype == torch.float32 for v in state.values()), \
            "the (all trainable) weights are exported from the fp32 master copies"
        facts["bf16"] = losses
        # resuming a bf16 run: the fresh model's engine is created by the resume, in bf16, and continues
        straight_half = make_tiny_model(seed=0, precision="bf16", **options)
        first_half = make_tiny_model(seed=0, precision="bf16", **options)
        for m in (straight_half, first_half):
            m.set_optimizer("AdamW", lr=1e-2)
        expected = [step(straight_half, 20 + i) for i in range(4)]
        for i in range(2):
            step(first_half, 20 + i)
        saved = first_half.save("bf16", output_dir=out_dir)
        resumed_half = make_tiny_model(seed=5, precision="bf16", **options)
        resumed_half.set_optimizer("AdamW", lr=1e-2)
        resumed_half.resume_from_checkpoint(saved)
        assert resumed_half.get_train_configs()["strategy"]["bf16"] is True
        again = [step(resumed_half, 22 + i) for i in range(2)]
        assert again == pytest.approx(expected[2:], rel=1e-6, abs=1e-7), (expected, again)

    distributed.barrier()
    if distributed.is_main_process():
        (Path(out_dir) / "facts.json").write_text(json.dumps(facts, indent=2))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "scenario":
        _scenarios(int(sys.argv[2]), sys.argv[3])
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    else:
        sys.exit(f"usage: torchrun --nproc-per-node 2 {sys.argv[0]} scenario STAGE OUT_DIR")
