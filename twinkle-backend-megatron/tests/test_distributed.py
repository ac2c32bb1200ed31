"""Multi-rank tests on CPU (gloo): the conformance suite at TP=2 and DP=2, and cross-backend parity.

Parity: the same tiny Hugging Face weights trained 10 AdamW steps (cosine schedule, clipping at 1.0)
give the same losses, pre-clip gradient norms and final logits on the HF backend (one process) and
on Megatron with TP=2, PP=2 (also with tied embeddings), PP=2 x VPP=2, TP=2 x PP=2 (4 ranks, also with sequence
parallelism, dense and MoE), TP=2 with sequence parallelism, EP=2
(Qwen3-MoE), DP=2 with the distributed optimizer, and LoRA (the LM head's too) at TP=2 and PP=2 (fp32; within the HF
reference's own float noise: its distance from the same run with its rows reversed and from the run in
float64, see ``twinkle_core.testing.tolerance``).
Every job runs under a hard timeout.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import transformers
from torchrun_job import torchrun
from twinkle_backend_hf.model import TransformersModel
from twinkle_backend_megatron.lora import ALL_LINEAR, HEAD
from twinkle_backend_megatron.testing import tiny_llama_config, tiny_qwen2_config

from twinkle_core.testing.conformance import LORA_CONFIG, make_batch
from twinkle_core.testing.tolerance import (
    assert_within_spread,
    forward_tolerance,
    max_abs_diff,
    spread_tolerance,
    sum_tolerance,
)
from twinkle_core.testing.torchrun import PASSED_ONLY, pytest_summaries

pytestmark = pytest.mark.distributed

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "scripts", "train_losses.py")
#: rows x length of ``make_batch``: the tokens each step's loss averages (an upper bound: prompts are masked)
TOKENS_PER_STEP = 8 * 12
#: an upper bound of the trainable parameters of the tiny models (the squared grad norm sums over them)
PARAMETERS = 200_000
#: the LoRA runs' adapter: every projection and the LM head (replicated over TP ranks, on the last pipeline stage)
LORA_TARGETS = [*ALL_LINEAR, HEAD]


def _reference(make_model, float64: bool = True) -> dict:
    """The HF backend's run, plus its own float noise: the same run with its rows reversed (``reordered``) and,
    unless ``float64`` is False, in float64 (``exact``)."""
    import sys

    sys.path.insert(0, os.path.join(HERE, "scripts"))
    import loop

    def one_run(reverse_rows: bool = False, exact: bool = False) -> dict:
        model = make_model()
        if exact:
            model.hf_model.double()
        return loop.run(model, adapter_name="t" if model._adapters else None, reverse_rows=reverse_rows)

    return {**one_run(), "reordered": one_run(reverse_rows=True), "exact": one_run(exact=True) if float64 else None}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Tiny HF checkpoints (2-layer Qwen2, 4-layer Llama, Qwen3-MoE, a LoRA adapter) and the HF backend's runs on them."""
    root = tmp_path_factory.mktemp("hf")
    paths, refs = {}, {}
    moe = {**tiny_qwen2_config(), "model_type": "qwen3_moe", "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "norm_topk_prob": True}
    for name, config, seed in (("qwen2", tiny_qwen2_config(), 0), ("llama4", tiny_llama_config(num_hidden_layers=4), 1),
                               ("moe", moe, 2), ("tied", tiny_qwen2_config(tie_word_embeddings=True), 3)):
        paths[name] = TransformersModel(config=config, seed=seed).save(name, output_dir=str(root), save_optimizer=False)
        # transformers' grouped expert matmul has no float64 kernel: the MoE reference keeps the reversal alone
        refs[name] = _reference(lambda name=name: TransformersModel(model_id=paths[name]), float64=name != "moe")
    start = TransformersModel(model_id=paths["qwen2"])
    start.add_adapter_to_model("t", {**LORA_CONFIG, "target_modules": LORA_TARGETS, "init_lora_weights": False})
    paths["lora"] = start.save("lora", output_dir=str(root), save_optimizer=False)

    def lora_model():
        hf = TransformersModel(model_id=paths["qwen2"])
        hf.add_adapter_to_model("t", {**copy.deepcopy(LORA_CONFIG), "target_modules": LORA_TARGETS})
        hf.load(paths["lora"], adapter_name="t")
        return hf

    refs["lora"] = _reference(lora_model)
    return paths, refs


RESHARD = os.path.join(HERE, "scripts", "reshard.py")


def _megatron(tmp_path, runs: list[dict], nproc: int = 2, timeout: float = 300) -> list[dict]:
    out = tmp_path / "results.json"
    job = torchrun([SCRIPT, "--runs", json.dumps(runs), "--out", out], nproc=nproc, timeout=timeout)
    assert job.returncode == 0, job.output
    return json.loads(out.read_text())


def _assert_parity(got: dict, want: dict) -> None:
    """Losses, pre-clip grad norms and final logits within the HF reference's own float noise."""
    reordered, exact = want["reordered"], want["exact"] or {}
    assert_within_spread("losses", got["losses"], want["losses"], reordered["losses"],
                         floor=sum_tolerance(TOKENS_PER_STEP, max(want["losses"])), exact_reference=exact.get("losses"))
    assert_within_spread("pre-clip grad norms", got["norms"], want["norms"], reordered["norms"],
                         floor=sum_tolerance(PARAMETERS, max(want["norms"])), exact_reference=exact.get("norms"))
    assert_within_spread("final logits", got["logits"], want["logits"], reordered["logits"],
                         floor=_logits_tolerance(want["logits"]), exact_reference=exact.get("logits"))


def _assert_padded_run_matches(padded: dict, plain: dict, *, length: int) -> None:
    """A sequence-parallel run on ``length``-long rows (padded to a multiple of TP, outputs cut back) trains as the
    same layout without SP: losses within one step's summation rounding, logits within a forward's, both per step."""
    assert len(padded["logits"][0]) == length
    steps, tokens = len(plain["losses"]), 8 * length
    assert max_abs_diff(padded["losses"], plain["losses"]) <= sum_tolerance(tokens, max(plain["losses"])) * steps
    assert max_abs_diff(padded["logits"], plain["logits"]) <= _logits_tolerance(plain["logits"]) * steps


def _logits_tolerance(logits) -> float:
    """One forward pass of the same weights by two implementations (see ``forward_tolerance``)."""
    config = tiny_llama_config(num_hidden_layers=4)  # the deepest and widest of the tiny models
    return forward_tolerance(float(torch.as_tensor(logits).abs().max()), depth=config["num_hidden_layers"],
                             width=max(config["hidden_size"], config["intermediate_size"]))


# ---------------------------------------------------------------------- the core's conformance suite
def _conformance(target: str, *extra: str):
    job = torchrun(["-m", "pytest", "--pyargs", "twinkle_core.testing.conformance", "--twinkle-backend", target,
                    "-p", "no:cacheprovider", "-q", "-W", "ignore", *extra], nproc=2, timeout=300,
                   per_rank_output=True)
    assert job.returncode == 0, job.output
    summaries = pytest_summaries(job)
    assert all(PASSED_ONLY.fullmatch(line) for line in summaries), \
        f"expected every test to pass on each rank, got {summaries}\n{job.output}"


def test_conformance_suite_data_parallel():
    _conformance("megatron-dp2")


def test_conformance_suite_tensor_parallel():
    _conformance("megatron-tp2")


def test_conformance_suite_distributed_optimizer():
    # megatron-core's DistributedOptimizer shards Adam / AdamW for full fine-tuning: the suite's tests of that
    _conformance("megatron-dp2-distopt", "-k", "test_memorises_a_batch or test_resume_continues_exactly or "
                 "test_train_configs_describe_the_run or (test_save_load_round_trip and not adapter) or "
                 "test_frozen_copy")


# ---------------------------------------------------------------------- cross-backend parity
@pytest.mark.parity
def test_tensor_parallel_lora_and_distributed_optimizer_parity(weights, tmp_path):
    import peft

    paths, refs = weights
    full, lora, sharded = _megatron(tmp_path, [
        {"model": paths["qwen2"], "mesh": {"tp": 2}},
        {"model": paths["qwen2"], "mesh": {"tp": 2}, "lora": paths["lora"], "lora_targets": LORA_TARGETS,
         "save": str(tmp_path)},
        {"model": paths["qwen2"], "mesh": {"dp": 2}, "strategy_options": {"distributed_optimizer": True}}])
    _assert_parity(full, refs["qwen2"])
    _assert_parity(sharded, refs["qwen2"])
    # random A and B (init_lora_weights=False) make this run the most sensitive to rounding: its spread is the largest
    _assert_parity(lora, refs["lora"])
    base = transformers.AutoModelForCausalLM.from_pretrained(paths["qwen2"], dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "trained")).eval()
    torch.testing.assert_close(_hf_logits(loaded), torch.tensor(lora["logits"], dtype=torch.float64),
                               atol=_logits_tolerance(lora["logits"]), rtol=0)


