"""Regenerate the DPO quickstart's data sets (deterministic, seeded; already committed).

The quickstart's string transformations (``reverse`` / ``upper`` / ``double``), on 4-letter words,
each with a *plausible wrong* answer: echoing the word back unchanged.

    op       prompt          correct (chosen)   plausible wrong (rejected)
    reverse  reverse: moan   naom               moan
    upper    upper: moan     MOAN               moan
    double   double: moan    mmooaann           moan

1. ``sft.jsonl``: single-turn chats in which, for every operation, half the answers are correct and
   half are the echo. A short SFT on it (``sft.yaml``) gives a model that answers with one of the two
   but has no reason to prefer the right one (it mostly echoes).
2. ``train.jsonl``: preference pairs (chosen = correct, rejected = echo) on training words;
   ``eval.jsonl``: pairs on held-out words that occur in neither ``sft.jsonl`` nor ``train.jsonl``.

The tokenizer (``examples/quickstart/tokenizer``) and the word generator are the quickstart's.

    python examples/dpo/make_assets.py
"""

from __future__ import annotations

import importlib.util
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))


def _quickstart():
    """The quickstart's make_assets.py, loaded under its own name (this file has the same one)."""
    path = os.path.join(os.path.dirname(HERE), "quickstart", "make_assets.py")
    spec = importlib.util.spec_from_file_location("quickstart_make_assets", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_qs = _quickstart()
OPS, random_word, write_jsonl = _qs.OPS, _qs.random_word, _qs.write_jsonl

#: the plausible wrong answer of each operation: echoing the word back unchanged (the lazy answer).
#: Words are chosen so that it differs from the correct answer at the first token (reverse, upper) or
#: the second (double). Subtler variants (first and last letters swapped, only the first letter
#: upper-cased, the word twice) make the two answers diverge mid-sequence; the tiny model then needs
#: far longer than the budget to learn to stay consistent (see README.md).
WRONG = {
    "reverse": lambda w: w,
    "upper": lambda w: w,
    "double": lambda w: w,
}

SEED = 0
WORD_LENGTH = 4           # of the quickstart's words (3 to 6 letters) only these: a much faster SFT
HELD_OUT_WORDS = 300
SFT_ROWS = 3000
SFT_CORRECT_SHARE = 0.5   # per operation
TRAIN_PAIRS = 2000
EVAL_PAIRS = 300          # 100 per operation


def usable(word: str) -> bool:
    """The echo differs from the correct answer at the first token (reverse) or the second (double)."""
    return len(word) == WORD_LENGTH and word[0] != word[-1] and word[0] != word[1]


def vocabulary(rng: random.Random, size: int = 12000) -> list[str]:
    words = sorted({w for w in (random_word(rng) for _ in range(size)) if usable(w)})
    rng.shuffle(words)
    return words


def sft_rows(rng: random.Random, words: list[str], n: int, correct_share: float) -> list[dict]:
    ops = sorted(OPS)
    per_op = n // len(ops)
    rows = []
    for op in ops:
        n_correct = round(per_op * correct_share)
        flags = [True] * n_correct + [False] * (per_op - n_correct)
        rng.shuffle(flags)
        for correct in flags:
            word = rng.choice(words)
            answer = OPS[op](word) if correct else WRONG[op](word)
            rows.append({"messages": [{"role": "user", "content": f"{op}: {word}"},
                                      {"role": "assistant", "content": answer}]})
    rng.shuffle(rows)
    return rows


def pair(op: str, word: str) -> dict:
    return {"messages": [{"role": "user", "content": f"{op}: {word}"}],
            "chosen": OPS[op](word), "rejected": WRONG[op](word)}


def build(seed: int = SEED) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    words = vocabulary(rng)
    held_out, seen = words[:HELD_OUT_WORDS], words[HELD_OUT_WORDS:]
    ops = sorted(OPS)
    sft = sft_rows(rng, seen, SFT_ROWS, SFT_CORRECT_SHARE)
    train = [pair(rng.choice(ops), rng.choice(seen)) for _ in range(TRAIN_PAIRS)]
    # every held-out word once, the operations balanced
    evaluation = [pair(ops[i % len(ops)], word) for i, word in enumerate(held_out[:EVAL_PAIRS])]
    return {"sft.jsonl": sft, "train.jsonl": train, "eval.jsonl": evaluation}


def main() -> None:
    for name, rows in build().items():
        write_jsonl(rows, os.path.join(HERE, name))
        print(f"wrote {len(rows)} rows to {os.path.join(HERE, name)}")


if __name__ == "__main__":
    main()
