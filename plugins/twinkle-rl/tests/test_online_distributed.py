"""Online RL on several ranks is the single-process run: GRPO, REINFORCE++, PPO (learned critic, GAE) and
multi-turn agent rollouts under DDP and FSDP2, Megatron TP=2.

Every run is ``scripts/online_dist.py``: the ``grpo`` task through the trainer (``Trainer.run``), 2 rollouts of
4 global prompts x 4 completions, each trained for 2 PPO epochs (4 AdamW steps, fp32, clipping at 1.0), the
reward the share of letters in a completion. The script records every rollout by wrapping
``RolloutEngine.run`` (the prompts drawn, each group's rewards, advantages, tokens and log-probs), reads the
losses and gradient norms from the trainer's ``logs.jsonl`` and saves the final ``model.get_state_dict()``.

* 2 ranks (``ddp``, ``native_fsdp``; ``data.batch_size`` 2) against one process (``data.batch_size`` 4): the
  loader deals each global batch round-robin, so the ranks hold the same 4 prompts; every completion is
  seeded by its prompt, so every prompt gets the same completions, advantages (GRPO, and REINFORCE++ whose
  batch normalisation is an all-reduce), then the same losses, gradient norms and weights;
* each prompt's group of 4 completions is sampled, scored and normalised on one rank, never across two;
* the ``ppo`` task (``task_options.critic``): the critic's values, the GAE returns and the advantages whitened
  over every rank's completion tokens, per completion token, and the critic's logged loss; the critic is a
  sibling model with a value head, which must train without dropout (transformers' token-classification heads
  default to 0.1: its trained values then differ from the eval-mode values of the rollout, and depend on the
  random state, so on the layout);
* multi-turn agent rollouts (``task_options.environment``) on arithmetic prompts: the bundled ``calculator`` (an
  untrained model answers in one turn) and the script's ``Counting`` environment, which answers a prompt's
  trajectories up to twice (turns differ between prompts, so between ranks): every turn is seeded by rollout,
  prompt, trajectory and turn, so the completions with their environment tokens are the same; the logged turn,
  tool-call and environment-reward values are sums over every rank; also with the ``ppo`` task;
* a DDP run resumed from a mid-rollout checkpoint continues as the uninterrupted run (every rank resumes its
  own share of the rollout queue: the trainer gathers ``task.state_dict()`` of every rank into the checkpoint);
* the ``vlm_grpo`` task (where twinkle-vlm is installed): prompts that show pictures on a tiny Qwen2.5-VL, every
  part trained, each rank sampling and training its prompts with their pictures and 3-D positions (FSDP2: the
  vision tower's prefill is a collective of every rank too);
* ``MegatronModel`` at TP=2 with ``hf_generate`` ``copy_weights: true`` (it samples with its own HF copy of the
  gathered weights) against a single-process ``TransformersModel`` sampling in process, from the same saved
  HF weights, built by the trainer like any model class.

Tolerances (``twinkle_core.testing.tolerance``): completions and GRPO advantages exactly (the same tokens
give the same rewards); REINFORCE++ advantages within the float64 rounding bound of their global moments
(:func:`reinforce_pp_tolerance`); log-probs, losses, gradient norms and weights within 10 x the reference's
own spread (the same run with every draw's prompts reversed) and never below the rounding floor of the
quantity, plus the 6 significant digits the log lines keep. One single-process job and one torchrun job per
backend, each well under a minute.
"""

from __future__ import annotations

import importlib.util
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
from twinkle_core.testing.torchrun import TorchrunResult, run_torchrun

SCRIPT = Path(__file__).resolve().parent / "scripts" / "online_dist.py"


ONLINE = script_module(SCRIPT, "online_dist_constants")  # its constants (PROMPTS_PER_STEP, NUM_GENERATIONS ...); imports nothing heavy

Run = dict[str, Any]