@pytest.mark.parity
def test_pipeline_parallel_parity_errors_and_hf_checkpoint(weights, tmp_path):
    paths, refs = weights
    plain, virtual, tied, lora = _megatron(tmp_path, [
        {"model": paths["qwen2"], "mesh": {"pp": 2}, "pp_errors": True, "save": str(tmp_path)},
        {"model": paths["llama4"], "mesh": {"pp": 2, "vpp": 2}},
        {"model": paths["tied"], "mesh": {"pp": 2}},  # the embedding is shared by the first and last stage
        {"model": paths["qwen2"], "mesh": {"pp": 2}, "lora": paths["lora"], "lora_targets": LORA_TARGETS}])
    _assert_parity(plain, refs["qwen2"])
    _assert_parity(virtual, refs["llama4"])
    # the tied matrix sums two gradient contributions (embedding, output) in another order than HF
    _assert_parity(tied, refs["tied"])
    _assert_parity(lora, refs["lora"])
    for method, message in plain["errors"].items():
        assert message and message.startswith("ConfigError") and "forward_backward(inputs=...)" in message, method
    # the checkpoint written from two pipeline stages is one plain HF directory
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype=torch.float32)
    torch.testing.assert_close(_hf_logits(reloaded), torch.tensor(plain["logits"], dtype=torch.float64),
                               atol=_logits_tolerance(plain["logits"]), rtol=0)


