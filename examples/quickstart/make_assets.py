"""Regenerate the quickstart's bundled data set and tokenizer (deterministic; already committed).

The task: multi-turn chats in which the user asks for string transformations of random lowercase
words ("reverse: kdoq", "upper: kdoq", "double: kdo") and the assistant answers. Every assistant
turn is trained; evaluation is exact match on the last turn of held-out chats whose words never
occur in training.

    python examples/quickstart/make_assets.py
"""

from __future__ import annotations

import json
import os
import random
import string

HERE = os.path.dirname(os.path.abspath(__file__))
OPS = {
    "reverse": lambda w: w[::-1],
    "upper": lambda w: w.upper(),
    "double": lambda w: "".join(c + c for c in w),
}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant"]  # template words kept whole, so prompts stay short
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def random_word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))


def chat(rng: random.Random, words: list[str]) -> dict:
    messages = []
    for word in words:
        op = rng.choice(sorted(OPS))
        messages += [{"role": "user", "content": f"{op}: {word}"},
                     {"role": "assistant", "content": OPS[op](word)}]
    return {"messages": messages}


def build_rows(seed: int = 0, train_chats: int = 3000, eval_chats: int = 200) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    vocabulary = sorted({random_word(rng) for _ in range(6000)})
    rng.shuffle(vocabulary)
    held_out, seen = vocabulary[:600], vocabulary[600:]
    train = [chat(rng, [rng.choice(seen) for _ in range(rng.randint(1, 3))]) for _ in range(train_chats)]
    evaluation = [chat(rng, [rng.choice(held_out) for _ in range(rng.randint(1, 2))]) for _ in range(eval_chats)]
    return train, evaluation


def train_tokenizer(rows: list[dict], out_dir: str) -> None:
    """A character-level byte-level BPE (no merges) trained on the data.

    Byte-level, like Qwen2's own tokenizer: transformers 5 loads a tokenizer saved next to a qwen2
    config.json as ``Qwen2Tokenizer``, which re-applies byte-level pre-tokenisation, so any other
    scheme would not survive the round trip through a checkpoint.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    texts = [m["content"] for row in rows for m in row["messages"]] + [string.printable]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + len(SPECIAL), special_tokens=SPECIAL,
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens(WORDS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def write_jsonl(rows: list[dict], path: str) -> None:
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def main() -> None:
    train, evaluation = build_rows()
    write_jsonl(train, os.path.join(HERE, "train.jsonl"))
    write_jsonl(evaluation, os.path.join(HERE, "eval.jsonl"))
    train_tokenizer(train, os.path.join(HERE, "tokenizer"))
    print(f"wrote {len(train)} training and {len(evaluation)} held-out chats and the tokenizer to {HERE}")


if __name__ == "__main__":
    main()