# ---------------------------------------------------------------------- the jobs
#: the single-process references, each followed by itself with every draw's prompts reversed (its spread)
SINGLE_RUNS = {
    "grpo": {"strategy": "single"},
    "reinforce_pp": {"strategy": "single", "advantage": "reinforce_pp"},
    "hf_weights": {"strategy": "single", "weights": True},  # from the saved HF weights: Megatron's reference
    "ppo": {"strategy": "single", "task": "ppo"},  # a learned critic, GAE whitened over every rank's tokens
    # multi-turn agent RL on arithmetic prompts: the bundled calculator (one turn from an untrained model), and
    # the script's Counting environment, which answers: trajectories of 1 to 3 turns with untrained tokens between
    "calculator": {"strategy": "single", "environment": "calculator"},
    "agent": {"strategy": "single", "environment": "online_dist:Counting"},
    "ppo_agent": {"strategy": "single", "task": "ppo", "environment": "online_dist:Counting"},
    # the vlm_grpo task: prompts that show pictures, a tiny Qwen2.5-VL (3-D positions, vision tower, projector)
    **({"vlm": {"strategy": "single", "vlm": True}} if importlib.util.find_spec("twinkle_vlm") else {}),
}
#: the runs of the ppo task (their rollouts also record the critic's GAE)
PPO_KEYS = ("ppo", "ppo_agent")
#: the runs with an environment, and the log values the agent rollouts add
AGENT_KEYS = ("calculator", "agent", "ppo_agent")
#: the runs on pictures (where twinkle-vlm is installed)
VLM_KEYS = tuple(key for key in ("vlm",) if key in SINGLE_RUNS)
#: counts and exact sums over every rank's trajectories (rewards in halves, so any order sums them exactly)
AGENT_LOG_KEYS = ("turns_mean", "tool_calls_mean", "tool_call_errors", "env_timeouts", "env_errors",
                  "reward/environment")
