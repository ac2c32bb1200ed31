"""Ulysses sequence parallelism: batch sharding, masks and head splitting in one process; parity
with the single-process model under torchrun (gloo), with DDP or FSDP2 (``data_parallel``) for the data
dimension: ``test_sp2_matches_single_process`` (2 ranks) and ``test_dp2_sp2_matches_single_process`` (4 ranks,
marked slow). The compared cases, and the save/resume check, are listed in ``scripts/sp_parity.py``."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from twinkle_backend_hf.sequence_parallel import batch_sharding, ulysses

from twinkle_core.errors import ConfigError
from twinkle_core.testing.tolerance import SPREAD_FACTOR
from twinkle_core.testing.torchrun import thread_env

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "sp_parity.py")
#: float32 rounding through one forward/backward of the tiny model stays far below this
TOLERANCE = 1e-5
#: the training results (10 AdamW steps) may differ from the reference by SPREAD_FACTOR times the spread the
#: reference shows when only its summation order changes (see scripts/sp_parity.py and
#: twinkle_core.testing.tolerance): Ulysses reorders the same sums across ranks


# ---------------------------------------------------------------------- batch sharding
def _join(shards, key):
    return torch.cat([s[key] for s in shards], dim=1)


def _shards(batch, sp):
    out = [batch_sharding.shard_batch(batch, sp, r) for r in range(sp)]
    return [s for s, _ in out], out[0][1]


def test_labels_are_shifted_before_the_split_and_padded_to_a_multiple_of_sp():
    ids = torch.arange(14).view(2, 7)
    labels = ids + 100
    labels[0, :2] = -100
    shards, info = _shards({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}, 2)
    assert (info.length, info.padded_length, info.local_length) == (7, 8, 4)
    for s in shards:
        assert "labels" not in s and "attention_mask" not in s
        assert s["input_ids"].shape == s["shift_labels"].shape == s["position_ids"].shape == (2, 4)
    expected = torch.full((2, 8), -100)
    expected[:, :6] = labels[:, 1:]
    assert torch.equal(_join(shards, "shift_labels"), expected)  # chunk 0's last token predicts chunk 1's first
    assert torch.equal(_join(shards, "input_ids")[:, :7], ids)
    assert torch.equal(_join(shards, "position_ids"), torch.arange(8).expand(2, 8))  # global positions


def test_packed_positions_stay_global_and_padding_continues_the_last_sequence():
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    shards, _ = _shards({"input_ids": torch.zeros(1, 5, dtype=torch.long), "position_ids": positions}, 2)
    assert torch.equal(_join(shards, "position_ids"), torch.tensor([[0, 1, 2, 0, 1, 2]]))
    assert "shift_labels" not in shards[0]


def test_right_padding_drops_the_mask_and_left_padding_isolates_pad_tokens():
    ids = torch.ones(2, 6, dtype=torch.long)
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    shards, _ = _shards({"input_ids": ids, "attention_mask": right}, 2)
    assert torch.equal(_join(shards, "position_ids"), torch.arange(6).expand(2, 6))
    left = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    positions = (left.cumsum(-1) - 1).clamp(min=0)
    shards, _ = _shards({"input_ids": ids, "attention_mask": left, "position_ids": positions}, 2)
    joined = _join(shards, "position_ids")
    assert torch.equal(joined, torch.tensor([[-2, -2, 0, 1, 2, 3], [0, 1, 2, 3, 4, -2]]))
    ids_per_token = ulysses.sequence_ids(joined)
    assert len(set(ids_per_token[0, :2].tolist())) == 2 and len(set(ids_per_token[0, 2:].tolist())) == 1


def test_padding_between_real_tokens_is_refused():
    with pytest.raises(ConfigError, match="between real tokens"):
        batch_sharding.shard_batch({"input_ids": torch.ones(1, 4, dtype=torch.long),
                             "attention_mask": torch.tensor([[1, 0, 1, 1]])}, 2, 0)


def test_other_per_token_tensors_are_aligned_with_the_shifted_labels():
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long),
             "rewards": torch.tensor([1.0, 2.0]),                 # per sequence: unchanged
             "advantages": torch.arange(8.0).view(2, 4),          # [B, T] aligned with labels: shifted
             "ref_logps": torch.arange(6.0).view(2, 3) + 10,      # [B, T - 1] (shifted already): padded
             "teacher_logits": torch.arange(16.0).view(2, 4, 2)}  # [B, T, V] aligned with the logits: split
    shards, _ = _shards(batch, 2)
    assert torch.equal(shards[1]["rewards"], batch["rewards"])
    assert torch.equal(_join(shards, "advantages"), torch.tensor([[1.0, 2.0, 3.0, 0.0], [5.0, 6.0, 7.0, 0.0]]))
    assert torch.equal(_join(shards, "ref_logps"), torch.tensor([[10.0, 11.0, 12.0, 0.0], [13.0, 14.0, 15.0, 0.0]]))
    assert torch.equal(_join(shards, "teacher_logits"), batch["teacher_logits"])
    assert shards[0]["teacher_logits"].shape == (2, 2, 2)


# ---------------------------------------------------------------------- masks and heads
def test_packed_mask_matches_transformers_own_packed_mask():
    from transformers import AutoConfig
    from transformers.masking_utils import create_causal_mask

    config = AutoConfig.for_model("qwen2", hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                                  num_hidden_layers=1, vocab_size=8)
    config._attn_implementation = "sdpa"
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]])
    expected = create_causal_mask(config=config, inputs_embeds=torch.zeros(2, 8, 8), attention_mask=None,
                                  cache=None, position_ids=positions)
    assert torch.equal(ulysses.packed_mask(positions), expected)
    assert ulysses.packed_mask(torch.arange(8).expand(2, 8)) is None  # not packed: plain causal, no mask


@pytest.mark.parametrize(("heads", "kv_heads", "sp", "factor"),
                         [(4, 2, 2, 1), (4, 1, 2, 2), (8, 2, 4, 2), (12, 6, 4, 2), (4, 4, 4, 1)])
def test_kv_heads_are_repeated_only_as_much_as_the_split_needs(heads, kv_heads, sp, factor):
    assert ulysses.kv_repeat_factor(heads, kv_heads, sp) == factor


@pytest.mark.parametrize(("heads", "kv_heads", "sp"), [(4, 2, 3), (6, 3, 4)])
def test_head_counts_that_cannot_be_split_are_refused(heads, kv_heads, sp):
    with pytest.raises(ConfigError, match="cannot split"):
        ulysses.kv_repeat_factor(heads, kv_heads, sp)


def test_registered_attention_is_plain_sdpa_without_a_group():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    name = ulysses.register_ulysses_attention("sdpa")
    assert name in AttentionInterface() and ulysses.register_ulysses_attention("sdpa") == name
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 6, 4, generator=g) for h in (4, 2, 2))
    expected, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.5)
    got, _ = AttentionInterface()[name](module, q, k, v, None, scaling=0.5)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_one_process_strategy_matches_single():
    """sp=1 (one rank): the strategy's shift_labels path, DDP wrap and registered attention change nothing."""
    from twinkle_backend_hf.sequence_parallel.strategy import SequenceParallelStrategy
    from twinkle_backend_hf.testing import make_tiny_model

    from twinkle_core.testing.conformance import make_batch

    batch = make_batch(0, rows=2, length=9)
    models = [make_tiny_model(attn_implementation="sdpa"),
              make_tiny_model(attn_implementation="sdpa", strategy=SequenceParallelStrategy())]
    norms = []
    for model in models:
        model.set_optimizer("SGD", lr=0.1)
        model.forward_backward(inputs=batch)
        norms.append(model.clip_grad_norm(math.inf))
    assert models[1].hf_model.config._attn_implementation == "twinkle_ulysses_sdpa"
    assert norms[1] == pytest.approx(norms[0], rel=1e-6)
    for a, b in zip(models[0].trainable_parameters(), models[1].trainable_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-7, rtol=0)


