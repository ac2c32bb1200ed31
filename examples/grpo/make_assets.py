"""Regenerate the GRPO quickstart's prompt sets (deterministic; already committed).

The prompts are the DPO quickstart's (``examples/dpo``): the quickstart's string operations on 4-letter
words, with the correct answer as the ``answer`` field the exact-match reward compares against. The
start point is the DPO quickstart's SFT model, which answers about a third of the held-out prompts
correctly and echoes the word for most others.

    python examples/grpo/make_assets.py
"""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
DPO = os.path.join(os.path.dirname(HERE), "dpo")
TRAIN_PROMPTS = 2000
EVAL_PROMPTS = 300


def convert(source: str, target: str, limit: int) -> None:
    with open(os.path.join(DPO, source)) as f:
        pairs = [json.loads(line) for line in f][:limit]
    with open(os.path.join(HERE, target), "w") as f:
        for pair in pairs:
            f.write(json.dumps({"messages": pair["messages"], "answer": pair["chosen"]}) + "\n")


if __name__ == "__main__":
    convert("train.jsonl", "train.jsonl", TRAIN_PROMPTS)
    convert("eval.jsonl", "eval.jsonl", EVAL_PROMPTS)
