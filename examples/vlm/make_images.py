"""Generate the VLM quickstart's data set: small pictures of coloured shapes and questions about them.

Deterministic (seeded). Writes ``images/`` (PNG files), ``train.jsonl`` and ``eval.jsonl`` next to this
script; they are generated, not committed (see ``.gitignore``). Every row is one chat in the typed
content-parts format, the image path relative to the data file::

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "images/train-00000.png"},
                                               {"type": "text", "text": "What colour is the shape?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]}

Questions ask for the colour (red, green, blue, yellow) or the kind (circle, triangle, cross) of a single
object, on which side (left, right) it lies, or how many objects (one, two, three) a picture holds.
Held-out pictures are never seen in training: every picture is drawn from its own random layout and a
held-out picture whose pixels equal a training picture's is drawn again.

    python examples/vlm/make_images.py [--train 3000] [--eval 200] [--kinds colour,shape]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random

from PIL import Image, ImageDraw

HERE = os.path.dirname(os.path.abspath(__file__))
SIDE = 56  # pixels; the bundled image processor keeps 56 x 56 (4 image tokens)
COLOURS = {"red": (220, 40, 40), "green": (30, 170, 60), "blue": (40, 80, 230), "yellow": (235, 200, 30)}
# a square is left out on purpose: a tiny vision tower from scratch tells it from a circle only slowly
SHAPES = ("circle", "triangle", "cross")
COUNT_WORDS = {1: "one", 2: "two", 3: "three"}
QUESTIONS = {
    "colour": "What colour is the shape?",
    "shape": "What shape is it?",
    "count": "How many shapes are there?",
    "side": "Is the shape on the left or the right?",
}
#: question kinds the quickstart trains on (asked in turn)
DEFAULT_KINDS = ("colour", "shape", "side", "count")


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour: tuple) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=colour)
    else:  # a cross: two bars a third of the box wide
        third = (x1 - x0) // 3
        draw.rectangle((x0 + third, y0, x1 - third, y1), fill=colour)
        draw.rectangle((x0, y0 + third, x1, y1 - third), fill=colour)


def random_box(rng: random.Random, x_range: tuple[int, int], size: int) -> tuple[int, int, int, int]:
    x = rng.randint(x_range[0], x_range[1] - size)
    y = rng.randint(0, SIDE - size)
    return x, y, x + size, y + size


def picture(rng: random.Random, kind: str) -> tuple[Image.Image, str]:
    """One picture and the answer to the question of ``kind`` about it."""
    background = tuple(rng.randint(225, 255) for _ in range(3))
    image = Image.new("RGB", (SIDE, SIDE), background)
    draw = ImageDraw.Draw(image)
    colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
    if kind == "count":
        # 1-3 objects of one colour and shape, each in its own third of the picture, so none overlap
        count = rng.randint(1, 3)
        for third in rng.sample(range(3), count):
            draw_shape(draw, shape, _third_box(rng, third), COLOURS[colour])
        return image, COUNT_WORDS[count]
    if kind == "shape":  # near the centre: which shape it is, not where, is the question
        size = rng.randint(30, 44)
        x, y = ((SIDE - size) // 2 + rng.randint(-3, 3) for _ in range(2))
        draw_shape(draw, shape, (x, y, x + size, y + size), COLOURS[colour])
        return image, shape
    size = rng.randint(22, 36)
    if kind == "side":
        side = rng.choice(("left", "right"))
        half = (0, SIDE // 2) if side == "left" else (SIDE // 2, SIDE)
        draw_shape(draw, shape, random_box(rng, half, rng.randint(14, 24)), COLOURS[colour])
        return image, side
    draw_shape(draw, shape, random_box(rng, (0, SIDE), size), COLOURS[colour])
    return image, colour if kind == "colour" else shape


def _third_box(rng: random.Random, third: int) -> tuple[int, int, int, int]:
    """A box of 14-18 pixels inside the ``third``-th horizontal band of the picture."""
    size = rng.randint(14, 18)
    top = third * SIDE // 3
    y = rng.randint(top, top + SIDE // 3 - size)
    x = rng.randint(0, SIDE - size)
    return x, y, x + size, y + size


def row(image_path: str, kind: str, answer: str) -> dict:
    return {"messages": [
        {"role": "user", "content": [{"type": "image", "image": image_path},
                                     {"type": "text", "text": QUESTIONS[kind]}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]}


def build(out_dir: str = HERE, train: int = 3000, evaluation: int = 200, kinds: tuple[str, ...] = DEFAULT_KINDS,
          seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Write the pictures under ``out_dir/images`` and return (train rows, held-out rows)."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    seen: set[str] = set()
    splits: dict[str, list[dict]] = {"train": [], "eval": []}
    for split, n in (("train", train), ("eval", evaluation)):
        for i in range(n):
            kind = kinds[i % len(kinds)]
            image, answer = picture(rng, kind)
            digest = hashlib.sha1(image.tobytes()).hexdigest()
            while split == "eval" and digest in seen:  # held out means never seen in training
                image, answer = picture(rng, kind)
                digest = hashlib.sha1(image.tobytes()).hexdigest()
            seen.add(digest)
            name = f"images/{split}-{i:05d}.png"
            image.save(os.path.join(out_dir, name))
            splits[split].append(row(name, kind, answer))
    return splits["train"], splits["eval"]


def write_jsonl(rows: list[dict], path: str) -> None:
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=HERE, help="directory for images/, train.jsonl and eval.jsonl")
    parser.add_argument("--train", type=int, default=3000, help="training pictures")
    parser.add_argument("--eval", type=int, default=200, help="held-out pictures")
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help=f"question kinds, of {sorted(QUESTIONS)}")
    args = parser.parse_args()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = sorted(set(kinds) - set(QUESTIONS))
    if unknown:
        parser.error(f"unknown question kinds {unknown}; choose from {sorted(QUESTIONS)}")
    train, evaluation = build(args.out, args.train, args.eval, kinds)
    write_jsonl(train, os.path.join(args.out, "train.jsonl"))
    write_jsonl(evaluation, os.path.join(args.out, "eval.jsonl"))
    print(f"wrote {len(train)} training and {len(evaluation)} held-out pictures ({', '.join(kinds)}) to {args.out}")


if __name__ == "__main__":
    main()