# ---------------------------------------------------------------------- the data dimension: DDP or FSDP2
def test_data_parallel_defaults_to_ddp_and_to_fsdp_when_the_mesh_shards_the_data():
    from twinkle_backend_hf.sequence_parallel.strategy import SequenceParallelStrategy
    from twinkle_backend_hf.strategies.ddp import DDPStrategy
    from twinkle_backend_hf.strategies.fsdp import NativeFSDPStrategy

    from twinkle_core.mesh import DeviceMesh

    plain = SequenceParallelStrategy(mesh=DeviceMesh(sp=2), find_unused_parameters=True)
    assert isinstance(plain.data_parallel, DDPStrategy) and plain.options["data_parallel"] == "ddp"
    assert plain.data_parallel.options["find_unused_parameters"] is True  # the DDP options pass through
    sharded = SequenceParallelStrategy(mesh=DeviceMesh(fsdp=2, sp=2), reshard_after_forward=False)
    assert isinstance(sharded.data_parallel, NativeFSDPStrategy) and sharded.options["data_parallel"] == "fsdp"
    assert sharded.data_parallel.options["reshard_after_forward"] is False
    # the options round-trip through the constructor (frozen_copy and sibling rebuild the strategy from them)
    rebuilt = type(sharded)(mesh=sharded.mesh, **sharded.options)
    assert rebuilt.options == sharded.options and isinstance(rebuilt.data_parallel, NativeFSDPStrategy)


