"""Precision has one owner, the strategy: every HF strategy applies the model's precision through the Strategy hooks,
DeepSpeed's engine owns its mixed precision, and FSDP2's mixed-precision policy derives from the precision.

One process, no process group: the strategies are only constructed.
"""

from __future__ import annotations

import pytest
import torch

from twinkle_core.errors import ConfigError
from twinkle_core.precision import BF16Precision, FP8Precision, FP16Precision, FullPrecision


def _strategies():
    from twinkle_backend_hf.sequence_parallel.strategy import SequenceParallelStrategy
    from twinkle_backend_hf.strategies.accelerate import AccelerateStrategy
    from twinkle_backend_hf.strategies.ddp import DDPStrategy
    from twinkle_backend_hf.strategies.fsdp import NativeFSDPStrategy

    return [DDPStrategy, NativeFSDPStrategy, AccelerateStrategy, SequenceParallelStrategy]


# ---------------------------------------------------------------------- the strategy applies the precision
@pytest.mark.parametrize("strategy_cls", _strategies(), ids=lambda cls: cls.name)
def test_torch_strategies_apply_the_precision_through_the_base_hooks(strategy_cls):
    """Autocast, loss scaling, unscaling and the scaler's step: the Strategy base's, applying the precision."""
    from twinkle_core.strategy import Strategy

    for hook in ("forward_context", "scale_loss", "unscale_gradients", "optimizer_step"):
        assert getattr(strategy_cls, hook) is getattr(Strategy, hook), f"{strategy_cls.name} overrides {hook}"
    strategy = strategy_cls(precision=FP16Precision(init_scale=8.0))
    assert float(strategy.scale_loss(torch.tensor(2.0))) == 16.0, "fp16's loss scaler reaches the loss"


def test_deepspeed_engine_owns_mixed_precision():
    from twinkle_backend_hf.strategies.deepspeed import DeepSpeedStrategy
    from twinkle_backend_hf.strategies.deepspeed_config import engine_bf16

    strategy = DeepSpeedStrategy(precision=BF16Precision())
    loss = torch.tensor(3.0)
    assert strategy.scale_loss(loss) is loss, "the engine scales nothing: the loss is back-propagated as it is"
    assert engine_bf16(BF16Precision(), {}) is True
    assert engine_bf16(FP8Precision(), {}) is True, "fp8 autocasts to bf16"
    assert engine_bf16(FullPrecision(), {}) is False
    assert engine_bf16(BF16Precision(), {"bf16": {"enabled": False}}) is False, "a user bf16 section has the last word"
    with pytest.raises(ConfigError, match="precision 'fp16' is not supported with strategy 'deepspeed'"):
        engine_bf16(FP16Precision(), {})


def test_deepspeed_refuses_fp16_before_joining_a_process_group():
    from twinkle_backend_hf.strategies.deepspeed import DeepSpeedStrategy

    from twinkle_core.accelerator import CPUAccelerator

    joined = torch.distributed.is_initialized()
    with pytest.raises(ConfigError, match="fp16"):
        DeepSpeedStrategy(precision=FP16Precision()).setup(CPUAccelerator())
    assert torch.distributed.is_initialized() == joined


# ---------------------------------------------------------------------- FSDP2's policy from the precision
@pytest.mark.parametrize("precision", [FullPrecision(), BF16Precision(), FP16Precision(), FP8Precision()],
                         ids=lambda p: p.name)
