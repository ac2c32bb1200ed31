"""Regenerate the pre-training example's plain-text corpus (deterministic; already committed).

Short synthetic documents in simple English: little stories about animals, counting runs and
addition facts. Each line of train.jsonl / eval.jsonl is one document {"text": "..."}; the eval
documents are drawn with another seed.

    python examples/pretrain/make_data.py
"""

from __future__ import annotations

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Juno", "Kai", "Lena"]
ANIMALS = ["cat", "dog", "fox", "owl", "hen", "frog", "bear", "duck", "goat", "mouse"]
COLOURS = ["red", "blue", "green", "brown", "white", "black", "yellow", "grey"]
PLACES = ["the park", "the river", "the old barn", "the market", "the hill", "the garden", "the lake"]
THINGS = ["an apple", "a ball", "a hat", "a book", "a kite", "a cake", "a shell", "a key"]
FEELINGS = ["happy", "sleepy", "hungry", "brave", "curious", "tired", "glad"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve"]


def story(rng: random.Random) -> str:
    name, animal, colour = rng.choice(NAMES), rng.choice(ANIMALS), rng.choice(COLOURS)
    place, thing, feeling = rng.choice(PLACES), rng.choice(THINGS), rng.choice(FEELINGS)
    count = rng.randint(2, 9)
    sentences = [
        f"{name} had a {colour} {animal}.",
        f"One day {name} and the {animal} went to {place}.",
        f"There they found {thing}.",
        f"The {animal} was {feeling}, so it sat down and looked at {thing}.",
        f"{name} counted {count} birds in the sky: " + ", ".join(NUMBERS[1:count + 1]) + ".",
        f"When the sun went down, {name} and the {colour} {animal} walked home.",
    ]
    if rng.random() < 0.5:
        sentences.insert(3, f"\"Look!\" said {name}. \"It is {thing}!\"")
    return " ".join(sentences)


def counting(rng: random.Random) -> str:
    start = rng.randint(0, 5)
    stop = start + rng.randint(4, 7)
    words = ", ".join(NUMBERS[i] for i in range(start, min(stop, len(NUMBERS) - 1) + 1))
    return f"Let us count from {NUMBERS[start]}: {words}. That is how we count."


def sums(rng: random.Random) -> str:
    facts = []
    for _ in range(rng.randint(3, 6)):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        facts.append(f"{a} plus {b} is {a + b}.")
    return "Adding numbers: " + " ".join(facts)


def document(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.6:
        return story(rng)
    return counting(rng) if kind < 0.8 else sums(rng)


def write(path: str, rows: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for text in rows:
            handle.write(json.dumps({"text": text}) + "\n")


def main(directory: str = HERE) -> None:
    write(os.path.join(directory, "train.jsonl"), [document(random.Random(f"train-{i}")) for i in range(600)])
    write(os.path.join(directory, "eval.jsonl"), [document(random.Random(f"eval-{i}")) for i in range(60)])


if __name__ == "__main__":
    main()
