"""Train the quickstart task through a running `twinkle serve`, with the unmodified Tinker SDK.

    twinkle train examples/serve/base.yaml                  # once: the base model the server hosts
    twinkle serve examples/serve/server.yaml &              # one terminal (or in the background)
    python examples/serve/train_sft.py                      # this: LoRA SFT, then held-out exact match

The base (base.yaml) already chats and knows `reverse` and `double`, never `upper`; a rank-64 LoRA on every linear
layer and the LM head adapts it to the whole quickstart task. Everything goes over HTTP: a sampling client for the
base's held-out exact match (a fresh LoRA is exactly the base), forward_backward (cross_entropy), optim_step (AdamW
with warm-up and cosine decay computed here), save_state (after --early-step steps and at the end), and a sampling
client for the final evaluation. Both states' paths go to outputs/serve-sft.json for rl.py (--result).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

from chat_data import HERE, chat_tokens, exact_match, load_tokenizer, read_chats, to_datum

BASE = "twinkle/quickstart-base"


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * progress))


def main() -> int:
    import tinker

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8765"))
    parser.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY", "tml-example-alice"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--early-step", type=int, default=140,
                        help="also save the state after this many steps (0: don't): rl.py starts from it by default, "
                             "a policy that still gets many answers wrong")
    parser.add_argument("--no-eval-before", action="store_true",
                        help="skip the held-out exact match of the base before training")
    parser.add_argument("--result", default=str(HERE.parents[1] / "outputs" / "serve-sft.json"),
                        help="where the saved state's path and the score are written (rl.py reads it)")
    args = parser.parse_args()

    tokenizer = load_tokenizer()
    train = [chat_tokens(tokenizer, chat) for chat in read_chats("train.jsonl")]
    held_out = read_chats("eval.jsonl")[: args.eval_size]
    service = tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    client = service.create_lora_training_client(base_model=BASE, rank=args.rank, seed=args.seed).result()
    rng = random.Random(args.seed)
    start = time.time()
    before = None
    if not args.no_eval_before:  # a fresh LoRA is exactly the base (its B matrices start at zero)
        before = exact_match(client.save_weights_and_get_sampling_client().result(), tokenizer, held_out)
        print(f"held-out exact match of the base, before the LoRA: {before:.3f} on {len(held_out)} chats "
              f"({time.time() - start:.0f} s)", flush=True)
    losses, early = [], None
    for step in range(args.steps):
        batch = [to_datum(*train[i]) for i in rng.sample(range(len(train)), args.batch_size)]
        fwd = client.forward_backward(batch, "cross_entropy")
        opt = client.optim_step(tinker.types.AdamParams(
            learning_rate=learning_rate(step, args.steps, args.lr, warmup=30), beta2=0.999, eps=1e-8,
            weight_decay=0.01, grad_clip_norm=1.0))
        loss = fwd.result().metrics["loss:sum"] / sum(sum(d.loss_fn_inputs["weights"].data) for d in batch)
        opt.result()
        losses.append(loss)
        if step + 1 == args.early_step:
            early = client.save_state(f"sft-step{step + 1}").result().path
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss/token {loss:.4f}  {time.time() - start:6.1f} s", flush=True)

    state = client.save_state("sft-final").result().path
    sampler = client.save_weights_and_get_sampling_client().result()
    score = exact_match(sampler, tokenizer, held_out)
    print(f"held-out exact match: {score:.3f} on {len(held_out)} chats ({time.time() - start:.0f} s); state {state}")
    out = Path(args.result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"state": state, "early_state": early, "early_step": args.early_step,
                               "exact_match_before": before, "exact_match": score, "steps": args.steps,
                               "losses": losses, "seconds": round(time.time() - start, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
