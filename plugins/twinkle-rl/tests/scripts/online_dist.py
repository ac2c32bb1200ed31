"""Online RL (the ``grpo`` and ``ppo`` tasks, with or without an environment) through the trainer on any backend;
every rollout and step recorded to JSON.

    python online_dist.py --init DIR                                 # the prompts and tiny HF weights, once
    python online_dist.py --init DIR --out OUT.json --runs '[{"strategy": "single"}]'
    torchrun --nproc-per-node 2 online_dist.py --init DIR --out OUT.json \
        --runs '[{"strategy": "ddp"}, {"strategy": "native_fsdp"}]'

Each run trains :data:`STEPS` optimizer steps with ``twinkle_core.train.loop.Trainer`` (the trainer behind
``twinkle train``) on :data:`PROMPTS_PER_STEP` global prompts per rollout (``data.batch_size`` is that divided by
the data-parallel ranks), :data:`NUM_GENERATIONS` completions each, ``ppo_epochs`` :data:`PPO_EPOCHS` (so every
second step trains on a rollout whose sampler weights are one step old: a ratio other than 1, a loss
other than 0), fp32, AdamW with clipping.

The reward is :func:`letter_share` of this module (``online_dist:letter_share``; torchrun puts the script's
folder on ``sys.path``): the share of letters in a completion, so the rewards of a group differ.

What is recorded, and how: ``RolloutEngine.run`` (the one call the task makes per rollout) is wrapped for
the whole process by :func:`record_rollouts`. The wrapper passes the task's ``draw`` through and keeps the
prompt indices it returned, then keeps what ``run`` returned: each group's rewards and advantages and its
completions (tokens, log-probs). It changes nothing, except with ``reverse`` (below). The losses and gradient
norms are the trainer's own log lines (``output_dir/logs.jsonl``), the final weights ``model.get_state_dict()``
(every rank calls it: a collective under FSDP2 and Megatron), saved by rank 0 as ``OUT.<run index>.pt``.

A run (a JSON object in ``--runs``):

* ``strategy``: ``single``, ``ddp``, ``native_fsdp`` (TransformersModel, from the tiny Qwen2 config dict);
* ``backend``: ``hf`` (default) or ``megatron`` (``MegatronModel``, with ``mesh``); ``weights: true`` trains
  from the saved tiny HF weights under ``--init`` (``model_id``) instead of the config dict;
* ``advantage``: ``grpo`` (default) or ``reinforce_pp``; ``copy_weights``: the ``hf_generate`` option;
* ``task``: ``grpo`` (default) or ``ppo`` (a critic trained at ``LR``, GAE whitened over every rank; the rollout
  records get ``gae``: per completion, its tokens' ``advantages``, ``returns`` and ``old_values``);
* ``environment``: multi-turn agent rollouts with that environment (``calculator``, or ``online_dist:Counting``
  of this module) on ``arithmetic.jsonl`` (products with an ``answer``), at most :data:`AGENT_TURNS` model turns
  and :data:`AGENT_TOKENS` tokens after the prompt; the reward is the environment's plus ``letter_share``;
* ``vlm``: the ``vlm_grpo`` task (``pip install twinkle-vlm[rl]``) on :data:`PICTURE_PROMPTS` (a picture of a
  coloured square each, 2 x 2 merged image tokens: 3-D positions) with the tiny Qwen2.5-VL saved under ``--init``
  (``vlm``), every part trained in full;
* ``reverse``: reverse the prompts of every draw (their completions keep their seeds): the same mathematics
  in another summation order, the float spread of the reference (``twinkle_core.testing.tolerance``);
* ``resume_at``: also save a checkpoint every that many steps, then train again from the one of that step
  (``Trainer(..., resume=...)``, in the same ``output_dir``); the result is the resumed run's (its rollouts,
  its log lines, its final weights).

A run's result: ``rollouts`` (per rank, per rollout: ``prompts`` (indices), ``rewards``, ``advantages``
``[groups][n]``, ``tokens`` and ``logprobs`` ``[groups][n][...]``), ``logs`` (the train log lines),
``dp_size``, ``world_size``, ``weights`` (the ``.pt`` path), ``seconds``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from typing import Any

from twinkle_core.environments import AgentMessage, Environment, StepResult

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
TOKENIZER_DIR = os.path.join(REPO, "examples", "quickstart", "tokenizer")

PROMPTS_PER_STEP = 4  # global prompts per rollout
NUM_GENERATIONS = 4
PPO_EPOCHS = 2
ROLLOUTS = 2
STEPS = ROLLOUTS * PPO_EPOCHS
MAX_NEW_TOKENS = 6
LR = 1e-2
MAX_GRAD_NORM = 1.0
SAMPLING_SEED = 5
AGENT_TURNS = 3  # the calculator environment: model turns per trajectory, tokens after the prompt
AGENT_TOKENS = 24
AGENT_STOP = list("aeiou0123456789")
TRAIN_SEED = 0

WORDS = ["apple", "river", "stone", "cloud", "tiger", "piano", "grape", "north"]
#: the vlm runs' prompts: a square of each colour (RGB) in a picture of its size, and a question
PICTURE_PROMPTS = [((220, 30, 30), (56, 56)), ((30, 200, 30), (56, 84)), ((30, 30, 220), (84, 56)),
                   ((250, 250, 250), (84, 84)), ((200, 200, 30), (56, 56)), ((30, 200, 200), (84, 56)),
                   ((200, 30, 200), (56, 84)), ((90, 90, 90), (84, 84))]
#: the processor's pixel bounds for the vlm runs: 2 x 2 to 3 x 3 merged image tokens per picture
VLM_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 84 * 84}


def letter_share(prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
    """The share of letters among a completion's characters (0 for an empty one): graded, so a group's differ."""
    return [sum(ch.isalpha() for ch in text) / len(text) if text else 0.0 for text in completions]


class Counting(Environment):
    """Answers a turn with its length, as many times as the row's ``answer`` modulo :data:`AGENT_TURNS` says, then
    ends the episode: the prompts' trajectories take different numbers of turns, so the ranks' do too (a turn
    cut at ``max_new_tokens`` ends its trajectory early), with untrained environment tokens between turns."""

    def reset(self, row_fields: dict[str, Any]) -> str:
        self.answers_left = int(row_fields["answer"]) % AGENT_TURNS
        return ""

    def step(self, message: AgentMessage) -> StepResult:
        size = len(message.text)
        self.answers_left -= 1
        return StepResult(observation=f"{size} chars", reward=float(size % 2) / 2, done=self.answers_left < 0)


def prompt_rows() -> list[dict[str, Any]]:
    assert len(WORDS) == PROMPTS_PER_STEP * ROLLOUTS
    return [{"prompt": f"say a word like {word}"} for word in WORDS]


def arithmetic_rows() -> list[dict[str, Any]]:
    """The calculator environment's prompts: a product and its ``answer`` field. Every prompt has as many
    characters (tokens): each rank pads its rows to the same width as the one process (see the test)."""
    pairs = [(12, 3), (17, 8), (15, 4), (19, 9), (21, 2), (16, 3), (11, 7), (25, 4)]
    assert len(pairs) == PROMPTS_PER_STEP * ROLLOUTS
    return [{"prompt": f"{a}*{b}=?", "answer": str(a * b)} for a, b in pairs]


def write_pictures(directory: str) -> None:
    """``pictures.jsonl`` and its pictures, and the tiny Qwen2.5-VL as ``vlm`` (only where twinkle-vlm is installed:
    the vlm runs need it)."""
    try:
        from twinkle_vlm.testing import save_tiny_vlm
    except ModuleNotFoundError:
        return
    from PIL import Image

    assert len(PICTURE_PROMPTS) == PROMPTS_PER_STEP * ROLLOUTS
    rows = []
    for i, (rgb, size) in enumerate(PICTURE_PROMPTS):
        path = os.path.join(directory, f"picture{i}.png")
        Image.new("RGB", size, rgb).save(path)
        rows.append({"messages": [{"role": "user", "content": [{"type": "image", "image": path},
                                                               {"type": "text", "text": "Colour?"}]}]})
    save_tiny_vlm("qwen2_5_vl", os.path.join(directory, "vlm"), seed=TRAIN_SEED)
    with open(os.path.join(directory, "pictures.jsonl"), "w") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in rows)


def tiny_config(tokenizer: Any) -> dict[str, Any]:
    from twinkle_backend_hf.testing import tiny_qwen2_config

    return tiny_qwen2_config(vocab_size=len(tokenizer))


# ---------------------------------------------------------------------- set-up
def init(directory: str, tokenizer: Any) -> None:
    """``prompts.jsonl``, ``arithmetic.jsonl`` and the tiny Qwen2 as an HF directory ``hf`` (the Megatron
    comparison's weights)."""
    from twinkle_backend_hf.model import TransformersModel

    os.makedirs(directory, exist_ok=True)
    write_pictures(directory)
    with open(os.path.join(directory, "arithmetic.jsonl"), "w") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in arithmetic_rows())
    with open(os.path.join(directory, "prompts.jsonl"), "w") as fh:  # last: its presence means init is done
        fh.writelines(json.dumps(row) + "\n" for row in prompt_rows())
    TransformersModel(config=tiny_config(tokenizer), seed=TRAIN_SEED).save("hf", output_dir=directory,
                                                                           save_optimizer=False)


