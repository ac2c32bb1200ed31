"""Write pairs_train.jsonl / pairs_eval.jsonl: the DPO quickstart's prompts and right answers (chosen) against
several kinds of wrong answer (rejected), not only the echo of ``../dpo/train.jsonl``.

A reward model trained on echo-only pairs learns "not an echo" rather than "right": GRPO against it raises its
score while exact match falls (README). Each rejected answer here is one of: the word echoed back, two adjacent
letters swapped, a letter dropped, a letter inserted, a letter changed. Deterministic (seed 0).

    python examples/reward_model/make_pairs.py
"""

import json
import random
import string
from pathlib import Path

HERE = Path(__file__).resolve().parent
DPO = HERE.parent / "dpo"


def wrong(rng: random.Random, answer: str, word: str) -> str:
    kind = rng.choice(["echo", "swap", "drop", "insert", "change"])
    if kind == "echo" and word != answer:
        return word
    chars = list(answer)
    if kind == "swap" and len(chars) > 1:
        i = rng.randrange(len(chars) - 1)
        chars[i], chars[i + 1] = chars[i + 1], chars[i]
    elif kind == "drop" and len(chars) > 1:
        del chars[rng.randrange(len(chars))]
    elif kind == "insert":
        chars.insert(rng.randrange(len(chars) + 1), rng.choice(string.ascii_lowercase))
    else:
        i = rng.randrange(len(chars))
        chars[i] = chars[i].lower() if chars[i].isupper() else rng.choice(string.ascii_lowercase.replace(chars[i], ""))
    result = "".join(chars)
    return result if result != answer else answer + rng.choice(string.ascii_lowercase)


def main() -> None:
    rng = random.Random(0)
    for source, target in (("train.jsonl", "pairs_train.jsonl"), ("eval.jsonl", "pairs_eval.jsonl")):
        rows = [json.loads(line) for line in (DPO / source).read_text().splitlines() if line.strip()]
        with open(HERE / target, "w") as out:
            for row in rows:
                word = row["messages"][0]["content"].split(": ", 1)[1]
                out.write(json.dumps({**row, "rejected": wrong(rng, row["chosen"], word)}) + "\n")
        print(f"wrote {len(rows)} pairs to {HERE / target}")


if __name__ == "__main__":
    main()
