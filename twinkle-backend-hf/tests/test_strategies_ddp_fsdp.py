"""DDP, FSDP2 and Accelerate strategies on 2 CPU ranks (gloo): conformance, loss parity, checkpoints.

Every multi-process test launches torchrun through ``distributed.run_torchrun`` with a hard timeout.
The parity runs (``scripts/parity.py``) are shared: each configuration runs at most once per module,
only when a test needs it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from distributed import PASSED_ONLY, pytest_summaries, run_torchrun
from parity_helpers import ParityRuns
from twinkle_backend_hf.testing import tiny_qwen2_config

from twinkle_core.testing.tolerance import forward_tolerance


# ---------------------------------------------------------------------- conformance
@pytest.mark.distributed
@pytest.mark.timeout(660)
@pytest.mark.parametrize("target", ["hf-ddp", "hf-fsdp"])
def test_conformance_suite_on_two_ranks(target, tmp_path):
    """The core's suite, unchanged, with every rank running every test (resume, adapters, clipping ...)."""
    result = run_torchrun(["-m", "pytest", "--pyargs", "twinkle_core.testing.conformance", "--twinkle-backend", target,
                           "-p", "no:cacheprovider", "-q"], nproc=2, timeout=600, cwd=str(tmp_path), per_rank_output=True)
    assert result.returncode == 0, result.output
    summaries = pytest_summaries(result)
    assert all(PASSED_ONLY.fullmatch(line) for line in summaries), \
        f"expected every test to pass on each rank, got {summaries}\n{result.output}"
    print(f"{target}: {summaries[0]} on each rank, in {result.seconds:.0f} s")


# ---------------------------------------------------------------------- parity runs
class StrategyRuns(ParityRuns):
    """The DDP, FSDP2 and Accelerate parity runs."""

    def ddp(self) -> dict[str, Any]:
        return self.get("ddp", "--strategy", "ddp")

    def fsdp(self) -> dict[str, Any]:
        return self.get("native_fsdp", "--strategy", "native_fsdp", "--save-dir", str(self.root / "fsdp-ckpt"))

    def accelerate(self) -> dict[str, Any]:
        return self.get("accelerate", "--spec", json.dumps({"strategy": "accelerate"}))


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> StrategyRuns:
    return StrategyRuns(tmp_path_factory.mktemp("parity"))


@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(660)
@pytest.mark.parametrize("strategy", ["ddp", "native_fsdp"])
def test_loss_parity_with_one_process(parity, strategy):
    """10 AdamW steps, accumulation 2, clipping: 2 ranks give the single process's losses within the reference's own float spread."""
    reference = parity.single()
    assert reference["world_size"] == 1 and reference["dp_size"] == 1
    assert reference["losses"][-1] < reference["losses"][0] - 0.5, f"the model did not learn: {reference['losses']}"
    assert max(reference["grad_norms"]) > 1.0, "no step was clipped: the parity run would not cover clipping"
    run = parity.ddp() if strategy == "ddp" else parity.fsdp()
    assert run["world_size"] == 2 and run["dp_size"] == 2, run
    delta = parity.assert_matches_single(run, strategy)
    print(f"{strategy}: max |loss - single| = {delta:.3g}")


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_ddp_replicates_and_fsdp_shards(parity):
    ddp, fsdp = parity.ddp(), parity.fsdp()
    assert ddp["wrapped_class"] == "DistributedDataParallel" and ddp["dtensor_parameters"] == 0
    assert ddp["local_numel"] == ddp["global_numel"]
    assert fsdp["dtensor_parameters"] == fsdp["parameters"] > 0, fsdp
    assert fsdp["local_numel"] * 2 == pytest.approx(fsdp["global_numel"], rel=0.05), "each rank should hold ~half"


