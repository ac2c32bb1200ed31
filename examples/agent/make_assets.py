"""Regenerate the agent quickstart's data sets (deterministic; already committed).

Products of two 2-digit numbers, which the quickstart's tiny model cannot compute in its head. ``sft.jsonl``
holds transcripts: three in five answer directly with an estimate (the product to the nearest hundred, "about
4700", which the calculator environment does not accept), two in five call the ``calculator`` tool and copy its
result, the only exact products the model sees. ``train.jsonl`` / ``eval.jsonl`` hold prompts with
the ``answer`` field the ``calculator`` environment compares the final answer with; no pair of numbers of
``eval.jsonl`` occurs in the other files.

    python examples/agent/make_assets.py
"""

from __future__ import annotations

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
SFT_ROWS, TRAIN_PROMPTS, EVAL_PROMPTS = 4000, 2000, 200
TOOL_SHARE = 0.4


def tool_call(expression: str) -> str:
    payload = json.dumps({"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":"))
    return f"<tool_call>{payload}</tool_call>"


def transcript(a: int, b: int, rng: random.Random) -> dict:
    question = {"role": "user", "content": f"{a}*{b}=?"}
    if rng.random() >= TOOL_SHARE:
        return {"messages": [question, {"role": "assistant", "content": f"about {round(a * b, -2)}"}]}
    return {"messages": [question, {"role": "assistant", "content": tool_call(f"{a}*{b}")},
                         {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}]}


def write(name: str, rows: list[dict]) -> None:
    with open(os.path.join(HERE, name), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    rng = random.Random(0)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    held_out, seen = pairs[:EVAL_PROMPTS], pairs[EVAL_PROMPTS:]
    write("sft.jsonl", [transcript(a, b, rng) for a, b in seen[:SFT_ROWS]])
    write("train.jsonl", [{"prompt": f"{a}*{b}=?", "answer": str(a * b)} for a, b in seen[-TRAIN_PROMPTS:]])
    write("eval.jsonl", [{"prompt": f"{a}*{b}=?", "answer": str(a * b)} for a, b in held_out])
