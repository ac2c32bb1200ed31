"""The same DPO run gives the same losses on every backend (``scripts/dpo_parity.py``, Python API only).

5 DPO steps (fp32, AdamW, clipping at 1.0) on a tiny Qwen2 saved once as Hugging Face weights, 4 global
pairs a step; every run is compared with the single-process ``TransformersModel`` run:

* ``TransformersModel``, full fine-tuning with ``reference: model`` (a frozen copy) under DDP, FSDP2,
  DeepSpeed ZeRO-2 and ZeRO-3 (2 ranks, gloo, ``DS_ACCELERATOR=cpu``), and ``reference: precomputed`` under
  DDP (against the single run with ``reference: model``: the same reference log-probs, computed before
  training instead of by a frozen copy); LoRA with ``reference: adapter`` under FSDP2;
* ``MultiLoraTransformersModel``: two tenants trained interleaved, one with ``reference: adapter`` and one
  with ``reference: precomputed``, each equal to a single ``TransformersModel`` LoRA run of its adapter;
* ``MegatronModel`` at TP=2 and PP=2 (full fine-tuning, ``reference: model``) and LoRA at TP=2 with
  ``reference: adapter``, against the HF runs from the same weights.

Tolerances (``twinkle_core.testing.tolerance``): 10 x the single-process run's own spread when only its
summation order changes (the same run with every batch's pairs reversed), never below the float32 rounding
floor of the quantity (:func:`loss_floor`, :func:`norm_floor`). Every job runs under a hard timeout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from script_runs import job_output, run_single_process, script_env, script_module

from twinkle_core.testing.tolerance import assert_within_spread, spread_tolerance, sum_tolerance
from twinkle_core.testing.torchrun import run_torchrun

SCRIPT = Path(__file__).resolve().parent / "scripts" / "dpo_parity.py"


DPO = script_module(SCRIPT, "dpo_parity")  # its constants (BETA, PAIRS, STEPS, MAX_GRAD_NORM); imports nothing heavy


#: the single-process references: each also reversed and in float64 (its own float noise)
SINGLE_RUNS = {
    "full": {"reference": "model"},
    "lora_a": {"reference": "adapter", "lora": "lora_a"},
    "lora_b": {"reference": "adapter", "lora": "lora_b"},
}
TENANTS = [{"name": "a", "lora": "lora_a", "reference": "adapter"},
           {"name": "b", "lora": "lora_b", "reference": "precomputed"}]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    """Write the weights, then in one process: every single-process reference, reversed, and the multi-LoRA run."""
    root = tmp_path_factory.mktemp("dpo-parity")
    weights, out = root / "weights", root / "single.json"
    runs = [spec for spec in SINGLE_RUNS.values()
            for spec in (spec, {**spec, "reverse": True}, {**spec, "float64": True})]
    runs.append({"backend": "multi_lora", "tenants": TENANTS})
    result = run_single_process(SCRIPT, ["--init", str(weights), "--weights", str(weights), "--out", str(out),
                              "--runs", json.dumps(runs)], timeout=360)
    assert result.returncode == 0, job_output(result)
    results = json.loads(out.read_text())
    refs = {}
    for i, key in enumerate(SINGLE_RUNS):
        refs[key] = {**results[3 * i], "reordered": results[3 * i + 1], "exact": results[3 * i + 2]}
    print(f"single-process job: {result.seconds:.1f} s")
    return {"weights": str(weights), "root": root, "refs": refs, "multi_lora": results[-1]}


def _torchrun(reference: dict[str, Any], name: str, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = reference["root"] / f"{name}.json"
    job = run_torchrun([SCRIPT, "--weights", reference["weights"], "--out", out, "--runs", json.dumps(runs)],
                       nproc=2, timeout=300, env=script_env())
    assert job.returncode == 0, job.output
    print(f"{name} job: {job.seconds:.1f} s")
    return json.loads(out.read_text())


# ---------------------------------------------------------------------- tolerances
def loss_floor(ref: dict[str, Any], key: str = "losses") -> float:
    """Rounding floor of a step's loss (or ``rewards/*`` metric), as the backends' parity tests take it: the
    bound of a sum over the step's tokens (every sequence token of the global batch) of that magnitude."""
    return sum_tolerance(max(ref["tokens_per_step"]), max(map(abs, ref[key])))


