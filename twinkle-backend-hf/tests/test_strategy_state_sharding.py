"""Each HF strategy says whether it shards the model's state over the data-parallel ranks (what the memory model of
``twinkle train --dry-run`` divides parameters, gradients and optimizer states by), through the core's
``Strategy.model_state_shards`` seam rather than a list of backend names in the core."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from twinkle_backend_hf.sequence_parallel.strategy import SequenceParallelStrategy
from twinkle_backend_hf.strategies.ddp import DDPStrategy
from twinkle_backend_hf.strategies.deepspeed import DeepSpeedStrategy
from twinkle_backend_hf.strategies.fsdp import NativeFSDPStrategy

from twinkle_core.memory_model import recipe_estimate_lines
from twinkle_core.mesh import DeviceMesh

DATA = DeviceMesh(dp=2)


@pytest.mark.parametrize(("strategy", "options", "mesh", "shards"), [
    (DDPStrategy, {}, DATA, 1),
    (NativeFSDPStrategy, {}, DATA, 2),
    (DeepSpeedStrategy, {"stage": 3}, DATA, 2),
    (SequenceParallelStrategy, {}, DeviceMesh(dp=2, sp=2), 1),
    (SequenceParallelStrategy, {"data_parallel": "fsdp"}, DeviceMesh(sp=2), 2),  # FSDP2 over the sequence ranks
    (SequenceParallelStrategy, {}, DeviceMesh(fsdp=2, sp=2), 4),
])
def test_strategies_say_over_how_many_ranks_they_split_the_model_state(strategy, options, mesh, shards):
    assert strategy.model_state_shards(options, mesh) == shards
    assert strategy.splits_vocabulary(options) is False


def test_the_dry_run_estimate_follows_the_strategy(tmp_path):
    config = {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    recipe = SimpleNamespace(
        model=SimpleNamespace(config=config, model_id=None, adapter=None, attn_implementation=None,
                              gradient_checkpointing=False),
        data=SimpleNamespace(max_length=64, batch_size=1), mesh={"sp": 2}, precision="no",
        strategy=SimpleNamespace(options={}))
    ddp = recipe_estimate_lines(recipe, SequenceParallelStrategy, 2)
    recipe.strategy.options = {"data_parallel": "fsdp"}
    fsdp = recipe_estimate_lines(recipe, SequenceParallelStrategy, 2)
    assert ddp != fsdp  # FSDP2 over both ranks halves parameters, gradients and optimizer states