def test_fsdp_default_policy_is_todays_for_every_precision(precision):
    """Autocast (the strategy's forward_context) computes in the precision's dtype; FSDP2 gathers the stored fp32
    weights and reduces fp32 gradients, as native_fsdp always has."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from twinkle_backend_hf.strategies.fsdp import NativeFSDPStrategy

    assert NativeFSDPStrategy(precision=precision).mixed_precision_policy() == MixedPrecisionPolicy()
    assert NativeFSDPStrategy(precision=precision, mixed_precision="no").mixed_precision_policy() == \
        MixedPrecisionPolicy()


@pytest.mark.parametrize(("precision", "option", "param_dtype"), [
    (BF16Precision(), "bf16", torch.bfloat16),
    (BF16Precision(), "bfloat16", torch.bfloat16),
    (FP8Precision(), "bf16", torch.bfloat16),
    (FP16Precision(), "fp16", torch.float16),
])
def test_fsdp_mixed_precision_option_that_matches_the_precision_overrides_the_policy(precision, option, param_dtype):
    from twinkle_backend_hf.strategies.fsdp import NativeFSDPStrategy

    policy = NativeFSDPStrategy(precision=precision, mixed_precision=option).mixed_precision_policy()
    assert policy.param_dtype == param_dtype and policy.reduce_dtype == torch.float32


def test_fsdp_policy_object_is_used_as_given_when_it_matches():
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from twinkle_backend_hf.strategies.fsdp import NativeFSDPStrategy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert NativeFSDPStrategy(precision=BF16Precision(), mixed_precision=policy).mixed_precision_policy() is policy
    fp32 = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    assert NativeFSDPStrategy(precision=FullPrecision(), mixed_precision=fp32).mixed_precision_policy() is fp32


def _contradictions():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return [
        (FullPrecision(), "bf16", r"mixed_precision='bf16'.*contradicts precision='no'"),
        (FullPrecision(), "fp16", r"mixed_precision='fp16'.*contradicts precision='no'"),
        (BF16Precision(), "fp16", r"mixed_precision='fp16'.*contradicts precision='bf16'"),
        (FP16Precision(), "bf16", r"mixed_precision='bf16'.*contradicts precision='fp16'"),
        (BF16Precision(), MixedPrecisionPolicy(param_dtype=torch.float16),
         r"mixed_precision=MixedPrecisionPolicy.*contradicts precision='bf16'"),
        (FullPrecision(), MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
         r"mixed_precision=MixedPrecisionPolicy.*contradicts precision='no'"),
    ]


@pytest.mark.parametrize(("precision", "option", "match"), _contradictions())
def test_fsdp_mixed_precision_that_contradicts_the_precision_is_refused_at_construction(precision, option, match):
    from twinkle_backend_hf.strategies.accelerate import AccelerateStrategy
    from twinkle_backend_hf.strategies.fsdp import NativeFSDPStrategy

    for strategy_cls in (NativeFSDPStrategy, AccelerateStrategy):
        with pytest.raises(ConfigError, match=match):
            strategy_cls(precision=precision, mixed_precision=option)


def test_fsdp_contradiction_is_refused_when_the_model_binds_its_precision():
    from twinkle_backend_hf.strategies.fsdp import NativeFSDPStrategy

    strategy = NativeFSDPStrategy(mixed_precision="bf16")  # no precision yet: nothing to contradict
    with pytest.raises(ConfigError, match=r"mixed_precision='bf16'.*contradicts precision='no'"):
        strategy.bind_precision(FullPrecision())
    NativeFSDPStrategy(mixed_precision="bf16").bind_precision(BF16Precision())


def test_fsdp_unknown_mixed_precision_is_refused_at_construction():
    from twinkle_backend_hf.strategies.fsdp import NativeFSDPStrategy

    with pytest.raises(ConfigError, match="mixed_precision must be 'bf16', 'fp16', 'no' or a MixedPrecisionPolicy"):
        NativeFSDPStrategy(mixed_precision="int8")


def test_model_refuses_a_contradicting_fsdp_policy_before_building():
    from twinkle_backend_hf.testing import make_tiny_model

    with pytest.raises(ConfigError, match=r"strategy_options.mixed_precision='bf16'.*precision='no'"):
        make_tiny_model(strategy="native_fsdp", strategy_options={"mixed_precision": "bf16"})