@pytest.mark.parity
def test_expert_parallel_moe_parity(weights, tmp_path):
    paths, refs = weights
    (got,) = _megatron(tmp_path, [{"model": paths["moe"], "mesh": {"dp": 2, "ep": 2}}])
    # top-k routing is discontinuous: rounding-level differences can move a token to another expert
    _assert_parity(got, refs["moe"])


@pytest.mark.parity
def test_sequence_parallel_dense_and_moe_parity(weights, tmp_path):
    """TP-SP with torch norms (``norms.py``): the dense model and the MoE at TP=2 equal the HF reference, and a
    length that does not divide by TP (padded, then cut back) trains as TP without SP does."""
    paths, refs = weights
    sp = {"sequence_parallel": True}
    dense, odd, odd_sp, moe = _megatron(tmp_path, [
        {"model": paths["qwen2"], "mesh": {"tp": 2}, "strategy_options": sp},
        {"model": paths["qwen2"], "mesh": {"tp": 2}, "length": 11},
        {"model": paths["qwen2"], "mesh": {"tp": 2}, "length": 11, "strategy_options": sp},
        {"model": paths["moe"], "mesh": {"tp": 2}, "strategy_options": sp}])
    _assert_parity(dense, refs["qwen2"])
    _assert_parity(moe, refs["moe"])
    _assert_padded_run_matches(odd_sp, odd, length=11)


