"""Generate the VLM video quickstart's data set: short clips of a coloured shape moving across the picture.

Deterministic (seeded). Writes ``videos/`` (one directory of 8 PNG frames per clip, 56 x 56 pixels), and
``video_train.jsonl`` / ``video_eval.jsonl`` next to this script; they are generated, not committed (see
``.gitignore``). Every row is one chat in the typed content-parts format, the frame directory relative to the data
file::

    {"messages": [{"role": "user", "content": [{"type": "video", "video": "videos/train-00000"},
                                               {"type": "text", "text": "Which way does the shape move?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "left"}]}]}

A clip is one shape (circle, triangle or cross, 24-30 pixels wide, of one of four colours) on a light background
that moves 3 pixels a frame from a random start, left or right (``--directions left,right,up,down`` adds vertical
motion). No frame alone tells the direction (a shape on the right is at the start of a clip that moves left and at
the end of one that moves right): the order of the frames does. Held-out clips are never seen in training (a
held-out clip whose frames equal a training clip's is drawn again). Every other training clip asks for the shape's
colour instead (``--no-colour-questions``: directions only); the held-out clips ask for the direction. Shapes of
12-18 pixels were too small: the tiny model did not even learn their colour from video (measured).

    python examples/vlm/make_videos.py [--train 800] [--eval 100] [--directions left,right] [--no-colour-questions]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random

from make_images import COLOURS, HERE, QUESTIONS, SHAPES, draw_shape, write_jsonl
from PIL import Image, ImageDraw

SIDE = 56    # pixels; the bundled image processor keeps 56 x 56 (4 x 4 patches of 14, 4 tokens per frame pair)
FRAMES = 8   # the temporal patch merges frame pairs: 4 time steps of 4 tokens each
QUESTION = "Which way does the shape move?"
COLOUR_QUESTION = QUESTIONS["colour"]
#: direction -> (dx, dy) of one pixel of motion
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
DEFAULT_DIRECTIONS = ("left", "right")


def clip(rng: random.Random, direction: str) -> tuple[list[Image.Image], str]:
    """The frames of one clip of a shape moving in ``direction``, and the shape's colour."""
    background = tuple(rng.randint(225, 255) for _ in range(3))
    colour_name, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
    colour = COLOURS[colour_name]
    size, speed = rng.randint(24, 30), 3
    travel = speed * (FRAMES - 1)
    dx, dy = DIRECTIONS[direction]
    # the start is chosen so the whole path stays inside the picture
    lo_x, hi_x = (travel, SIDE - size) if dx < 0 else (0, SIDE - size - travel * dx)
    lo_y, hi_y = (travel, SIDE - size) if dy < 0 else (0, SIDE - size - travel * dy)
    x, y = rng.randint(lo_x, hi_x), rng.randint(lo_y, hi_y)
    frames = []
    for step in range(FRAMES):
        image = Image.new("RGB", (SIDE, SIDE), background)
        left, top = x + dx * speed * step, y + dy * speed * step
        draw_shape(ImageDraw.Draw(image), shape, (left, top, left + size, top + size), colour)
        frames.append(image)
    return frames, colour_name


def row(video_dir: str, question: str, answer: str) -> dict:
    return {"messages": [
        {"role": "user", "content": [{"type": "video", "video": video_dir}, {"type": "text", "text": question}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]}


def _digest(frames: list[Image.Image]) -> str:
    return hashlib.sha1(b"".join(f.tobytes() for f in frames)).hexdigest()


def build(out_dir: str = HERE, train: int = 800, evaluation: int = 100,
          directions: tuple[str, ...] = DEFAULT_DIRECTIONS, seed: int = 0,
          colour_questions: bool = True) -> tuple[list[dict], list[dict]]:
    """Write the clips under ``out_dir/videos`` and return (train rows, held-out rows). Directions are asked in turn,
    so each split is balanced; with ``colour_questions`` every other training clip asks for the shape's colour
    instead (held-out rows always ask for the direction)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[dict]] = {"train": [], "eval": []}
    for split, n in (("train", train), ("eval", evaluation)):
        for i in range(n):
            colour_row = split == "train" and colour_questions and i % 2 == 1
            direction = directions[(i // 2 if split == "train" and colour_questions else i) % len(directions)]
            frames, colour = clip(rng, direction)
            while split == "eval" and _digest(frames) in seen:  # held out means never seen in training
                frames, colour = clip(rng, direction)
            seen.add(_digest(frames))
            name = f"videos/{split}-{i:05d}"
            os.makedirs(os.path.join(out_dir, name), exist_ok=True)
            for j, frame in enumerate(frames):
                frame.save(os.path.join(out_dir, name, f"frame_{j:02d}.png"))
            splits[split].append(row(name, COLOUR_QUESTION, colour) if colour_row else row(name, QUESTION, direction))
    return splits["train"], splits["eval"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=HERE, help="directory for videos/, video_train.jsonl and video_eval.jsonl")
    parser.add_argument("--train", type=int, default=800, help="training clips")
    parser.add_argument("--eval", type=int, default=100, help="held-out clips")
    parser.add_argument("--no-colour-questions", action="store_true",
                        help="ask only for the direction in training too (by default every other training clip asks "
                             "for the shape's colour, which teaches the vision tower to find the shape)")
    parser.add_argument("--directions", default=",".join(DEFAULT_DIRECTIONS),
                        help=f"directions of motion, of {sorted(DIRECTIONS)}")
    args = parser.parse_args()
    directions = tuple(d for d in args.directions.split(",") if d)
    unknown = sorted(set(directions) - set(DIRECTIONS))
    if unknown or not directions:
        parser.error(f"unknown directions {unknown}; choose from {sorted(DIRECTIONS)}")
    train, evaluation = build(args.out, args.train, args.eval, directions,
                              colour_questions=not args.no_colour_questions)
    write_jsonl(train, os.path.join(args.out, "video_train.jsonl"))
    write_jsonl(evaluation, os.path.join(args.out, "video_eval.jsonl"))
    print(f"wrote {len(train)} training and {len(evaluation)} held-out clips ({', '.join(directions)}) to {args.out}")


if __name__ == "__main__":
    main()