def norm_floor(ref: dict[str, Any]) -> float:
    """Rounding floor of the pre-clip gradient norm: a sum over every trainable parameter."""
    return sum_tolerance(ref["trainable_numel"], max(ref["grad_norms"]))


def assert_same_run(got: dict[str, Any], ref: dict[str, Any], what: str, *, same_code_as_reference: bool = True) -> float:
    """Losses, pre-clip grad norms and the rewards metrics within the reference's own float noise (its distance
    from the reversed run and from the float64 run); returns max |dloss|.

    ``same_code_as_reference=False``: the policy and its reference model score the answers through different code
    (sequence parallelism: the policy's slices in training, the reference's gathered logits in ``forward_only``),
    so the exact tie of step 1 (``h = 0``) becomes float noise either side of 0: its accuracy is not compared."""
    reordered, exact = ref["reordered"], ref["exact"]
    assert len(got["losses"]) == len(ref["losses"]) == DPO.STEPS, (what, got["losses"])
    delta = assert_within_spread(f"{what}: losses", got["losses"], ref["losses"], reordered["losses"],
                                 floor=loss_floor(ref), exact_reference=exact["losses"])
    norm_delta = assert_within_spread(f"{what}: pre-clip grad norms", got["grad_norms"], ref["grad_norms"],
                                      reordered["grad_norms"], floor=norm_floor(ref),
                                      exact_reference=exact["grad_norms"])
    for key in ("margins", "chosen", "rejected"):
        assert_within_spread(f"{what}: rewards/{key}", got[key], ref[key], reordered[key],
                             floor=loss_floor(ref, key), exact_reference=exact[key])
    # a share of 4 pair comparisons: equal unless a pair's margin is within float noise of a tie (the reversed
    # reference would then show it as its own spread). Step 1 of full fine-tuning ties exactly (h = 0): the
    # policy and its frozen copy run the same code on the same weights in every backend
    first = 0 if same_code_as_reference else 1
    assert_within_spread(f"{what}: rewards/accuracies", got["accuracies"][first:], ref["accuracies"][first:],
                         reordered["accuracies"][first:], floor=0.0)
    loss_tolerance = spread_tolerance(ref["losses"], reordered["losses"], floor=loss_floor(ref),
                                      exact_reference=exact["losses"])
    norm_tolerance = spread_tolerance(ref["grad_norms"], reordered["grad_norms"], floor=norm_floor(ref),
                                      exact_reference=exact["grad_norms"])
    print(f"{what}: max |loss - reference| = {delta:.3g} (tolerance {loss_tolerance:.3g}), "
          f"max |grad norm - reference| = {norm_delta:.3g} (tolerance {norm_tolerance:.3g})")
    return delta


# ---------------------------------------------------------------------- the references themselves
@pytest.mark.parity
@pytest.mark.timeout(300)
def test_references_learn_clip_and_see_their_reference(reference):
    full, lora = reference["refs"]["full"], reference["refs"]["lora_a"]
    # full fine-tuning starts at the frozen copy's weights: h = 0 for every pair, loss log 2
    assert full["losses"][0] == pytest.approx(math.log(2), abs=1e-6), full["losses"]
    assert full["accuracies"][0] == 0.0 and full["margins"][0] == 0.0
    # the LoRA runs start with random A and B: the adapter reference (the base) is not the policy
    assert abs(lora["losses"][0] - math.log(2)) > 1e-3, lora["losses"]
    for name, run in reference["refs"].items():
        assert run["losses"][-1] < run["losses"][0] - 0.05, (name, run["losses"])
        assert max(run["grad_norms"]) > DPO.MAX_GRAD_NORM, (name, "no step was clipped", run["grad_norms"])
        assert run["dp_size"] == 1 and run["world_size"] == 1
        assert run["losses"] != run["reordered"]["losses"], \
            f"{name}: reversing the pairs changed nothing; the spread would not measure the float noise"


# ---------------------------------------------------------------------- TransformersModel on 2 ranks
HF_RUNS = {
    "ddp": {"strategy": "ddp", "reference": "model"},
    "native_fsdp": {"strategy": "native_fsdp", "reference": "model"},
    "deepspeed-zero2": {"strategy": "deepspeed", "strategy_options": {"stage": 2}, "mesh": {"dp": 2},
                        "reference": "model"},
    "deepspeed-zero3": {"strategy": "deepspeed", "strategy_options": {"stage": 3}, "mesh": {"dp": 2},
                        "reference": "model"},
    "precomputed-ddp": {"strategy": "ddp", "reference": "precomputed"},
    "lora-native_fsdp": {"strategy": "native_fsdp", "reference": "adapter", "lora": "lora_a"},
}