@pytest.mark.parity
def test_tensor_and_pipeline_parallel_on_four_ranks(weights, tmp_path):
    paths, refs = weights
    (got,) = _megatron(tmp_path, [{"model": paths["llama4"], "mesh": {"tp": 2, "pp": 2}}], nproc=4, timeout=420)
    _assert_parity(got, refs["llama4"])


@pytest.mark.parity
@pytest.mark.slow  # 4 processes on the 2 cores: the nox slow session runs it (~40 s); the p2p shape check stays fast
def test_sequence_parallel_with_pipeline_parallel_on_four_ranks(weights, tmp_path):
    """TP=2 x SP x PP=2: the stages exchange ``[padded length / tp, rows, hidden]`` activations (megatron-core's
    schedules divide the length they are given by ``tp``, rounding down: ``get_tensor_shapes`` for 1F1B, its own
    ``tensor_shape`` for the interleaved one; so the batch is padded before it is cut into micro-batches). The dense
    model and the MoE equal the HF reference, and a length that does not divide by TP trains as TP x PP without SP
    does, also with VPP=2."""
    paths, refs = weights
    layout, sp = {"tp": 2, "pp": 2}, {"sequence_parallel": True}
    dense, odd, odd_sp, odd_sp_vpp, moe = _megatron(tmp_path, [
        {"model": paths["llama4"], "mesh": layout, "strategy_options": sp},
        {"model": paths["llama4"], "mesh": layout, "length": 11},
        {"model": paths["llama4"], "mesh": layout, "length": 11, "strategy_options": sp},
        {"model": paths["llama4"], "mesh": {**layout, "vpp": 2}, "length": 11, "strategy_options": sp},
        {"model": paths["moe"], "mesh": layout, "strategy_options": sp}], nproc=4, timeout=420)
    _assert_parity(dense, refs["llama4"])
    _assert_parity(moe, refs["moe"])
    _assert_padded_run_matches(odd_sp, odd, length=11)
    _assert_padded_run_matches(odd_sp_vpp, odd, length=11)


@pytest.mark.parity
def test_checkpoint_saved_at_tp2_resumes_at_other_layouts(weights, tmp_path):
    """Optimizer state through dist_checkpointing: TP=2 resumes at TP=2 (bit for bit), DP=2, PP=2 and PP=2 x VPP=2."""
    paths, refs = weights
    out = tmp_path / "reshard.json"
    runs = [{"save": {"tp": 2}, "resume": [{"tp": 2}, {"dp": 2}, {"pp": 2}, {"pp": 2, "vpp": 2}]}]
    job = torchrun([RESHARD, "--model", paths["llama4"], "--ckpt", tmp_path / "ckpt", "--runs", json.dumps(runs),
                    "--out", out], nproc=2, timeout=300)
    assert job.returncode == 0, job.output
    (result,) = json.loads(out.read_text())
    want = result["uninterrupted"]
    same, *others = result["resumed"]
    assert same["losses"] == want, "the same layout resumes bit for bit"
    # three steps after the resume: the layouts reorder the same sums, and over that many steps the HF reference's
    # own reordering spread stays below the rounding bound of one step's loss, which is therefore the tolerance
    reference = refs["llama4"]
    floor = sum_tolerance(TOKENS_PER_STEP, max(want))
    assert spread_tolerance(reference["losses"][:6], reference["reordered"]["losses"][:6], floor=0.0) <= floor
    for run in others:
        assert max_abs_diff(run["losses"], want) <= floor, (run["mesh"], run["losses"], want)
    assert max(abs(a - b) for a, b in zip(result["weights_only"], want)) > 1e-3, \
        "without the optimizer state the run must differ, or this test could not detect a lost state"


def _hf_logits(module) -> torch.Tensor:
    batch = make_batch(99)
    module.eval()
    with torch.no_grad():
        return module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