def test_contradicting_or_unknown_data_parallel_settings_are_refused():
    from twinkle_backend_hf.sequence_parallel.strategy import SequenceParallelStrategy

    from twinkle_core.mesh import DeviceMesh

    with pytest.raises(ConfigError, match="data_parallel must be one of ddp, fsdp"):
        SequenceParallelStrategy(data_parallel="zero3")
    with pytest.raises(ConfigError, match="set data_parallel: fsdp, or move the ranks to mesh.dp"):
        SequenceParallelStrategy(mesh=DeviceMesh(fsdp=2, sp=2), data_parallel="ddp")
    with pytest.raises(ConfigError, match=r"data_parallel: fsdp.*find_unused_parameters.*own options"):
        SequenceParallelStrategy(data_parallel="fsdp", find_unused_parameters=True)  # a DDP option under FSDP2


@pytest.mark.parametrize(("mesh", "shards"), [
    ({"sp": 2}, {"fsdp": 2}),                           # the sequence ranks share one model: sharded over them
    ({"dp": 2, "sp": 2}, {"fsdp": 4}),                  # data_parallel: fsdp over dp ranks shards the world
    ({"fsdp": 2, "cp": 2, "sp": 2}, {"fsdp": 8}),
    ({"dp": 2, "fsdp": 2, "sp": 2}, {"dp": 2, "fsdp": 4}),  # HSDP: replicas over dp, whole sequence groups sharded
])
def test_fsdp2_shards_over_the_sequence_ranks_too(mesh, shards):
    from twinkle_backend_hf.sequence_parallel.data_parallel import inner_mesh

    from twinkle_core.mesh import DeviceMesh

    assert inner_mesh("fsdp", DeviceMesh(**mesh)) == DeviceMesh(**shards)
    assert inner_mesh("ddp", DeviceMesh(**mesh)) == DeviceMesh(dp=DeviceMesh(**mesh).world_size)


def test_a_quantised_base_is_refused_under_fsdp():
    from twinkle_backend_hf.sequence_parallel.strategy import SequenceParallelStrategy
    from twinkle_backend_hf.testing import make_tiny_model

    model = make_tiny_model(attn_implementation="sdpa").hf_model
    model.hf_quantizer = object()  # what transformers sets on a bitsandbytes model (quantization.is_quantized)
    with pytest.raises(ConfigError, match="use data_parallel: ddp for a quantised base"):
        SequenceParallelStrategy(data_parallel="fsdp").wrap_module(model)