@pytest.fixture(scope="module")
def hf_runs(reference) -> dict[str, dict[str, Any]]:
    results = _torchrun(reference, "hf", list(HF_RUNS.values()))
    return dict(zip(HF_RUNS, results, strict=True))


@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(600)  # the first test of a module also runs the references
@pytest.mark.parametrize("name", list(HF_RUNS))
def test_transformers_model_on_two_ranks(reference, hf_runs, name):
    run = hf_runs[name]
    assert run["world_size"] == 2 and run["dp_size"] == 2, run
    # precomputed is compared with the frozen-copy run: the same reference log-probs, computed before training
    ref = reference["refs"]["lora_a" if run.get("lora") else "full"]
    assert_same_run(run, ref, name)


# ---------------------------------------------------------------------- sequence parallelism (strategy ulysses)
#: the preference task with each sequence split over 2 ranks (one sequence group: every rank holds all the pairs):
#: Ulysses, ring attention, and a LoRA adapter with its base as the reference
SP_RUNS = {
    "ulysses-sp2": {"strategy": "ulysses", "mesh": {"sp": 2}, "reference": "model"},
    "ring-sp2": {"strategy": "ulysses", "mesh": {"sp": 2}, "strategy_options": {"cp_impl": "ring"},
                 "reference": "model"},
    "lora-ulysses-sp2": {"strategy": "ulysses", "mesh": {"sp": 2}, "reference": "adapter", "lora": "lora_a"},
}


@pytest.fixture(scope="module")
def sp_runs(reference) -> dict[str, dict[str, Any]]:
    results = _torchrun(reference, "sp", list(SP_RUNS.values()))
    return dict(zip(SP_RUNS, results, strict=True))


@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(600)  # the first test of a module also runs the references
@pytest.mark.parametrize("name", list(SP_RUNS))
def test_sequence_parallel_preference_runs_match_one_process(reference, sp_runs, name):
    run = sp_runs[name]
    assert run["world_size"] == 2 and run["dp_size"] == 1, run
    ref = reference["refs"]["lora_a" if run.get("lora") else "full"]
    assert_same_run(run, ref, name, same_code_as_reference=False)


# ---------------------------------------------------------------------- MultiLoraTransformersModel
@pytest.mark.parity
@pytest.mark.timeout(300)
def test_multi_lora_tenants_each_match_a_single_lora_run(reference):
    tenants = reference["multi_lora"]["tenants"]
    assert sorted(tenants) == ["a", "b"]
    for tenant in TENANTS:
        got = tenants[tenant["name"]]
        assert got["reference"] == tenant["reference"]
        assert_same_run(got, reference["refs"][tenant["lora"]], f"multi-LoRA tenant {tenant['name']} "
                                                                f"(reference: {tenant['reference']})")


# ---------------------------------------------------------------------- MegatronModel on 2 ranks
MEGATRON_RUNS = {
    "megatron-tp2": {"backend": "megatron", "mesh": {"tp": 2}, "reference": "model"},
    "megatron-pp2": {"backend": "megatron", "mesh": {"pp": 2}, "reference": "model"},
    "megatron-lora-tp2": {"backend": "megatron", "mesh": {"tp": 2}, "reference": "adapter", "lora": "lora_a"},
}


@pytest.fixture(scope="module")
def megatron_runs(reference) -> dict[str, dict[str, Any]]:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    pytest.importorskip("twinkle_backend_megatron", reason="the Megatron backend is not installed")
    results = _torchrun(reference, "megatron", list(MEGATRON_RUNS.values()))
    return dict(zip(MEGATRON_RUNS, results, strict=True))


@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(600)  # the first test of a module also runs the references
@pytest.mark.parametrize("name", list(MEGATRON_RUNS))
def test_megatron_model_matches_the_hf_backend(reference, megatron_runs, name):
    run = megatron_runs[name]
    assert run["world_size"] == 2, run
    ref = reference["refs"]["lora_a" if run.get("lora") else "full"]
    assert_same_run(run, ref, name)
