"""An RL loop through a running `twinkle serve` with the unmodified Tinker SDK: sample, reward, importance_sampling.

    python examples/serve/rl.py                  # after train_sft.py (it starts from outputs/serve-sft.json)

It starts from train_sft.py's early state (``--start early``, after 140 of its 300 steps: `upper` still mostly
wrong, so there is room to improve; ``--start final`` takes the finished one, ``--state`` any saved state). Each
iteration: the current weights are saved for a sampler; every prompt (a quickstart question) gets ``--group``
completions at temperature 1 with their sampling log-probs; the reward is the answer's similarity to the reference
(difflib ratio, 1.0 = exact); advantages are rewards minus their group's mean; one ``forward_backward`` with
Tinker's ``importance_sampling`` loss (target tokens, the sampler's log-probs and a per-token advantage on the
completion) and one ``optim_step`` (AdamW, gradient norm clipped to 1). Prints the mean reward per iteration and the
greedy held-out exact match (per skill) and reward before and after; saves the last state; writes serve-rl.json next
to --sft-result.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import random
import statistics
import time
from pathlib import Path

from chat_data import HERE, greedy_answers, load_tokenizer, prompt_tokens, read_chats


def similarity(answer: str, reference: str) -> float:
    return difflib.SequenceMatcher(None, answer, reference).ratio()


def reward(tokenizer, tokens: list[int], reference: str) -> float:
    return similarity(tokenizer.decode(tokens, skip_special_tokens=True).replace("<|im_end|>", "").strip(), reference)


def evaluate(sampler, tokenizer, chats) -> dict:
    """Greedy answers to the held-out questions: exact match (overall and per skill) and the mean reward."""
    answers = greedy_answers(sampler, tokenizer, chats)
    hits = {}
    for answer, chat in zip(answers, chats):
        hits.setdefault(chat[0]["content"].split(":")[0], []).append(answer == chat[1]["content"])
    return {"exact_match": sum(map(sum, hits.values())) / len(chats),
            "reward": statistics.fmean(similarity(a, chat[1]["content"]) for a, chat in zip(answers, chats)),
            "exact_match_by_skill": {skill: round(sum(h) / len(h), 3) for skill, h in sorted(hits.items())}}


def rl_datum(prompt: list[int], completion: list[int], logprobs: list[float], advantage: float):
    import tinker

    tokens = prompt + completion
    n_prompt = len(prompt) - 1  # positions whose target is still part of the prompt
    return tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:],
                        "logprobs": [0.0] * n_prompt + list(logprobs),
                        "advantages": [0.0] * n_prompt + [advantage] * len(completion)})


def main() -> int:
    import tinker

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8765"))
    parser.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY", "tml-example-alice"))
    parser.add_argument("--state", default=None, help="a saved state to start from (default: train_sft.py's)")
    parser.add_argument("--sft-result", default=str(HERE.parents[1] / "outputs" / "serve-sft.json"),
                        help="train_sft.py's --result file, read when --state is not given")
    parser.add_argument("--start", choices=("early", "final"), default="early",
                        help="which of train_sft.py's states to start from: 'early' (after --early-step steps, many "
                             "answers still wrong: room to improve) or 'final'")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if args.state:
        start_state = args.state
    else:
        sft = json.loads(Path(args.sft_result).read_text())
        start_state = sft["early_state"] if args.start == "early" and sft.get("early_state") else sft["state"]
    print(f"starting from {start_state}", flush=True)
    tokenizer = load_tokenizer()
    train, held_out = read_chats("train.jsonl"), read_chats("eval.jsonl")[: args.eval_size]
    service = tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    client = service.create_training_client_from_state_with_optimizer(start_state).result()
    rng = random.Random(args.seed)
    start = time.time()
    before = evaluate(client.save_weights_and_get_sampling_client().result(), tokenizer, held_out)
    print(f"held-out, greedy: exact match {before['exact_match']:.3f} {before['exact_match_by_skill']}, "
          f"mean reward {before['reward']:.3f} ({time.time() - start:.0f} s)", flush=True)
    rewards_per_iteration = []
    for iteration in range(args.iterations):
        sampler = client.save_weights_and_get_sampling_client().result()
        chats = rng.sample(train, args.prompts)
        prompts = [prompt_tokens(tokenizer, chat[0]["content"]) for chat in chats]
        futures = [sampler.sample(tinker.types.ModelInput.from_ints(p), num_samples=args.group,
                                  sampling_params=tinker.types.SamplingParams(  # a seed per request: independent draws
                                      max_tokens=16, temperature=1.0, stop=["<|im_end|>"],
                                      seed=(args.seed * 100_000 + iteration) * 1_000 + index))
                   for index, p in enumerate(prompts)]
        data, rewards = [], []
        for chat, prompt, future in zip(chats, prompts, futures):
            sequences = future.result().sequences
            scores = [reward(tokenizer, s.tokens, chat[1]["content"]) for s in sequences]
            rewards += scores
            mean = statistics.fmean(scores)
            data += [rl_datum(prompt, s.tokens, s.logprobs, score - mean)
                     for s, score in zip(sequences, scores) if s.tokens and score != mean]
        if data:
            client.forward_backward(data, "importance_sampling").result()
            client.optim_step(tinker.types.AdamParams(learning_rate=args.lr, beta2=0.999, eps=1e-8,
                                                      grad_clip_norm=1.0)).result()
        rewards_per_iteration.append(statistics.fmean(rewards))
        print(f"iteration {iteration:3d}  mean reward {rewards_per_iteration[-1]:.3f}  "
              f"({len(data)} datums, {time.time() - start:5.1f} s)", flush=True)
    after = evaluate(client.save_weights_and_get_sampling_client().result(), tokenizer, held_out)
    state = client.save_state("rl-final").result().path
    first, last = statistics.fmean(rewards_per_iteration[:3]), statistics.fmean(rewards_per_iteration[-3:])
    print(f"held-out, greedy: exact match {after['exact_match']:.3f} {after['exact_match_by_skill']}, "
          f"mean reward {after['reward']:.3f}")
    print(f"mean reward: first 3 iterations {first:.3f} -> last 3 {last:.3f}; held-out exact match "
          f"{before['exact_match']:.3f} -> {after['exact_match']:.3f}, held-out reward {before['reward']:.3f} -> "
          f"{after['reward']:.3f} ({time.time() - start:.0f} s); state {state}")
    out = Path(args.sft_result).with_name("serve-rl.json")
    out.write_text(json.dumps({"start": start_state, "state": state, "rewards": rewards_per_iteration,
                               "before": before, "after": after, "seconds": round(time.time() - start, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