# ---------------------------------------------------------------------- FSDP2 checkpoint
@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_fsdp_checkpoint_loads_with_plain_transformers(parity):
    """A checkpoint saved under FSDP2 is ordinary safetensors: from_pretrained gives the sharded model's logits."""
    import torch
    import transformers

    run = parity.fsdp()
    path = Path(run["saved"])
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    dcp_dir = path / "twinkle_state" / "optimizer_dcp"
    assert (dcp_dir / ".metadata").is_file(), "optimizer state should be a sharded DCP checkpoint"
    assert len(list(dcp_dir.glob("*.distcp"))) == 2, "each rank writes its optimizer shard"
    expected = torch.load(parity.root / "native_fsdp.json.logits.pt")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        ids = expected["input_ids"]
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    config = tiny_qwen2_config()
    tolerance = forward_tolerance(float(expected["logits"].abs().max()), depth=config["num_hidden_layers"],
                                  width=max(config["hidden_size"], config["intermediate_size"]))
    torch.testing.assert_close(logits, expected["logits"], atol=tolerance, rtol=0)


# ---------------------------------------------------------------------- Accelerate on CPU
@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_accelerate_on_cpu_delegates_to_native_fsdp_and_shards(parity):
    run = parity.accelerate()
    assert run["strategy_class"].endswith(":AccelerateStrategy")
    assert run["strategy_config"]["delegated_to"] == "native_fsdp"
    assert run["dtensor_parameters"] == run["parameters"] > 0, "the delegated model must really be sharded"
    assert run["local_numel"] < run["global_numel"]
    log = parity.logs["accelerate"]
    assert "Twinkle delegates to 'native_fsdp'" in log and "on CPU" in log, log[-3000:]
    parity.assert_matches_single(run, "accelerate (delegated)")


# ---------------------------------------------------------------------- in-process checks (no process group)
def test_accelerate_strict_refuses_on_cpu_before_joining():
    from twinkle_backend_hf.strategies.accelerate import AccelerateStrategy

    from twinkle_core.accelerator import CPUAccelerator
    from twinkle_core.errors import UnsupportedHardwareError

    with pytest.raises(UnsupportedHardwareError, match=r"strict=True.*on CPU.*native_fsdp"):
        AccelerateStrategy(strict=True).setup(CPUAccelerator())


def test_unknown_options_and_unsupported_mesh_dimensions_are_clear_errors():
    from twinkle_backend_hf.strategies.ddp import DDPStrategy
    from twinkle_backend_hf.strategies.fsdp import NativeFSDPStrategy

    from twinkle_core.capabilities import check_mesh
    from twinkle_core.errors import ConfigError
    from twinkle_core.mesh import DeviceMesh

    with pytest.raises(ConfigError, match="find_unused_parameters"):
        DDPStrategy(find_unused=True)
    with pytest.raises(ConfigError, match="reshard_after_forward"):
        NativeFSDPStrategy(reshard=True)
    with pytest.raises(ConfigError, match="tp=2"):
        check_mesh("ddp", DeviceMesh(dp=2, tp=2), ("dp",))
    with pytest.raises(ConfigError, match="fsdp=2"):
        check_mesh("ddp", DeviceMesh(fsdp=2), ("dp",))
    check_mesh("native_fsdp", DeviceMesh(dp=2, fsdp=2), ("dp", "fsdp"))


def test_transformer_blocks_are_found_through_peft_and_without_no_split_modules():
    import copy

    import torch
    from twinkle_backend_hf.strategies.model_parts import transformer_blocks
    from twinkle_backend_hf.testing import make_tiny_model

    from twinkle_core.testing.conformance import LORA_CONFIG

    model = make_tiny_model()
    assert [type(b).__name__ for b in transformer_blocks(model.module)] == ["Qwen2DecoderLayer"] * 2
    model.add_adapter_to_model("a", copy.deepcopy(LORA_CONFIG))
    assert [type(b).__name__ for b in transformer_blocks(model.module)] == ["Qwen2DecoderLayer"] * 2
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 3))
    assert len(transformer_blocks(plain)) == 3