# ---------------------------------------------------------------------- several ranks
@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    """The single-process results (strategy "single"), computed once for the module."""
    out = tmp_path_factory.mktemp("sp-reference")
    env = {**os.environ, **thread_env()}
    done = subprocess.run([sys.executable, SCRIPT, "reference", str(out)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def _check_parity(reference_dir, tmp_path, nproc: int, dp: int, data_parallel: str) -> None:
    from distributed import run_torchrun

    shutil.copy(reference_dir / "reference.pt", tmp_path / "reference.pt")
    spread = json.loads((reference_dir / "spread.json").read_text())
    result = run_torchrun([SCRIPT, "sp", str(tmp_path), str(dp), data_parallel], nproc=nproc, timeout=300)
    assert result.returncode == 0, result.output
    sp = nproc // dp
    for rank in range(nproc):
        deltas = json.loads((tmp_path / f"deltas-rank{rank}.json").read_text())
        assert deltas["_attn_implementation"] == "twinkle_ulysses_sdpa"
        rows = 4 // dp
        assert deltas["_local_logits_shape"] == [rows, 16 // sp, 64]
        assert deltas["_global_logits_shape"] == [rows, 16, 64]
        # DDP and FSDP2 average over all dp*sp ranks; the scale turns that average into sum / global tokens
        assert deltas["_gradient_average_size"] == nproc
        assert deltas["_gradient_scale_x_tokens"] == pytest.approx(nproc)
        # FSDP2 shards every trainable parameter over the world (DTensors); DDP keeps them whole
        sharded = deltas["_parameters"] if data_parallel == "fsdp" else 0
        assert deltas["_parameters"] > 0 and deltas["_sharded_parameters"] == sharded
        # a resumed run repeats the uninterrupted one exactly (weights, and the optimizer state: DCP under FSDP2)
        assert deltas["_resume_loss_delta"] == 0.0, deltas["_resume_loss_delta"]
        assert deltas["_control_packed_without_mask"] > 1e-3, "the parity checks cannot tell a wrong mask"
        compared = {k: v for k, v in deltas.items() if not k.startswith("_")}
        assert {"train_losses", "train_grad_norms", "train_weights", "lora_train_losses", "lora_train_weights",
                "grad_packed", "grad_single_kv_head", "grad_accumulated", "grad_lora_checkpointing_packed",
                "eval_packed"} <= compared.keys()
        too_far = {k: v for k, v in compared.items() if not v <= max(TOLERANCE, SPREAD_FACTOR * spread.get(k, 0.0))}
        assert not too_far, f"rank {rank}: {too_far}\n{result.output[-3000:]}"
    # the optimizer went through the data-parallel strategy: one file under DDP, each rank's shard under FSDP2
    state_dir = tmp_path / "resume" / "twinkle_state"
    pattern = "optimizer_dcp/*.distcp" if data_parallel == "fsdp" else "optimizer.pt"
    written = sorted(p.name for p in state_dir.glob(pattern))
    assert len(written) == (nproc if data_parallel == "fsdp" else 1), written


@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_sp2_matches_single_process(reference_dir, tmp_path, data_parallel):
    """sp=2: 10 AdamW steps (losses, grad norms, weights), 5 LoRA steps, one-step gradients, forward_only logits,
    save and resume; FSDP2 shards the parameters over the 2 sequence ranks."""
    _check_parity(reference_dir, tmp_path, nproc=2, dp=1, data_parallel=data_parallel)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_dp2_sp2_matches_single_process(reference_dir, tmp_path, data_parallel):
    """4 ranks, dp=2 x sp=2: the same checks with each data-parallel pair holding half the rows (FSDP2: sharded
    over all 4 ranks)."""
    _check_parity(reference_dir, tmp_path, nproc=4, dp=2, data_parallel=data_parallel)
