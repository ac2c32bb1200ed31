"""``set_optimizer("AdamW")`` takes torch's fused kernel where it exists; ``implementation=`` chooses explicitly."""

from __future__ import annotations

import pytest
import torch

from twinkle_core.errors import ConfigError
from twinkle_core.optim import build_optimizer, check_optimizer_options

STEPS = 10
LR = 1e-2


def _train(implementation: str, dtype: torch.dtype = torch.float32) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(dtype)
    data = torch.randn(STEPS, 8, 16, dtype=dtype)
    optimizer = build_optimizer("AdamW", list(net.parameters()), implementation=implementation, lr=LR,
                                weight_decay=0.01)
    for batch in data:
        net(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer, [p.detach().clone() for p in net.parameters()]


def test_auto_picks_the_fused_kernel_where_torch_has_one():
    optimizer, _ = _train("auto")
    assert optimizer.defaults["fused"] is True


@pytest.mark.parametrize("implementation, expected", [("for_loop", {"foreach": False, "fused": None}),
                                                      ("foreach", {"foreach": True, "fused": None}),
                                                      ("fused", {"foreach": None, "fused": True})])
def test_an_explicit_implementation_is_what_gets_built(implementation, expected):
    optimizer, _ = _train(implementation)
    assert {k: optimizer.defaults[k] for k in expected} == expected


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_every_kernel_gives_the_per_parameter_weights_within_float32_rounding(implementation):
    _, reference = _train("for_loop")
    _, weights = _train(implementation)
    # AdamW's kernels differ only in the order of a handful of float32 operations per element and step
    # (bias corrections folded or not, fused multiply-adds): each step can move a weight by a few ulp of
    # its own size plus a few ulp of the step size, and the difference carries into the next gradients only
    # through the tiny network's weights, so over STEPS steps the gap stays within STEPS * 8 ulp of |w| + lr.
    eps = torch.finfo(torch.float32).eps
    for ref, got in zip(reference, weights, strict=True):
        bound = STEPS * 8 * eps * (ref.abs().max().item() + LR)
        assert (got - ref).abs().max().item() <= bound


def test_bf16_parameters_get_the_fused_kernel_too():
    optimizer, _ = _train("auto", torch.bfloat16)
    assert optimizer.defaults["fused"] is True


def test_a_user_s_own_fused_or_foreach_flag_is_kept():
    params = [torch.nn.Parameter(torch.ones(3))]
    assert build_optimizer("AdamW", params, lr=0.1, foreach=True).defaults["fused"] is None
    with pytest.raises(ConfigError, match="not both"):
        build_optimizer("AdamW", params, implementation="fused", foreach=True)


def test_differentiable_optimizers_do_not_get_the_fused_kernel():
    params = [torch.nn.Parameter(torch.ones(3))]
    assert not build_optimizer("AdamW", params, lr=0.1, differentiable=True).defaults["fused"]


@pytest.mark.parametrize("name, implementation, message", [
    ("AdamW", "fast", "'fast' is not one of auto, fused, foreach, for_loop"),
    ("RMSprop", "fused", "RMSprop has no fused kernel"),
])
def test_impossible_implementations_are_refused_by_name(name, implementation, message):
    params = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(ConfigError, match=message):
        build_optimizer(name, params, implementation=implementation, lr=0.1)


def test_an_instance_with_an_implementation_is_refused():
    instance = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    with pytest.raises(ConfigError, match="pass one or the other"):
        build_optimizer(instance, [], implementation="fused")


def test_a_recipe_implementation_is_checked_before_launch():
    check_optimizer_options(torch.optim.AdamW, {"implementation": "foreach", "betas": [0.9, 0.95]})
    with pytest.raises(ConfigError, match="optimizer.options.implementation: .*'fast'"):
        check_optimizer_options(torch.optim.AdamW, {"implementation": "fast"})
    with pytest.raises(ConfigError, match="optimizer.options.bets"):
        check_optimizer_options(torch.optim.AdamW, {"bets": [0.9, 0.95]})

