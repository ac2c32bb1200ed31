"""Regenerate the agent quickstart's data sets (deterministic; already committed).

Products of two 2-digit numbers, which the quickstart's tiny model cannot compute in its head. ``sft.jsonl``
holds transcripts: three in five answer directly with an estimate (the product to the nearest hundred, "about
4700", which the calculator environment does not accept), two in five call the ``calculator`` tool and copy its
result. In half of the tool transcripts the tool's answer is a random number: with the true product every time,
the model learns to recompute (memorise) the training products instead of copying the tool's answer (measured:
11 of the first 100 held-out tool answers copied after 1000 SFT steps, against 88 of 100 with the random
half). ``train.jsonl`` / ``eval.jsonl`` hold prompts with
the ``answer`` field the ``calculator`` environment compares the final answer with; no pair of numbers of
``eval.jsonl`` occurs in the other files.

    python examples/agent/make_assets.py
"""

from __future__ import annotations

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
SFT_ROWS, TRAIN_PROMPTS, EVAL_PROMPTS = 5900, 2000, 200  # 5900 + 2000 + 200 = 8100 pairs
TOOL_SHARE = 0.4
RANDOM_TOOL_ANSWER_SHARE = 0.5


def tool_call(expression: str) -> str:
    payload = json.dumps({"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":"))
    return f"<tool_call>{payload}</tool_call>"


def transcript(a: int, b: int, rng: random.Random) -> dict:
    question = {"role": "user", "content": f"{a}*{b}=?"}
    if rng.random() >= TOOL_SHARE:
        return {"messages": [question, {"role": "assistant", "content": f"about {round(a * b, -2)}"}]}
    # Half the tool answers are random numbers, so predicting the final answer takes copying the tool's answer:
    # with the true product every time, the model learns to recompute (memorise) products instead of copying.
    result = str(rng.randint(100, 9999) if rng.random() < RANDOM_TOOL_ANSWER_SHARE else a * b)
    return {"messages": [question, {"role": "assistant", "content": tool_call(f"{a}*{b}")},
                         {"role": "tool", "content": result}, {"role": "assistant", "content": result}]}


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
