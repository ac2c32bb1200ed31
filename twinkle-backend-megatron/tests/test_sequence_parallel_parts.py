"""The pieces of Megatron's sequence parallelism (TP-SP) on CPU: torch norms tagged for the TP gradient sum,
batches padded to a multiple of ``tp`` and cut back, the activations pipeline stages exchange under SP, and the
MoE rule. The parity runs (TP=2 on 2 ranks, TP=2 x PP=2 on 4) are in ``test_distributed.py``."""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from twinkle_backend_megatron import build, norms
from twinkle_backend_megatron.pipeline import MegatronPipeline
from twinkle_backend_megatron.sequence_padding import pad_sequences, trim_sequences
from twinkle_backend_megatron.strategy import MegatronStrategy

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_core.mesh import DeviceMesh
from twinkle_core.model.step_context import StepContext
from twinkle_core.precision import FullPrecision


def _config(**overrides):
    fields = {"sequence_parallel": True, "normalization": "RMSNorm", "layernorm_zero_centered_gamma": False,
              "memory_efficient_layer_norm": False}
    return SimpleNamespace(**{**fields, **overrides})


def test_norm_is_torchs_own_and_tagged_for_the_tensor_parallel_sum():
    norm = norms.SequenceParallelNorm(config=_config(), hidden_size=8, eps=1e-6)
    assert type(norm) is torch.nn.RMSNorm and norm.eps == 1e-6
    assert all(p.sequence_parallel for p in norm.parameters())
    plain = norms.SequenceParallelNorm(config=_config(sequence_parallel=False, normalization="LayerNorm"), hidden_size=8)
    assert type(plain) is torch.nn.LayerNorm and not any(p.sequence_parallel for p in plain.parameters())
    with pytest.raises(NotImplementedError, match="Apex or Transformer Engine"):
        norms.SequenceParallelNorm(config=_config(layernorm_zero_centered_gamma=True), hidden_size=8)


@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_every_norm_of_the_local_spec_is_replaced(qk_layernorm):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
    block = norms.with_sequence_parallel_norms(spec, num_layers=3)
    assert len(block.layer_specs) == 3 and block.layer_norm is norms.SequenceParallelNorm

    def found(submodules):
        for field in dataclasses.fields(submodules):
            value = getattr(submodules, field.name)
            if isinstance(value, ModuleSpec) and dataclasses.is_dataclass(value.submodules):
                yield from found(value.submodules)
            elif field.name.endswith("layernorm") and value not in (None, IdentityOp):
                yield field.name, value

    replaced = dict(found(block.layer_specs[0].submodules))
    assert set(replaced.values()) == {norms.SequenceParallelNorm}
    assert {"input_layernorm", "pre_mlp_layernorm"} <= set(replaced)
    assert ({"q_layernorm", "k_layernorm"} <= set(replaced)) == qk_layernorm
    assert dict(found(spec.submodules)).keys() == replaced.keys()  # the original spec is left as it was


def test_a_batch_is_padded_to_the_multiple_and_nothing_real_changes():
    ids = torch.arange(1, 12).view(1, 11).repeat(2, 1)
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(11).view(1, 11).repeat(2, 1),
             "advantages": torch.ones(2, 10), "rewards": torch.ones(2)}
    padded, length = pad_sequences(batch, 4)
    assert length == 11 and padded["input_ids"].shape == (2, 12) and padded["advantages"].shape == (2, 11)
    assert torch.equal(padded["input_ids"][:, :11], ids) and torch.equal(padded["labels"][:, 11], torch.full((2,), IGNORE_INDEX))
    assert torch.equal(padded["attention_mask"], torch.cat([torch.ones(2, 11), torch.zeros(2, 1)], 1).long())
    assert padded["position_ids"][0, 11] == 11  # the last row's positions continue: no new packed sequence
    assert padded["rewards"] is batch["rewards"] and "attention_mask" not in batch
    assert pad_sequences(batch, 1)[0] is batch
    outputs = {"logits": torch.zeros(2, 12, 5), "loss": torch.tensor(1.0)}
    trimmed = trim_sequences(outputs, 12, 11)
    assert trimmed["logits"].shape == (2, 11, 5) and trimmed["loss"] is outputs["loss"]


