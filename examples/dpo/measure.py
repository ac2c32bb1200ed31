"""How often a checkpoint's greedy answer is the chosen answer, the rejected one, or something else.

    python examples/dpo/measure.py CHECKPOINT examples/dpo/eval.jsonl [--reference REF_CHECKPOINT]

CHECKPOINT is any saved model directory (``outputs/dpo/sft/final``, a DPO run's ``final``); it is
loaded with plain transformers. For every pair of the JSONL file (``{"messages" | "prompt",
"chosen", "rejected"}``) the prompt is rendered with the checkpoint's chat template and answered by
greedy decoding up to ``<|im_end|>``. Printed: the share of answers equal to ``chosen`` /
``rejected`` / neither, overall and per operation (the prompt's text before ':'), and the share of
pairs whose chosen answer has the higher log-probability under the model.

With ``--reference``, also the DPO reward accuracy: the share of pairs whose implicit reward
``log pi(chosen)/pi_ref(chosen) - log pi(rejected)/pi_ref(rejected)`` is positive (``beta`` does not
change its sign), and the mean of that margin. Log-probabilities are summed over the answer's tokens
and its ``<|im_end|>``. ``--json PATH`` also writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def read_pairs(path: str) -> list[dict]:
    pairs = []
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            if row.get("system"):
                messages = [{"role": "system", "content": row["system"]}] + messages
            pairs.append({"messages": messages, "chosen": row["chosen"], "rejected": row["rejected"]})
    return pairs


def group(pair: dict) -> str:
    text = pair["messages"][-1]["content"]
    return text.split(":", 1)[0] if ":" in text else "all"


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


@torch.no_grad()
def greedy(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy answers; prompts of equal length are batched together, so nothing is padded."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    by_length = defaultdict(list)
    for i, ids in enumerate(prompts):
        by_length[len(ids)].append(i)
    answers = [""] * len(prompts)
    for indices in by_length.values():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start:start + batch_size]
            ids = torch.tensor([prompts[i] for i in chunk])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=end, pad_token_id=tokenizer.pad_token_id)
            for row, i in enumerate(chunk):
                answers[i] = tokenizer.decode(out[row, ids.shape[1]:], skip_special_tokens=True)
    return answers


@torch.no_grad()
def answer_logps(model, tokenizer, prompts: list[list[int]], answers: list[str], batch_size: int) -> torch.Tensor:
    """Summed log-probability of each ``answer + <|im_end|>`` after its prompt."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.pad_token_id
    sequences = [(p, tokenizer(a, add_special_tokens=False)["input_ids"] + [end]) for p, a in zip(prompts, answers)]
    result = torch.zeros(len(sequences))
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        width = max(len(p) + len(a) for p, a in chunk)
        ids = torch.full((len(chunk), width), pad)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        labels = torch.full((len(chunk), width), -100)
        for row, (p, a) in enumerate(chunk):  # right padding: positions stay those of an unpadded row
            ids[row, :len(p) + len(a)] = torch.tensor(p + a)
            mask[row, :len(p) + len(a)] = 1
            labels[row, len(p):len(p) + len(a)] = torch.tensor(a)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        targets = labels[:, 1:]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        result[start:start + len(chunk)] = (logp * (targets != -100)).sum(-1)
    return result


def load(path: str):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return model


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("pairs", nargs="?", default="examples/dpo/eval.jsonl")
    parser.add_argument("--reference", help="the reference checkpoint, for the DPO reward accuracy")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--examples", type=int, default=6, help="answers to print")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = load(args.checkpoint)
    pairs = read_pairs(args.pairs)
    prompts = [prompt_ids(tokenizer, p["messages"]) for p in pairs]
    answers = greedy(model, tokenizer, prompts, args.max_new_tokens, args.batch_size)

    counts: dict[str, dict[str, int]] = defaultdict(lambda: {"chosen": 0, "rejected": 0, "other": 0})
    for p, answer in zip(pairs, answers):
        kind = "chosen" if answer == p["chosen"] else "rejected" if answer == p["rejected"] else "other"
        counts[group(p)][kind] += 1
        counts["all"][kind] += 1

    chosen_lp = answer_logps(model, tokenizer, prompts, [p["chosen"] for p in pairs], args.batch_size)
    rejected_lp = answer_logps(model, tokenizer, prompts, [p["rejected"] for p in pairs], args.batch_size)
    result: dict = {"checkpoint": args.checkpoint, "pairs": len(pairs), "greedy": {},
                    "logp_accuracy": float((chosen_lp > rejected_lp).float().mean())}
    print(f"{args.checkpoint} on {args.pairs} ({len(pairs)} pairs), greedy answers:")
    for name in ["all"] + sorted(k for k in counts if k != "all"):
        c = counts[name]
        n = sum(c.values())
        rates = {k: v / n for k, v in c.items()}
        result["greedy"][name] = rates
        print(f"  {name:>8} ({n:3d}): chosen {rates['chosen']:.3f}  rejected {rates['rejected']:.3f}  "
              f"other {rates['other']:.3f}")
    print(f"  log pi(chosen) > log pi(rejected): {result['logp_accuracy']:.3f}")
    if args.reference:
        reference = load(args.reference)
        ref_chosen = answer_logps(reference, tokenizer, prompts, [p["chosen"] for p in pairs], args.batch_size)
        ref_rejected = answer_logps(reference, tokenizer, prompts, [p["rejected"] for p in pairs], args.batch_size)
        margin = (chosen_lp - ref_chosen) - (rejected_lp - ref_rejected)
        result["reward_accuracy"] = float((margin > 0).float().mean())
        result["reward_margin"] = float(margin.mean())
        print(f"  DPO reward accuracy vs {args.reference}: {result['reward_accuracy']:.3f} "
              f"(mean margin / beta {result['reward_margin']:.2f})")
    for p, answer in list(zip(pairs, answers))[:args.examples]:
        print(f"  {p['messages'][-1]['content']!r} -> {answer!r}  (chosen {p['chosen']!r}, rejected {p['rejected']!r})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
