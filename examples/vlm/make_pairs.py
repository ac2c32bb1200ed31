"""Generate the VLM preference quickstart's data set: pictures of one coloured shape, each with a preference pair
"prefer the answer that names the picture's colour".

Deterministic (seeded); uses make_images.py's pictures. Writes ``images/pairs-*.png``, ``pairs_train.jsonl`` and
``pairs_eval.jsonl`` next to this script (generated, not committed). Every row is one preference pair in the
``vlm_preference`` format, the image path relative to the data file::

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "images/pairs-train-00000.png"},
                                               {"type": "text", "text": "What colour is the shape?"}]}],
     "chosen": "red", "rejected": "blue"}

The rejected answer is another colour, drawn at random. Held-out pictures are never seen in training.

    python examples/vlm/make_pairs.py [--train 512] [--eval 100]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random

from make_images import COLOURS, HERE, QUESTIONS, picture, write_jsonl


def pair_row(image_path: str, colour: str, rejected: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": image_path},
                                                      {"type": "text", "text": QUESTIONS["colour"]}]}],
            "chosen": colour, "rejected": rejected}


def build(out_dir: str = HERE, train: int = 512, evaluation: int = 100, seed: int = 1) -> tuple[list[dict], list[dict]]:
    """Write the pictures under ``out_dir/images`` and return (train pairs, held-out pairs)."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    seen: set[str] = set()
    splits: dict[str, list[dict]] = {"train": [], "eval": []}
    for split, n in (("train", train), ("eval", evaluation)):
        for i in range(n):
            image, colour = picture(rng, "colour")
            digest = hashlib.sha1(image.tobytes()).hexdigest()
            while split == "eval" and digest in seen:  # held out means never seen in training
                image, colour = picture(rng, "colour")
                digest = hashlib.sha1(image.tobytes()).hexdigest()
            seen.add(digest)
            name = f"images/pairs-{split}-{i:05d}.png"
            image.save(os.path.join(out_dir, name))
            rejected = rng.choice(sorted(set(COLOURS) - {colour}))
            splits[split].append(pair_row(name, colour, rejected))
    return splits["train"], splits["eval"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=HERE, help="directory for images/, pairs_train.jsonl and pairs_eval.jsonl")
    parser.add_argument("--train", type=int, default=512, help="training pairs")
    parser.add_argument("--eval", type=int, default=100, help="held-out pairs")
    args = parser.parse_args()
    train, evaluation = build(args.out, args.train, args.eval)
    write_jsonl(train, os.path.join(args.out, "pairs_train.jsonl"))
    write_jsonl(evaluation, os.path.join(args.out, "pairs_eval.jsonl"))
    print(f"wrote {len(train)} training and {len(evaluation)} held-out preference pairs to {args.out}")


if __name__ == "__main__":
    main()