DIST_RUNS = {
    ("ddp", "grpo"): {"strategy": "ddp"},
    ("native_fsdp", "grpo"): {"strategy": "native_fsdp"},
    ("ddp", "reinforce_pp"): {"strategy": "ddp", "advantage": "reinforce_pp"},
    ("native_fsdp", "reinforce_pp"): {"strategy": "native_fsdp", "advantage": "reinforce_pp"},
    # checkpoint-1 is mid-rollout: the queue holds the rollout's second PPO epoch, a share of it on each rank
    ("ddp", "grpo-resumed"): {"strategy": "ddp", "resume_at": 1},
    **{(strategy, key): {**SINGLE_RUNS[key], "strategy": strategy}
       for key in ("ppo", *AGENT_KEYS, *VLM_KEYS) for strategy in ("ddp", "native_fsdp")},
}
RESUME_AT = 1
MEGATRON_RUN = {"backend": "megatron", "mesh": {"tp": 2}, "copy_weights": True}
#: the Megatron runs and the single-process reference each is compared with: text from the saved HF weights, and
#: the vlm_grpo task (a Megatron Qwen2.5-VL whose sampler copy is a transformers Qwen2.5-VL)
MEGATRON_RUNS = {"hf_weights": MEGATRON_RUN, **{key: {**MEGATRON_RUN, "vlm": True} for key in VLM_KEYS}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    """Write the prompts and weights, then every single-process reference and its reversed twin in one job."""
    root = tmp_path_factory.mktemp("online-dist")
    init, out = root / "init", root / "single.json"
    runs = [spec for spec in SINGLE_RUNS.values() for spec in (spec, {**spec, "reverse": True})]
    result = run_single_process(SCRIPT, ["--init", str(init), "--out", str(out), "--runs", json.dumps(runs)], timeout=120)
    assert result.returncode == 0, job_output(result)
    results = json.loads(out.read_text())
    refs = {key: {**results[2 * i], "reordered": results[2 * i + 1]} for i, key in enumerate(SINGLE_RUNS)}
    print(f"single-process job: {result.seconds:.1f} s")
    return {"init": str(init), "root": root, "refs": refs}


def _torchrun(reference: dict[str, Any], name: str, runs: list[dict[str, Any]]) -> tuple[TorchrunResult, Path]:
    out = reference["root"] / f"{name}.json"
    job = run_torchrun([SCRIPT, "--init", reference["init"], "--out", out, "--runs", json.dumps(runs)],
                       nproc=2, timeout=150, env=script_env())
    print(f"{name} job: {job.seconds:.1f} s")
    return job, out


@pytest.fixture(scope="module")
def hf_runs(reference) -> dict[tuple[str, str], Run]:
    job, out = _torchrun(reference, "hf", list(DIST_RUNS.values()))
    assert job.returncode == 0, job.output
    return dict(zip(DIST_RUNS, json.loads(out.read_text()), strict=True))


# ---------------------------------------------------------------------- reading the records
def groups_by_prompt(run: Run, *, rank: int | None = None) -> dict[tuple[int, int], dict[str, Any]]:
    """``(rollout, prompt index) -> {rank, rewards, advantages, tokens, logprobs}`` over the run's ranks."""
    groups: dict[tuple[int, int], dict[str, Any]] = {}
    for r, records in enumerate(run["rollouts"]):
        if rank is not None and r != rank:
            continue
        for record in records:
            for g, prompt in enumerate(record["prompts"]):
                key = (record["rollout"], prompt)
                assert key not in groups, f"prompt {prompt} of rollout {record['rollout']} is on ranks " \
                                          f"{groups[key]['rank']} and {r}"
                groups[key] = {"rank": r, **{k: record[k][g] for k in ("rewards", "advantages", "tokens",
                                                                        "logprobs")}}
    return groups


def gae_by_prompt(run: Run) -> dict[tuple[int, int], list[dict[str, list[float]]]]:
    """``(rollout, prompt index) -> [{advantages, returns, old_values}]`` per completion (a ppo run's GAE)."""
    return {(record["rollout"], prompt): record["gae"][g]
            for records in run["rollouts"] for record in records for g, prompt in enumerate(record["prompts"])}


def gae_values(run: Run, keys: list[tuple[int, int]], field: str) -> list[float]:
    """One GAE quantity of every completion token, in the order of ``keys``."""
    groups = gae_by_prompt(run)
    return [x for key in keys for row in groups[key] for x in row[field]]


def logprobs_of(run: Run, keys: list[tuple[int, int]], **kw: Any) -> list[float]:
    """Every completion token's log-prob, in the order of ``keys`` (so two runs' lists line up)."""
    groups = groups_by_prompt(run, **kw)
    return [lp for key in keys for sample in groups[key]["logprobs"] for lp in sample]


def logged(run: Run, key: str) -> list[float]:
    lines = run["logs"]
    assert [line["step"] for line in lines] == list(range(1, ONLINE.STEPS + 1)), lines
    return [float(line[key]) for line in lines]


def weights(run: Run) -> torch.Tensor:
    """The final weights as one vector, parameters in name order (so two runs' vectors line up)."""
    state = torch.load(run["weights"])
    return torch.cat([state[name].flatten() for name in sorted(state)])


def weight_names(run: Run) -> list[str]:
    return sorted(torch.load(run["weights"]))


def model_config(reference: dict[str, Any], name: str = "grpo") -> dict[str, Any]:
    """The widths and depth the tolerances read: the tiny Qwen2's, or for the vlm runs the tiny Qwen2.5-VL's
    language model with the vision tower's blocks added to its depth."""
    if name not in VLM_KEYS:
        return json.loads((Path(reference["init"]) / "hf" / "config.json").read_text())
    config = json.loads((Path(reference["init"]) / "vlm" / "config.json").read_text())
    text = config["text_config"]
    return {**text, "num_hidden_layers": text["num_hidden_layers"] + config["vision_config"]["depth"]}


# ---------------------------------------------------------------------- tolerances
def log_rounding(values: list[float]) -> float:
    """Half a unit of the 6th significant digit of the largest logged value: what ``logs.jsonl`` drops."""
    top = max((abs(v) for v in values if v), default=0.0)
    return 0.5 * 10 ** (math.floor(math.log10(top)) - 5) if top else 0.0


def completion_tokens_per_step(ref: Run) -> int:
    """The most completion tokens of one rollout (every step trains on a whole rollout)."""
    return max(sum(len(sample) for key, group in groups_by_prompt(ref).items() if key[0] == rollout
                   for sample in group["tokens"]) for rollout in range(ONLINE.ROLLOUTS))


def logprob_floor(ref: Run, config: dict[str, Any]) -> float:
    """One forward's rounding at the log-probs' magnitude: the log-softmax over the vocabulary is the widest sum."""
    lps = [abs(lp) for g in groups_by_prompt(ref).values() for s in g["logprobs"] for lp in s]
    return forward_tolerance(max(lps), width=max(config["vocab_size"], config["intermediate_size"]),
                             depth=config["num_hidden_layers"])


def loss_floor(ref: Run) -> float:
    """A step's loss is a sum over the step's completion tokens (as the DPO parity tests take it), then logged."""
    losses = logged(ref, "loss")
    return sum_tolerance(completion_tokens_per_step(ref), max(map(abs, losses))) + 2 * log_rounding(losses)


def critic_loss_floor(ref: Run) -> float:
    """The critic's loss is a sum over the step's completion tokens too."""
    losses = logged(ref, "critic/loss")
    return sum_tolerance(completion_tokens_per_step(ref), max(map(abs, losses))) + 2 * log_rounding(losses)


def gae_floor(ref: Run, config: dict[str, Any], field: str) -> float:
    """The critic's values are one forward's output; GAE adds up to a completion's length of value differences
    into a return, and whitening divides those by a sum over every completion token of the rollout."""
    keys = sorted(gae_by_prompt(ref))
    values = gae_values(ref, keys, field)
    one = forward_tolerance(max(map(abs, values)), width=max(config["vocab_size"], config["intermediate_size"]),
                            depth=config["num_hidden_layers"])
    if field == "old_values":
        return one
    longest = max(len(row[field]) for group in gae_by_prompt(ref).values() for row in group)
    return longest * one + sum_tolerance(len(values), max(map(abs, values)))


def norm_floor(ref: Run) -> float:
    """The pre-clip gradient norm is a sum over every trainable parameter."""
    norms = logged(ref, "grad_norm")
    numel = weights(ref).numel()
    return sum_tolerance(numel, max(norms)) + 2 * log_rounding(norms)


def weight_floor(ref: Run) -> float:
    """Each optimizer step rounds every weight once, in each of the two runs."""
    top = float(weights(ref).abs().max())
    return ONLINE.STEPS * 2 * unit_roundoff(torch.float32) * top


def reinforce_pp_tolerance(rewards: list[float]) -> float:
    """How far REINFORCE++'s ``(r - mean) / std`` over ``N`` rewards may move when the global sums of ``r`` and
    ``r^2`` are added in another order (ranks, then all-reduce), in float64.

    ``d mean <= s(N, mean|r|)``; ``d var <= s(N, mean r^2) + 2 |mean| d mean``, ``d std = d var / (2 std)``;
    ``d A <= d mean / std + max|A| d std / std`` plus the final division's rounding, ``s`` :func:`sum_tolerance`."""
    r = torch.tensor(rewards, dtype=torch.float64)
    n, mean = r.numel(), float(r.mean())
    std = float(r.std(unbiased=False))
    advantages = (r - mean) / std
    d_mean = sum_tolerance(n, float(r.abs().mean()), torch.float64)
    d_var = sum_tolerance(n, float((r * r).mean()), torch.float64) + 2 * abs(mean) * d_mean
    d_std = d_var / (2 * std)
    top = float(advantages.abs().max())
    return d_mean / std + top * d_std / std + 4 * unit_roundoff(torch.float64) * top


# ---------------------------------------------------------------------- shared assertions
def assert_same_rollouts(got: Run, ref: Run, what: str, config: dict[str, Any], *, rank: int | None = None) -> float:
    """The same prompts per rollout, the same completions and rewards; log-probs within spread. Returns max |dlp|."""
    mine, theirs = groups_by_prompt(got, rank=rank), groups_by_prompt(ref)
    assert sorted(mine) == sorted(theirs), f"{what}: the rollouts hold other prompts"
    for key, group in theirs.items():
        assert mine[key]["tokens"] == group["tokens"], f"{what}: completions of prompt {key[1]}, rollout {key[0]}"
        assert mine[key]["rewards"] == group["rewards"], f"{what}: rewards of prompt {key[1]}, rollout {key[0]}"
    keys = sorted(theirs)
    return assert_within_spread(f"{what}: completion log-probs", logprobs_of(got, keys, rank=rank),
                                logprobs_of(ref, keys), logprobs_of(ref["reordered"], keys),
                                floor=logprob_floor(ref, config))


def assert_same_training(got: Run, ref: Run, what: str) -> dict[str, float]:
    """Losses, pre-clip gradient norms and final weights within the reference's spread and their floors."""
    reordered = ref["reordered"]
    deltas = {"loss": assert_within_spread(f"{what}: losses", logged(got, "loss"), logged(ref, "loss"),
                                           logged(reordered, "loss"), floor=loss_floor(ref)),
              "grad_norm": assert_within_spread(f"{what}: grad norms", logged(got, "grad_norm"),
                                                logged(ref, "grad_norm"), logged(reordered, "grad_norm"),
                                                floor=norm_floor(ref))}
    for line, ref_line in zip(got["logs"], ref["logs"], strict=True):  # agent rollouts: sums over every rank
        for key in AGENT_LOG_KEYS:
            if key in ref_line:
                assert line.get(key) == ref_line[key], f"{what}: {key} of step {line['step']}: {line.get(key)} " \
                                                       f"!= {ref_line[key]}"
    if "critic/loss" in ref["logs"][0]:  # ppo: the critic trains on the same micro-batches
        deltas["critic_loss"] = assert_within_spread(f"{what}: critic losses", logged(got, "critic/loss"),
                                                     logged(ref, "critic/loss"), logged(reordered, "critic/loss"),
                                                     floor=critic_loss_floor(ref))
    assert weight_names(got) == weight_names(ref), f"{what}: other parameters"
    deltas["weights"] = assert_within_spread(f"{what}: final weights", weights(got), weights(ref),
                                             weights(reordered), floor=weight_floor(ref))
    return deltas


# ---------------------------------------------------------------------- the references themselves
@pytest.mark.parity
@pytest.mark.timeout(180)
def test_references_learn_sync_and_measure_their_own_spread(reference):
    for name, ref in reference["refs"].items():
        assert ref["dp_size"] == ref["world_size"] == 1, name
        rollouts = ref["rollouts"][0]
        assert [r["rollout"] for r in rollouts] == list(range(ONLINE.ROLLOUTS)), name
        for record in rollouts:
            assert len(record["prompts"]) == ONLINE.PROMPTS_PER_STEP
            # the second rollout is sampled after PPO_EPOCHS optimizer steps: after_step synced the sampler
            assert set(record["policy_steps"]) == {record["rollout"] * ONLINE.PPO_EPOCHS}, (name, record)
        advantages = torch.tensor([a for r in rollouts for a in r["advantages"]])
        if name in PPO_KEYS:  # the estimator's advantages are zero; the critic's GAE replaces them
            assert not advantages.any(), name
            advantages = torch.tensor(gae_values(ref, sorted(gae_by_prompt(ref)), "advantages"))
            # the first step trains the critic on the values it gave the rollout: its loss is theirs (a head that
            # trained through dropout would not be)
            first = [k for k in gae_by_prompt(ref) if k[0] == 0]
            errors = [v - r for v, r in zip(gae_values(ref, first, "old_values"), gae_values(ref, first, "returns"),
                                            strict=True)]
            expected = sum(0.5 * e * e for e in errors) / len(errors)
            slack = critic_loss_floor(ref) + max(map(abs, errors)) * gae_floor(ref, model_config(reference),
                                                                                "old_values")
            assert abs(logged(ref, "critic/loss")[0] - expected) <= slack, (name, logged(ref, "critic/loss"), expected)
        assert advantages.abs().sum() > 1.0, f"{name}: the rewards carry no signal {advantages}"
        if name in AGENT_KEYS:  # the rollouts were conversations: the log lines of their steps say how long
            turns = [line["turns_mean"] for line in ref["logs"][::ONLINE.PPO_EPOCHS]]
            assert all(1.0 <= t <= ONLINE.AGENT_TURNS for t in turns), (name, turns)
            assert (max(turns) > 1.0) == (name != "calculator"), (name, turns)  # Counting answers some turns
            assert "reward/environment" in ref["logs"][0], name
        losses = logged(ref, "loss")
        # a rollout's first epoch is on-policy (ratio 1, loss ~0); the second is not: a loss worth comparing
        assert min(abs(losses[1]), abs(losses[3])) > 1e-2, (name, losses)
        # reversing the prompts keeps every completion (seeded by its prompt), and only reorders the sums
        reordered = ref["reordered"]
        assert [r["prompts"] for r in reordered["rollouts"][0]] == [r["prompts"][::-1] for r in rollouts]
        assert_same_rollouts(reordered, ref, f"{name} reversed", model_config(reference, name))
        spread = max_abs_diff(weights(ref), weights(reordered))
        assert 0 < spread < 1e-3, f"{name}: reversing the prompts moved the weights by {spread:.3g}; the " \
                                  f"spread must measure float noise, and some"
    # the saved HF weights are the config dict's initial weights: both references are the same run
    same = reference["refs"]
    assert groups_by_prompt(same["grpo"]) == groups_by_prompt(same["hf_weights"])


# ---------------------------------------------------------------------- TransformersModel on 2 ranks
@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(240)  # the first test of the module also runs the references
@pytest.mark.parametrize("key", [k for k in DIST_RUNS if "resumed" not in k[1]], ids="-".join)
def test_two_ranks_train_as_one_process(reference, hf_runs, key):
    strategy, advantage = key
    run, ref = hf_runs[key], reference["refs"][advantage]
    assert run["world_size"] == run["dp_size"] == 2, run["spec"]
    what = f"{strategy} {advantage}"
    deltas = {"logprobs": assert_same_rollouts(run, ref, what, model_config(reference, advantage))}
    mine, theirs = groups_by_prompt(run), groups_by_prompt(ref)
    tolerance = 0.0  # GRPO: the same rewards of a group, normalised by the same code on one rank
    if advantage == "reinforce_pp":
        tolerance = max(reinforce_pp_tolerance([x for k in theirs if k[0] == rollout for x in theirs[k]["rewards"]])
                        for rollout in range(ONLINE.ROLLOUTS))
    deltas["advantages"] = max(max_abs_diff(mine[k]["advantages"], theirs[k]["advantages"]) for k in theirs)
    assert deltas["advantages"] <= tolerance, f"{what}: advantages differ by {deltas['advantages']:.3g}"
    deltas.update(assert_same_training(run, ref, what))
    print(f"{what}: " + ", ".join(f"max |d {k}| = {v:.3g}" for k, v in deltas.items()))


@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "native_fsdp"])
def test_a_group_is_never_normalised_across_ranks(reference, hf_runs, strategy):
    from twinkle_rl.advantages import grpo_advantages, reinforce_pp_advantages

    run, ref = hf_runs[(strategy, "grpo")], reference["refs"]["grpo"]
    for rollout, single in enumerate(ref["rollouts"][0]):
        # the loader deals the global batch round-robin: rank r holds positions r, r + 2 of the one-process batch
        for rank in range(2):
            record = run["rollouts"][rank][rollout]
            assert record["prompts"] == single["prompts"][rank::2], (strategy, rollout, rank)
            # whole groups: n completions of each of the rank's prompts, normalised by what the rank holds
            assert [len(g) for g in record["tokens"]] == [ONLINE.NUM_GENERATIONS] * len(record["prompts"])
            rewards = torch.tensor(record["rewards"], dtype=torch.float64)
            assert torch.equal(grpo_advantages(rewards), torch.tensor(record["advantages"], dtype=torch.float64))
    mine, theirs = groups_by_prompt(run), groups_by_prompt(ref)  # raises if a prompt is on two ranks
    assert {k: g["advantages"] for k, g in mine.items()} == {k: g["advantages"] for k, g in theirs.items()}
    # REINFORCE++ normalises over the global batch: what a rank holds alone would give other advantages
    pp = hf_runs[(strategy, "reinforce_pp")]
    for rank in range(2):
        record = pp["rollouts"][rank][0]
        local = reinforce_pp_advantages(torch.tensor(record["rewards"], dtype=torch.float64))
        assert max_abs_diff(local, record["advantages"]) > 1e-3, "the all-reduce made no difference to measure"


