"""An RL loop through a running `twinkle serve` with the unmodified Tinker SDK: sample, reward, importance_sampling.

    python examples/serve/rl.py                  # after train_sft.py (it starts from outputs/serve-sft.json)

Each iteration: the current weights are saved for a sampler; every prompt (a quickstart question) gets
``--group`` completions at temperature 1 with their sampling log-probs; the reward is the answer's similarity to
the reference (difflib ratio, 1.0 = exact); advantages are rewards minus their group's mean; one
``forward_backward`` with Tinker's ``importance_sampling`` loss (target tokens, the sampler's log-probs and a
per-token advantage on the completion) and one ``optim_step``. Prints the mean reward per iteration and the
held-out exact match before and after.
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

from chat_data import HERE, exact_match, load_tokenizer, prompt_tokens, read_chats


def reward(tokenizer, tokens: list[int], reference: str) -> float:
    answer = tokenizer.decode(tokens, skip_special_tokens=True).replace("<|im_end|>", "").strip()
    return difflib.SequenceMatcher(None, answer, reference).ratio()


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
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--eval-size", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    state = args.state or json.loads(open(args.sft_result).read())["state"]
    tokenizer = load_tokenizer()
    train, held_out = read_chats("train.jsonl"), read_chats("eval.jsonl")[: args.eval_size]
    service = tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    client = service.create_training_client_from_state_with_optimizer(state).result()
    rng = random.Random(args.seed)
    start = time.time()
    before = exact_match(client.save_weights_and_get_sampling_client("rl-start"), tokenizer, held_out)
    rewards_per_iteration = []
    for iteration in range(args.iterations):
        sampler = client.save_weights_and_get_sampling_client(f"rl-{iteration}")
        chats = rng.sample(train, args.prompts)
        params = tinker.types.SamplingParams(max_tokens=16, temperature=1.0, stop=["<|im_end|>"],
                                             seed=args.seed * 100_000 + iteration)
        prompts = [prompt_tokens(tokenizer, chat[0]["content"]) for chat in chats]
        futures = [sampler.sample(tinker.types.ModelInput.from_ints(p), num_samples=args.group, sampling_params=params)
                   for p in prompts]
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
            client.optim_step(tinker.types.AdamParams(learning_rate=args.lr, beta2=0.999, eps=1e-8)).result()
        rewards_per_iteration.append(statistics.fmean(rewards))
        print(f"iteration {iteration:3d}  mean reward {rewards_per_iteration[-1]:.3f}  "
              f"({len(data)} datums, {time.time() - start:5.1f} s)", flush=True)
    after = exact_match(client.save_weights_and_get_sampling_client("rl-end"), tokenizer, held_out)
    first, last = rewards_per_iteration[:3], rewards_per_iteration[-3:]
    print(f"mean reward: first 3 iterations {statistics.fmean(first):.3f} -> last 3 {statistics.fmean(last):.3f}; "
          f"held-out exact match {before:.3f} -> {after:.3f} ({time.time() - start:.0f} s)")
    out = Path(args.sft_result).with_name("serve-rl.json")
    out.write_text(json.dumps({"rewards": rewards_per_iteration, "exact_match_before": before,
                               "exact_match_after": after}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