def recipe(spec: dict[str, Any], init_dir: str, output_dir: str, dp_size: int, tokenizer: Any) -> dict[str, Any]:
    backend = spec.get("backend", "hf")
    model: dict[str, Any] = {"class_name": "MegatronModel" if backend == "megatron" else "TransformersModel",
                             "tokenizer": TOKENIZER_DIR}
    if spec.get("weights") or backend == "megatron":
        model["model_id"] = os.path.join(init_dir, "hf")
    else:
        model["config"] = tiny_config(tokenizer)
    strategy = spec.get("strategy", "single")
    task = spec.get("task", "grpo")
    options = task_options(spec)
    train = os.path.join(init_dir, "arithmetic.jsonl" if spec.get("environment") else "prompts.jsonl")
    if spec.get("vlm"):  # the grpo task's loss on prompts that show pictures
        model = {"class_name": model["class_name"], "model_id": os.path.join(init_dir, "vlm")}
        options.update(VLM_PIXELS, train_vision="full", train_projector="full", train_language="full")
        task, train = "vlm_grpo", os.path.join(init_dir, "pictures.jsonl")
    return {
        "task": task,
        "task_options": options,
        "model": model,
        "strategy": {"name": "megatron" if backend == "megatron" else strategy},
        "mesh": spec.get("mesh"),
        "precision": "no",
        "data": {"train": train, "batch_size": PROMPTS_PER_STEP // dp_size, "shuffle": True},
        "loss": {"name": "grpo" if task == "vlm_grpo" else task},
        "optimizer": {"name": "AdamW", "lr": LR, "weight_decay": 0.0},
        "lr_scheduler": {"name": "constant"},
        "train": {"output_dir": output_dir, "max_steps": STEPS, "max_grad_norm": MAX_GRAD_NORM, "seed": TRAIN_SEED,
                  "log_every": 1},
    }


def task_options(spec: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {
        "num_generations": NUM_GENERATIONS,
        "sampler": {"name": "hf_generate", "copy_weights": bool(spec.get("copy_weights", False))},
        "sampling": {"temperature": 1.0, "max_new_tokens": MAX_NEW_TOKENS},
        "rewards": [{"name": "online_dist:letter_share"}],
        "ppo_epochs": PPO_EPOCHS,
        "seed": SAMPLING_SEED,
    }
    if spec.get("task") == "ppo":  # GAE on the critic's values, whitened over every rank's completion tokens
        options["critic"] = {"lr": LR, "max_grad_norm": MAX_GRAD_NORM}
    else:
        options["advantage"] = spec.get("advantage", "grpo")
    if spec.get("environment"):
        options["environment"] = {"name": spec["environment"], "max_turns": AGENT_TURNS, "max_total_tokens": AGENT_TOKENS}
        # stop strings end a model turn early (the untrained model rarely writes its end-of-turn token), so that
        # turns reach the environment instead of running out of tokens
        options["sampling"]["stop"] = AGENT_STOP
    return options


# ---------------------------------------------------------------------- recording
class RolloutRecorder:
    """Wraps ``RolloutEngine.run`` for the whole process; ``records`` gets one entry per rollout."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.reverse = False

    def install(self) -> None:
        from twinkle_rl.rollout import RolloutEngine

        original = RolloutEngine.run
        recorder = self

        def run(engine: Any, draw: Any, rollout: int, stats: Any) -> Any:
            drawn: list[int] = []

            def recorded_draw() -> dict[str, Any]:
                batch = draw()
                if recorder.reverse:
                    batch = {**batch, "prompts": list(batch["prompts"])[::-1],
                             "prompt_index": batch["prompt_index"].flip(0)}
                drawn.extend(int(f.index) for f in batch["prompts"])
                return batch

            result = original(engine, recorded_draw, rollout, stats)
            n = engine.n
            completions = result.completions
            recorder.records.append({
                "rollout": rollout,
                "prompts": drawn,  # without dynamic sampling, group g is prompt drawn[g]
                "rewards": result.rewards.tolist(),
                "advantages": result.advantages.tolist(),
                "batch_advantages": result.batch["advantages"].tolist(),
                "tokens": [[list(c.token_ids) for c in completions[g * n:(g + 1) * n]] for g in range(len(drawn))],
                "logprobs": [[list(c.logprobs) for c in completions[g * n:(g + 1) * n]] for g in range(len(drawn))],
                "policy_steps": [c.policy_step for c in completions],
            })
            return result

        RolloutEngine.run = run
        self.install_gae()

    def install_gae(self) -> None:
        """The ``ppo`` task completes each rollout with its critic's GAE: keep each completion's per-token
        advantages, returns and old values (its completion tokens only) in the rollout's record."""
        from twinkle_rl.ppo_task import PPOTask

        from twinkle_core.constants import IGNORE_INDEX

        original = PPOTask._after_rollout
        recorder = self

        def after_rollout(task: Any, model: Any, rollout: Any, chunk_size: int) -> None:
            original(task, model, rollout, chunk_size)
            batch, n = rollout.batch, task.num_generations
            mask = batch["labels"][:, 1:] != IGNORE_INDEX
            rows = [{key: batch[key][row][mask[row]].tolist() for key in ("advantages", "returns", "old_values")}
                    for row in range(mask.shape[0])]
            recorder.records[-1]["gae"] = [rows[g * n:(g + 1) * n] for g in range(len(rows) // n)]

        PPOTask._after_rollout = after_rollout


RECORDER = RolloutRecorder()


# ---------------------------------------------------------------------- one run
def one_run(index: int, spec: dict[str, Any], init_dir: str, out: str, tokenizer: Any) -> dict[str, Any] | None:
    import torch

    from twinkle_core import distributed
    from twinkle_core.train.loop import Trainer
    from twinkle_core.train.recipe import recipe_from_dict

    start = time.monotonic()
    world = distributed.world_size()
    # TP/PP ranks share their data-parallel rank; this fixture only uses all-DP or all-model-parallel meshes
    dp_size = 1 if spec.get("backend") == "megatron" else world
    output_dir = f"{out}.work/{index}"
    RECORDER.records, RECORDER.reverse = [], bool(spec.get("reverse"))
    settings = recipe(spec, init_dir, output_dir, dp_size, tokenizer)
    resume_at = spec.get("resume_at")
    if resume_at:
        settings["train"]["save_every"] = int(resume_at)
    trainer = Trainer(recipe_from_dict(settings))
    trainer.run()
    logged_before = 0
    if resume_at:  # the same recipe again, from the checkpoint of step resume_at; only this run is reported
        from twinkle_core.checkpoint import checkpoint_name

        if distributed.is_main_process():
            with open(os.path.join(output_dir, "logs.jsonl")) as fh:
                logged_before = sum(1 for line in fh if line.strip())
        RECORDER.records = []
        trainer = Trainer(recipe_from_dict(settings), resume=os.path.join(output_dir, checkpoint_name(resume_at)))
        trainer.run()
    assert (trainer.dp_size or 1) == dp_size, (trainer.dp_size, dp_size)
    # every rank: a collective under FSDP2 and Megatron
    state = {k: v.detach().float().cpu().clone() for k, v in trainer.model.get_state_dict().items()}
    records = [RECORDER.records]
    if world > 1:
        import torch.distributed as dist

        records = [None] * world
        dist.all_gather_object(records, RECORDER.records)
    if not distributed.is_main_process():
        return None
    weights = f"{out}.{index}.pt"
    torch.save(state, weights)
    with open(os.path.join(output_dir, "logs.jsonl")) as fh:
        logs = [json.loads(line) for line in fh if line.strip()][logged_before:]
    return {"spec": spec, "rollouts": records, "logs": [line for line in logs if line["event"] == "train"],
            "dp_size": dp_size, "world_size": world, "weights": weights,
            "seconds": round(time.monotonic() - start, 2)}


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--init", required=True, help="the prompts and tiny weights (written when missing)")
    parser.add_argument("--runs", default=None, help="JSON list of runs (see the module docstring)")
    parser.add_argument("--out", default=None, help="JSON file rank 0 writes: one result per run")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from twinkle_core import distributed

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    if not os.path.exists(os.path.join(args.init, "prompts.jsonl")):
        if distributed.world_size() > 1:
            raise SystemExit(f"{args.init} has no prompts.jsonl: run --init in one process first")
        init(args.init, tokenizer)
    if args.runs:
        RECORDER.install()
        results = [one_run(i, spec, args.init, args.out, tokenizer) for i, spec in enumerate(json.loads(args.runs))]
        if distributed.is_main_process():
            with open(args.out + ".tmp", "w") as fh:
                json.dump(results, fh)
            os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
    from twinkle_core.testing.torchrun import exit_job

    exit_job()
