"""Reward models and GKD distillation on 2 ranks are the single-process run (issue 24): DDP, FSDP2, Megatron TP=2.

Every run is ``scripts/post_training_dist.py``: the ``reward_model`` or ``gkd`` task through the trainer
(``Trainer.run``, what ``twinkle train`` runs), 3 AdamW steps of 4 global rows (fp32, clipping at 1.0) of a tiny
Qwen2 (hidden 32, 2 layers, the quickstart tokenizer). It reads the losses and gradient norms from the trainer's
``logs.jsonl`` and saves the final ``model.get_state_dict()``.

* ``reward_model`` (Bradley–Terry, a one-score head) and ``gkd`` with ``lmbda`` 0 (the data's answers) and 1 (the
  student's seeded samples), on 2 ranks (``ddp``, ``native_fsdp``; ``data.batch_size`` 2: each rank half the
  pairs or chats) against one process (``data.batch_size`` 4): losses, gradient norms and final weights (the
  score head included) within the reference's spread. ``lmbda`` 1 holds only because a row's completion is
  seeded by its index in the data set, not by its place in the rank's batch;
* ``gkd`` on ``MegatronModel`` at TP=2 (student and teacher sibling both Megatron, the logits gathered over the
  TP ranks) against the HF single process from the same saved weights; ``reward_model`` on Megatron is refused
  before anything is built, naming the model kind and the classes that build it.

Tolerances (``twinkle_core.testing.tolerance``): within 10 x the reference's own spread (the same run with every
batch's rows reversed) and never below the rounding floor of the quantity, plus the 6 significant digits the log
lines keep. One single-process job and one torchrun job per backend, each well under a minute.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from script_runs import job_output, run_single_process, script_env, script_module

from twinkle_core.testing.tolerance import (
    assert_within_spread,
    forward_tolerance,
    max_abs_diff,
    sum_tolerance,
    unit_roundoff,
)
from twinkle_core.testing.torchrun import run_torchrun

SCRIPT = Path(__file__).resolve().parent / "scripts" / "post_training_dist.py"
POST = script_module(SCRIPT, "post_training_dist_constants")  # STEPS, ROWS_PER_STEP ...; imports nothing heavy
MAX_LENGTH = 48  # the script's data.max_length: the most tokens of a row

Run = dict[str, Any]

#: the single-process references, each followed by itself with every batch's rows reversed (its spread)
SINGLE_RUNS = {
    "reward_model": {"task": "reward_model"},
    "gkd": {"task": "gkd", "lmbda": 0.0},
    "gkd-on-policy": {"task": "gkd", "lmbda": 1.0},
    "gkd-weights": {"task": "gkd", "lmbda": 0.0, "weights": True},  # from the saved HF weights: Megatron's reference
}
DIST_RUNS = {(strategy, name): {**SINGLE_RUNS[name], "strategy": strategy}
             for strategy in ("ddp", "native_fsdp") for name in ("reward_model", "gkd", "gkd-on-policy")}
MEGATRON_RUNS = {"gkd": {"task": "gkd", "lmbda": 0.0, "backend": "megatron", "mesh": {"tp": 2}},
                 "reward_model": {"task": "reward_model", "backend": "megatron", "mesh": {"tp": 2}}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    """Write the data and weights, then every single-process reference and its reversed twin in one job."""
    root = tmp_path_factory.mktemp("post-training-dist")
    init, out = root / "init", root / "single.json"
    runs = [spec for spec in SINGLE_RUNS.values() for spec in (spec, {**spec, "reverse": True})]
    result = run_single_process(SCRIPT, ["--init", str(init), "--out", str(out), "--runs", json.dumps(runs)],
                                timeout=120)
    assert result.returncode == 0, job_output(result)
    results = json.loads(out.read_text())
    refs = {key: {**results[2 * i], "reordered": results[2 * i + 1]} for i, key in enumerate(SINGLE_RUNS)}
    print(f"single-process job: {result.seconds:.1f} s")
    return {"init": str(init), "root": root, "refs": refs}


def torchrun_job(reference: dict[str, Any], name: str, runs: dict[Any, Run]) -> dict[Any, Run]:
    out = reference["root"] / f"{name}.json"
    job = run_torchrun([SCRIPT, "--init", reference["init"], "--out", out, "--runs", json.dumps(list(runs.values()))],
                       nproc=2, timeout=120, env=script_env())
    print(f"{name} job: {job.seconds:.1f} s")
    assert job.returncode == 0, job.output
    return dict(zip(runs, json.loads(out.read_text()), strict=True))


@pytest.fixture(scope="module")
def hf_runs(reference) -> dict[tuple[str, str], Run]:
    return torchrun_job(reference, "hf", DIST_RUNS)


@pytest.fixture(scope="module")
def megatron_runs(reference) -> dict[str, Run]:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    pytest.importorskip("twinkle_backend_megatron", reason="the Megatron backend is not installed")
    return torchrun_job(reference, "megatron", MEGATRON_RUNS)


# ---------------------------------------------------------------------- reading the records
def logged(run: Run, key: str) -> list[float]:
    lines = run["logs"]
    assert [line["step"] for line in lines] == list(range(1, POST.STEPS + 1)), lines
    return [float(line[key]) for line in lines]


def state(run: Run) -> dict[str, torch.Tensor]:
    return torch.load(run["weights"])


def weights(run: Run) -> torch.Tensor:
    """The final weights as one vector, parameters in name order (so two runs' vectors line up)."""
    tensors = state(run)
    return torch.cat([tensors[name].flatten() for name in sorted(tensors)])


def model_config(reference: dict[str, Any]) -> dict[str, Any]:
    return json.loads((Path(reference["init"]) / "student" / "config.json").read_text())


# ---------------------------------------------------------------------- tolerances
def log_rounding(values: list[float]) -> float:
    """Half a unit of the 6th significant digit of the largest logged value: what ``logs.jsonl`` drops."""
    top = max((abs(v) for v in values if v), default=0.0)
    return 0.5 * 10 ** (math.floor(math.log10(top)) - 5) if top else 0.0


def loss_floor(ref: Run, config: dict[str, Any]) -> float:
    """One forward's rounding (its widest sum: the vocabulary or the MLP), then a step's sum over its rows' tokens."""
    losses = logged(ref, "loss")
    top = max(map(abs, losses))
    forward = forward_tolerance(top, width=max(config["vocab_size"], config["intermediate_size"]),
                                depth=config["num_hidden_layers"])
    return forward + sum_tolerance(POST.ROWS_PER_STEP * MAX_LENGTH, top) + 2 * log_rounding(losses)


def norm_floor(ref: Run) -> float:
    """The pre-clip gradient norm is a sum over every trainable parameter."""
    norms = logged(ref, "grad_norm")
    return sum_tolerance(weights(ref).numel(), max(norms)) + 2 * log_rounding(norms)


def weight_floor(ref: Run) -> float:
    """Each optimizer step rounds every weight once, in each of the two runs."""
    return POST.STEPS * 2 * unit_roundoff(torch.float32) * float(weights(ref).abs().max())


def assert_reversal_is_float_noise(ref: Run, what: str, config: dict[str, Any]) -> None:
    """The reversed twin only reorders sums: its losses within the loss's rounding floor. Otherwise a row's result
    depends on its place in the batch (a sample seeded by that place), the spread is no float noise and would hide
    a 2-rank run that dealt the rows differently."""
    spread = max_abs_diff(logged(ref, "loss"), logged(ref["reordered"], "loss"))
    assert spread <= loss_floor(ref, config), f"{what}: reversing the reference's rows moved its losses by " \
                                              f"{spread:.3g}: a row's result depends on its place in the batch"


def assert_same_training(got: Run, ref: Run, what: str, config: dict[str, Any]) -> dict[str, float]:
    """Losses, pre-clip gradient norms and final weights within the reference's spread and their floors."""
    reordered = ref["reordered"]
    assert_reversal_is_float_noise(ref, what, config)
    deltas = {key: assert_within_spread(f"{what}: {key}", logged(got, key), logged(ref, key), logged(reordered, key),
                                        floor=floor)
              for key, floor in (("loss", loss_floor(ref, config)), ("grad_norm", norm_floor(ref)))}
    assert sorted(state(got)) == sorted(state(ref)), f"{what}: other parameters"
    deltas["weights"] = assert_within_spread(f"{what}: final weights", weights(got), weights(ref), weights(reordered),
                                             floor=weight_floor(ref))
    print(f"{what}: " + ", ".join(f"max |d {k}| = {v:.3g}" for k, v in deltas.items())
          + f" (the reference's own weight spread {max_abs_diff(weights(ref), weights(reordered)):.3g})")
    return deltas


# ---------------------------------------------------------------------- the references themselves
@pytest.mark.parity
@pytest.mark.timeout(180)
def test_references_learn_and_measure_their_own_spread(reference):
    for name, ref in reference["refs"].items():
        assert ref["dp_size"] == ref["world_size"] == 1, name
        norms = logged(ref, "grad_norm")
        assert min(norms) > 1e-3, f"{name}: the gradients carry no signal {norms}"
        spread = max_abs_diff(weights(ref), weights(ref["reordered"]))
        assert spread < 1e-3, f"{name}: reversing the rows moved the weights by {spread:.3g}; not float noise"
        assert_reversal_is_float_noise(ref, name, model_config(reference))
        if name.startswith("gkd"):
            assert [line["on_policy_fraction"] for line in ref["logs"]] == [ref["spec"]["lmbda"]] * POST.STEPS
    losses = logged(reference["refs"]["reward_model"], "loss")
    assert losses[0] == pytest.approx(math.log(2), abs=0.05) and losses[-1] < losses[0], losses  # it learns
    score = state(reference["refs"]["reward_model"])["score.weight"]
    assert score.shape[0] == 1, f"the reward model's head has {score.shape[0]} outputs, not one score"


# ---------------------------------------------------------------------- 2 ranks against one process
@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "native_fsdp"])
@pytest.mark.parametrize("name", ["reward_model", "gkd", "gkd-on-policy"])
def test_two_ranks_train_as_one_process(reference, hf_runs, strategy, name):
    run, ref = hf_runs[(strategy, name)], reference["refs"][name]
    assert run["dp_size"] == run["world_size"] == 2, run  # data.batch_size 2: each rank half the global rows
    assert_same_training(run, ref, f"{strategy} {name}", model_config(reference))
    if name == "reward_model":  # the one-score head itself, named (it is inside the weights compared above)
        head = [state(r)["score.weight"] for r in (run, ref, ref["reordered"])]
        assert_within_spread(f"{strategy}: score head", *head, floor=weight_floor(ref))


# ---------------------------------------------------------------------- Megatron TP=2
@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_megatron_tp2_distils_as_hf_and_refuses_the_reward_model_naming_why(reference, megatron_runs):
    run = megatron_runs["gkd"]
    assert "error" not in run, run["error"]
    assert run["dp_size"] == 1 and run["world_size"] == 2, run
    assert_same_training(run, reference["refs"]["gkd-weights"], "megatron tp2 gkd", model_config(reference))
    refusal = megatron_runs["reward_model"].get("error") or ""
    assert "model_kind 'sequence_score'" in refusal and "MegatronModel does not build" in refusal, refusal
    assert "TransformersModel" in refusal, refusal  # the fix: a model class that builds it