@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("key", [k for k in DIST_RUNS if k[1] in PPO_KEYS], ids="-".join)
def test_ppo_critic_on_two_ranks_gives_the_one_process_gae(reference, hf_runs, key):
    """The critic's values of each completion token, the returns and the advantages whitened over the whole
    rollout (a sum over every rank's tokens): the second rollout's come from a critic trained on two ranks."""
    strategy, name = key
    run, ref = hf_runs[key], reference["refs"][name]
    keys = sorted(gae_by_prompt(ref))
    assert sorted(gae_by_prompt(run)) == keys, f"{strategy} {name}: the rollouts hold other prompts"
    first = [k for k in keys if k[0] == 0]  # sampled and valued before any step: a difference is the GAE's own
    deltas = {}
    for scope, chosen in (("first rollout", first), ("both rollouts", keys)):
        for field in ("advantages", "returns", "old_values"):
            deltas[field] = assert_within_spread(
                f"{strategy} {name}: GAE {field}, {scope}", gae_values(run, chosen, field),
                gae_values(ref, chosen, field), gae_values(ref["reordered"], chosen, field),
                floor=gae_floor(ref, model_config(reference), field))
    print(f"{strategy} {name}: " + ", ".join(f"max |d {k}| = {v:.3g}" for k, v in deltas.items()))