def test_moe_with_tensor_parallelism_asks_for_sequence_parallelism():
    moe = SimpleNamespace(num_layers=2, num_experts=4, model_type="qwen3_moe")
    with pytest.raises(ConfigError, match="strategy.options.sequence_parallel=true"):
        build.check_layout(moe, DeviceMesh(tp=2), sequence_parallel=False)
    build.check_layout(moe, DeviceMesh(tp=2), sequence_parallel=True)
    build.check_layout(moe, DeviceMesh(dp=2, ep=2), sequence_parallel=False)


class _ScheduleCalled(Exception):
    """Stops the pipeline once it has handed megatron-core's schedule its arguments."""


def test_pipeline_stages_exchange_a_whole_tensor_parallel_share_of_the_padded_sequence(monkeypatch):
    """Under TP-SP x PP megatron-core sizes the activations the stages send each other from the schedule's
    ``seq_length`` (``get_tensor_shapes`` in megatron/core/pipeline_parallel/schedules.py: ``seq_length // tp``,
    rounded down), while the first stage's embedding scatters the micro-batch's own length over the TP ranks. The
    two agree only if the batch is padded before it is cut into micro-batches and the schedule gets the padded
    length: 11 // 2 = 5 positions sent for 6 computed would fail (or garble) the p2p receive."""
    from megatron.core.pipeline_parallel.schedules import get_tensor_shapes

    seen: dict = {}

    def schedule(**kwargs):
        seen.update(kwargs, pieces=list(kwargs["data_iterator"][0]))
        raise _ScheduleCalled

    monkeypatch.setattr("megatron.core.pipeline_parallel.get_forward_backward_func", lambda: schedule)
    tp, hidden = 2, 16
    strategy = MegatronStrategy(DeviceMesh(tp=tp, pp=2), precision=FullPrecision(), sequence_parallel=True)
    pipeline = MegatronPipeline([torch.nn.Linear(1, 1)], strategy=strategy, vocab_size=8, task=None,
                                loss_context=None, unwrap=lambda chunk: chunk)
    step = StepContext(state=None, device=torch.device("cpu"), ensure_loss=lambda state: None,
                       enter_adapter=contextlib.nullcontext)
    with pytest.raises(_ScheduleCalled):
        pipeline.run(step, {"input_ids": torch.ones(8, 11, dtype=torch.long)}, forward_only=True)
    pieces = seen["pieces"]
    assert len(pieces) == 2 and all(piece["input_ids"].shape == (4, 12) for piece in pieces)
    assert all(int(piece["attention_mask"][:, 11].sum()) == 0 for piece in pieces)  # the added position is padding
    group = SimpleNamespace(size=lambda: tp)
    (sent,) = get_tensor_shapes(seq_length=seen["seq_length"], micro_batch_size=seen["micro_batch_size"],
                                decoder_seq_length=None, config=SimpleNamespace(sequence_parallel=True, hidden_size=hidden),
                                tp_group=group, cp_group=SimpleNamespace(size=lambda: 1))
    assert sent == (12 // tp, 4, hidden)  # what the embedding's scatter gives each TP rank of a micro-batch


def test_the_megatron_strategy_splits_the_vocabulary_for_the_memory_model_unless_told_not_to():
    from twinkle_backend_megatron.strategy import MegatronStrategy

    from twinkle_core.mesh import DeviceMesh

    assert MegatronStrategy.splits_vocabulary({}) is True
    assert MegatronStrategy.splits_vocabulary({"vocab_parallel_loss": False}) is False
    assert MegatronStrategy.model_state_shards({}, DeviceMesh(tp=2, dp=2)) == 2  # TP splits, DP copies
