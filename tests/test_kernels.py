"""The kernel registry (twinkle_core.kernels) with a toy plugin: device-conditional selection, the recipe switch,
the log line, function swaps scoped to one network and reversible, and the optimizer replacement."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from twinkle_core import hookimpl
from twinkle_core.accelerator import CPUAccelerator
from twinkle_core.errors import ConfigError
from twinkle_core.kernels import apply_kernels, enabled_kernels
from twinkle_core.plugins import TwinklePlugins, reset_plugins
from twinkle_core.records import AcceleratorRecord, KernelRecord

transformers = pytest.importorskip("transformers")  # twinkle-core alone: the function swaps need a real network
modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")

TOY = "twinkle_toy_kernels"
LLAMA = "transformers.models.llama.modeling_llama"
CALLS: dict[str, int] = {}
TINY_LLAMA = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "tie_word_embeddings": False}


class ToyAccelerator(CPUAccelerator):
    """A CPU that calls itself ``toy``, so that only the toy kernels apply."""

    name = "toy"


class ToyAdamW(torch.optim.AdamW):
    def __init__(self, *args, **kwargs):
        CALLS["adamw"] = CALLS.get("adamw", 0) + 1
        super().__init__(*args, **kwargs)


def rms_forward(self, hidden_states):
    """The same arithmetic as LlamaRMSNorm.forward, counted."""
    CALLS["norm"] = CALLS.get("norm", 0) + 1
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def rotary(q, k, cos, sin, unsqueeze_dim=1):
    CALLS["rotary"] = CALLS.get("rotary", 0) + 1
    return modeling_llama.apply_rotary_pos_emb.original(q, k, cos, sin, unsqueeze_dim)


@hookimpl
def twinkle_register_accelerators():
    yield AcceleratorRecord("toy", f"{TOY}:ToyAccelerator")


@hookimpl
def twinkle_register_kernels():
    yield KernelRecord("toy_rms_norm", f"{TOY}:rms_forward", accelerators=("toy",),
                       replaces=(f"module:{LLAMA}:LlamaRMSNorm",))
    yield KernelRecord("toy_rotary", f"{TOY}:rotary", accelerators=("toy",),
                       replaces=(f"function:{LLAMA}:apply_rotary_pos_emb",))
    yield KernelRecord("toy_adamw", f"{TOY}:ToyAdamW", accelerators=("toy",), replaces=("optimizer:AdamW",))
    yield KernelRecord("toy_cuda_norm", f"{TOY}:rms_forward", accelerators=("cuda",),
                       replaces=(f"module:{LLAMA}:LlamaRMSNorm",))


@pytest.fixture(autouse=True)
def toy_plugin(monkeypatch):
    module = types.ModuleType(TOY)
    for obj in (ToyAccelerator, ToyAdamW, rms_forward, rotary, twinkle_register_accelerators,
                twinkle_register_kernels):
        setattr(module, obj.__name__, obj)
    monkeypatch.setitem(sys.modules, TOY, module)
    monkeypatch.setenv("TWINKLE_ACCELERATOR", "toy")
    reset_plugins(TwinklePlugins(extra_modules=[TOY]))
    CALLS.clear()
    yield
    reset_plugins()


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).eval()


def logits(network: torch.nn.Module) -> torch.Tensor:
    return network(input_ids=torch.arange(12).reshape(2, 6) % 64).logits


def test_only_kernels_for_the_active_accelerator_are_selected():
    assert [r.name for r in enabled_kernels("toy")] == ["toy_adamw", "toy_rms_norm", "toy_rotary"]
    assert [r.name for r in enabled_kernels("cuda")] == ["toy_cuda_norm"]
    assert enabled_kernels("cpu") == []


def test_module_and_function_swaps_are_equivalent_counted_and_reversible():
    reference, patched = tiny_llama(), tiny_llama()
    applied = apply_kernels(patched, "toy")
    # 2 layers x 2 norms + the final norm; the rotary function is called by the 2 attention modules
    assert applied.counts == {"toy_rms_norm": 5, "toy_rotary": 2}
    torch.testing.assert_close(logits(patched), logits(reference), rtol=1e-6, atol=1e-6)
    assert CALLS == {"norm": 5, "rotary": 2}
    CALLS.clear()
    logits(reference)  # the untouched network in the same process keeps the originals
    assert CALLS == {}
    applied.remove()
    assert not hasattr(modeling_llama.apply_rotary_pos_emb, "replacements")  # the module global is restored
    logits(patched)
    assert CALLS == {}


def test_a_dropped_network_releases_its_function_swap():
    import gc

    applied = apply_kernels(tiny_llama(), "toy")  # the network itself is garbage right away
    gc.collect()
    assert applied.counts == {"toy_rms_norm": 5, "toy_rotary": 2}
    assert not hasattr(modeling_llama.apply_rotary_pos_emb, "replacements")


def test_the_switch_turns_kernels_off_one_by_one_or_all():
    assert apply_kernels(tiny_llama(), "toy", {"toy_rotary": False}).counts == {"toy_rms_norm": 5}
    assert apply_kernels(tiny_llama(), "toy", False).counts == {}
    assert apply_kernels(tiny_llama(), "cpu").counts == {}


def test_an_unknown_kernel_in_the_switch_is_an_error_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"kernels.toy_rms_nrom: .*did you mean 'toy_rms_norm'"):
        enabled_kernels("toy", {"toy_rms_nrom": False})
    with pytest.raises(ConfigError, match="expected true or false"):
        enabled_kernels("toy", {"toy_rms_norm": "no"})


def test_the_model_applies_kernels_at_build_logs_them_and_maps_the_optimizer(caplog):
    from twinkle_backend_hf.model import TransformersModel

    with caplog.at_level(logging.INFO, logger="twinkle.kernels"):
        model = TransformersModel(config={"model_type": "llama", **TINY_LLAMA}, seed=0)
    assert model.applied_kernels.counts == {"toy_rms_norm": 5, "toy_rotary": 2}
    assert "fused kernels applied for accelerator 'toy': toy_rms_norm (5 sites), toy_rotary (2 sites)" in caplog.text
    model.set_optimizer("AdamW", lr=1e-3)
    assert CALLS["adamw"] == 1


def test_the_model_switch_keeps_the_plain_optimizer_and_modules():
    from twinkle_backend_hf.model import TransformersModel

    model = TransformersModel(config={"model_type": "llama", **TINY_LLAMA}, seed=0,
                              kernels={"toy_adamw": False, "toy_rms_norm": False})
    assert model.applied_kernels.counts == {"toy_rotary": 2}
    model.set_optimizer("AdamW", lr=1e-3)
    assert "adamw" not in CALLS


def test_a_recipe_switch_is_checked_before_launch():
    from twinkle_core.train.recipe import recipe_from_dict, validate_components

    def recipe(kernels):
        return recipe_from_dict({"model": {"config": {"model_type": "llama"}, "tokenizer": "tok",
                                           "options": {"kernels": kernels}}, "data": {"train": "a.jsonl"}})

    validate_components(recipe({"toy_rotary": False}))
    validate_components(recipe(False))
    with pytest.raises(ConfigError, match=r"^model.options.kernels.toy_rotray: .*did you mean 'toy_rotary'"):
        validate_components(recipe({"toy_rotray": False}))