@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_resuming_mid_rollout_on_two_ranks_continues_the_run(reference, hf_runs):
    resumed, full, ref = hf_runs[("ddp", "grpo-resumed")], hf_runs[("ddp", "grpo")], reference["refs"]["grpo"]
    later = slice(RESUME_AT, None)  # the steps the resumed run trained
    assert [line["step"] for line in resumed["logs"]] == list(range(RESUME_AT + 1, ONLINE.STEPS + 1))
    # the rollouts sampled after the resume: the same prompts and completions as without the interruption
    first = -(-RESUME_AT // ONLINE.PPO_EPOCHS)  # the first rollout sampled after the resume
    rollouts = {k: g for k, g in groups_by_prompt(full).items() if k[0] >= first}
    resumed_rollouts = groups_by_prompt(resumed)
    assert_within_spread("resumed: losses", [float(x["loss"]) for x in resumed["logs"]], logged(full, "loss")[later],
                         logged(ref["reordered"], "loss")[later], floor=loss_floor(ref))
    assert_within_spread("resumed: grad norms", [float(x["grad_norm"]) for x in resumed["logs"]],
                         logged(full, "grad_norm")[later], logged(ref["reordered"], "grad_norm")[later],
                         floor=norm_floor(ref))
    assert {k: g["tokens"] for k, g in resumed_rollouts.items()} == {k: g["tokens"] for k, g in rollouts.items()}
    assert_within_spread("resumed: final weights", weights(resumed), weights(full), weights(ref["reordered"]),
                         floor=weight_floor(ref))


# ---------------------------------------------------------------------- MegatronModel at TP=2
@pytest.fixture(scope="module")
def megatron_job(reference) -> tuple[TorchrunResult, Path]:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    pytest.importorskip("twinkle_backend_megatron", reason="the Megatron backend is not installed")
    return _torchrun(reference, "megatron", list(MEGATRON_RUNS.values()))


@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(MEGATRON_RUNS))
def test_megatron_tp2_with_pushed_weights_samples_and_trains_as_hf(reference, megatron_job, name):
    job, out = megatron_job
    assert job.returncode == 0, job.output
    run = json.loads(out.read_text())[list(MEGATRON_RUNS).index(name)]
    ref = reference["refs"][name]
    assert run["world_size"] == 2 and run["dp_size"] == 1, run["spec"]
    # both tensor-parallel ranks sample the whole batch with their own copy, and must train on the same one
    ranks = [{k: {**g, "rank": None} for k, g in groups_by_prompt(run, rank=r).items()} for r in range(2)]
    assert ranks[0] == ranks[1], "the tensor-parallel ranks sampled different rollouts"
    for record in run["rollouts"][0]:
        assert set(record["policy_steps"]) == {record["rollout"] * ONLINE.PPO_EPOCHS}, record
    # the first rollout: the copy holds the gathered initial weights, which are the saved HF weights
    first = sorted(k for k in groups_by_prompt(ref) if k[0] == 0)
    first_delta = max_abs_diff(logprobs_of(run, first, rank=0), logprobs_of(ref, first))
    config = model_config(reference, name)
    assert first_delta <= logprob_floor(ref, config), f"megatron: first rollout's log-probs differ by {first_delta:.3g}"
    deltas = {"logprobs": assert_same_rollouts(run, ref, f"megatron tp2 {name}", config, rank=0)}
    deltas["advantages"] = max(max_abs_diff(g["advantages"], groups_by_prompt(ref)[k]["advantages"])
                               for k, g in groups_by_prompt(run, rank=0).items())
    assert deltas["advantages"] == 0.0
    deltas.update(assert_same_training(run, ref, f"megatron tp2 {name}"))
    print(f"megatron tp2 {name}: first rollout max |d logprob| = "
          f"{first_delta:.3g}, " + ", ".join(f"max |d {k}| = {v:.3g}" for k, v in deltas.items()))

