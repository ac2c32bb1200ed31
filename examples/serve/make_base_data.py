"""Regenerate base_train.jsonl, the corpus of the example's base model (deterministic; already committed).

The base model (base.yaml, trained with `twinkle train`) learns the quickstart's chat format and two of its three
string skills, ``reverse`` and ``double``; it never sees ``upper`` (nor any capital letter), which the tenants'
LoRA then teaches through the service. The words are fresh random words (examples/quickstart/make_assets.py's generator, another seed) with
every word of the quickstart's held-out chats (examples/quickstart/eval.jsonl) left out, so the held-out exact
match measured after the LoRA is still on words that no training run has seen.

    python examples/serve/make_base_data.py
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUICKSTART = HERE.parent / "quickstart"
sys.path.insert(0, str(QUICKSTART))

from make_assets import OPS, random_word, write_jsonl  # noqa: E402

# what the base knows: two of the quickstart's three skills; "upper" is left for the LoRA. (A base on "reverse" and
# "upper" alone stays on its loss plateau for hundreds of steps at this size: "double", the easiest copying skill,
# is what gets the small model off it.)
BASE_OPS = {"reverse": OPS["reverse"], "double": OPS["double"]}


def held_out_words() -> set[str]:
    """Every word of the quickstart's held-out chats."""
    words = set()
    with open(QUICKSTART / "eval.jsonl") as rows:
        for row in rows:
            for message in json.loads(row)["messages"]:
                if message["role"] == "user":
                    words.add(message["content"].split(": ", 1)[1])
    return words


def build_rows(seed: int = 1, chats: int = 3000) -> list[dict]:
    rng = random.Random(seed)
    excluded = held_out_words()
    vocabulary = sorted({random_word(rng) for _ in range(6000)} - excluded)
    rows = []
    for _ in range(chats):
        messages = []
        for word in (rng.choice(vocabulary) for _ in range(rng.randint(1, 3))):
            op = rng.choice(sorted(BASE_OPS))
            messages += [{"role": "user", "content": f"{op}: {word}"},
                         {"role": "assistant", "content": BASE_OPS[op](word)}]
        rows.append({"messages": messages})
    return rows


def main() -> None:
    rows = build_rows()
    write_jsonl(rows, str(HERE / "base_train.jsonl"))
    print(f"wrote {len(rows)} chats ({', '.join(BASE_OPS)}) to {HERE / 'base_train.jsonl'}")


if __name__ == "__main__":
    main()
