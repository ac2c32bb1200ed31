"""Multi-rank tests on CPU (gloo): the conformance suite at TP=2 and DP=2, and cross-backend parity.

Parity: the same tiny Hugging Face weights trained 10 AdamW steps (cosine schedule, clipping at 1.0)
give the same losses, pre-clip gradient norms and final logits on the HF backend (one process) and
on Megatron with TP=2, PP=2 (also with tied embeddings), PP=2 x VPP=2, TP=2 x PP=2 (4 ranks), EP=2
(Qwen3-MoE), DP=2 with the distributed optimizer, and LoRA at TP=2 and PP=2 (fp32; losses within 1e-5).
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
from twinkle_backend_megatron.testing import tiny_llama_config, tiny_qwen2_config

from twinkle_core.testing.conformance import LORA_CONFIG, make_batch
from twinkle_core.testing.torchrun import PASSED_ONLY, pytest_summaries

pytestmark = pytest.mark.distributed

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "scripts", "train_losses.py")
TOL = 1e-5


def _reference(model) -> dict:
    import sys

    sys.path.insert(0, os.path.join(HERE, "scripts"))
    import loop

    return loop.run(model, adapter_name="t" if model._adapters else None)


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
        refs[name] = _reference(TransformersModel(model_id=paths[name]))
    start = TransformersModel(model_id=paths["qwen2"])
    start.add_adapter_to_model("t", {**LORA_CONFIG, "init_lora_weights": False})
    paths["lora"] = start.save("lora", output_dir=str(root), save_optimizer=False)
    hf = TransformersModel(model_id=paths["qwen2"])
    hf.add_adapter_to_model("t", copy.deepcopy(LORA_CONFIG))
    hf.load(paths["lora"], adapter_name="t")
    refs["lora"] = _reference(hf)
    return paths, refs


RESHARD = os.path.join(HERE, "scripts", "reshard.py")


def _megatron(tmp_path, runs: list[dict], nproc: int = 2, timeout: float = 300) -> list[dict]:
    out = tmp_path / "results.json"
    job = torchrun([SCRIPT, "--runs", json.dumps(runs), "--out", out], nproc=nproc, timeout=timeout)
    assert job.returncode == 0, job.output
    return json.loads(out.read_text())


def _assert_parity(got: dict, want: dict, *, norm_rel: float = 1e-4, logits_atol: float = TOL) -> None:
    assert got["losses"] == pytest.approx(want["losses"], abs=TOL), (got["losses"], want["losses"])
    # pre-clip gradient norms: equal up to fp32 rounding (the reduction order differs across shards)
    assert got["norms"] == pytest.approx(want["norms"], rel=norm_rel), (got["norms"], want["norms"])
    torch.testing.assert_close(torch.tensor(got["logits"]), torch.tensor(want["logits"]), atol=logits_atol, rtol=0)


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
                 "test_train_configs_describe_the_run or (test_save_load_round_trip and not adapter)")


# ---------------------------------------------------------------------- cross-backend parity
def test_tensor_parallel_lora_and_distributed_optimizer_parity(weights, tmp_path):
    import peft

    paths, refs = weights
    full, lora, sharded = _megatron(tmp_path, [
        {"model": paths["qwen2"], "mesh": {"tp": 2}},
        {"model": paths["qwen2"], "mesh": {"tp": 2}, "lora": paths["lora"], "save": str(tmp_path)},
        {"model": paths["qwen2"], "mesh": {"dp": 2}, "strategy_options": {"distributed_optimizer": True}}])
    _assert_parity(full, refs["qwen2"])
    _assert_parity(sharded, refs["qwen2"])
    # random A and B (init_lora_weights=False) make the run sensitive: fp32 rounding differences grow to ~1e-4 in
    # the last steps' norms and the final logits even in one process; the losses stay within 1e-5
    _assert_parity(lora, refs["lora"], norm_rel=1e-3, logits_atol=1e-4)
    base = transformers.AutoModelForCausalLM.from_pretrained(paths["qwen2"], dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "trained")).eval()
    torch.testing.assert_close(_hf_logits(loaded), torch.tensor(lora["logits"], dtype=torch.float64), atol=TOL, rtol=0)


def test_pipeline_parallel_parity_errors_and_hf_checkpoint(weights, tmp_path):
    paths, refs = weights
    plain, virtual, tied, lora = _megatron(tmp_path, [
        {"model": paths["qwen2"], "mesh": {"pp": 2}, "pp_errors": True, "save": str(tmp_path)},
        {"model": paths["llama4"], "mesh": {"pp": 2, "vpp": 2}},
        {"model": paths["tied"], "mesh": {"pp": 2}},  # the embedding is shared by the first and last stage
        {"model": paths["qwen2"], "mesh": {"pp": 2}, "lora": paths["lora"]}])
    _assert_parity(plain, refs["qwen2"])
    _assert_parity(virtual, refs["llama4"])
    # the tied matrix sums two gradient contributions (embedding, output) in another order than HF: the final
    # logits drift up to ~2e-5 after 10 steps, also in one process; losses and norms stay within tolerance
    _assert_parity(tied, refs["tied"], logits_atol=5e-5)
    _assert_parity(lora, refs["lora"], norm_rel=1e-3, logits_atol=1e-4)  # see the TP LoRA test
    for method, message in plain["errors"].items():
        assert message and message.startswith("ConfigError") and "forward_backward(inputs=...)" in message, method
    # the checkpoint written from two pipeline stages is one plain HF directory
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype=torch.float32)
    torch.testing.assert_close(_hf_logits(reloaded), torch.tensor(plain["logits"], dtype=torch.float64),
                               atol=TOL, rtol=0)


def test_expert_parallel_moe_parity(weights, tmp_path):
    paths, refs = weights
    (got,) = _megatron(tmp_path, [{"model": paths["moe"], "mesh": {"dp": 2, "ep": 2}}])
    # top-k routing is discontinuous: rounding-level differences move the final logits up to ~2e-5
    _assert_parity(got, refs["moe"], logits_atol=5e-5)


def test_tensor_and_pipeline_parallel_on_four_ranks(weights, tmp_path):
    paths, refs = weights
    (got,) = _megatron(tmp_path, [{"model": paths["llama4"], "mesh": {"tp": 2, "pp": 2}}], nproc=4, timeout=420)
    _assert_parity(got, refs["llama4"])


def test_checkpoint_saved_at_tp2_resumes_at_other_layouts(weights, tmp_path):
    """Optimizer state through dist_checkpointing: TP=2 resumes at TP=2 (bit for bit), DP=2, PP=2 and PP=2 x VPP=2."""
    paths, _ = weights
    out = tmp_path / "reshard.json"
    runs = [{"save": {"tp": 2}, "resume": [{"tp": 2}, {"dp": 2}, {"pp": 2}, {"pp": 2, "vpp": 2}]}]
    job = torchrun([RESHARD, "--model", paths["llama4"], "--ckpt", tmp_path / "ckpt", "--runs", json.dumps(runs),
                    "--out", out], nproc=2, timeout=300)
    assert job.returncode == 0, job.output
    (result,) = json.loads(out.read_text())
    want = result["uninterrupted"]
    same, *others = result["resumed"]
    assert same["losses"] == want, "the same layout resumes bit for bit"
    for run in others:
        assert run["losses"] == pytest.approx(want, abs=TOL, rel=0), run["mesh"]
    assert max(abs(a - b) for a, b in zip(result["weights_only"], want)) > 1e-3, \
        "without the optimizer state the run must differ, or this test could not detect a lost state"


def _hf_logits(module) -> torch.Tensor:
    batch = make_batch(99)
    module.eval()
    with torch.no_grad():
        return module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
