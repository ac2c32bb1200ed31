"""Regenerate the embedding quickstart's retrieval data set (deterministic; the output is committed).

The world: fictional towns with invented names. Each town has one short passage on each of six
topics (climate, trade, food, history, festival, travel), written from templates with randomly
drawn details. A query asks about one topic of one town, in words that rarely appear in the
passage ("Should I pack a warm coat for Velmora?" -> the climate passage of Velmora).

* ``train.jsonl``: towns 0..59, one query per (town, topic) = 360 rows, each with 1-2 hard
  negatives (another topic of the same town, the same topic of another town).
* ``eval.jsonl``: towns 60..79 (never seen in training), one query per (town, topic) = 120 rows,
  asked with query templates that training never uses; the corpus is their 120 passages.

So the held-out queries never appear in training, nor do their towns or their phrasings.

    python examples/embedding/make_data.py
"""

from __future__ import annotations

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 7
TRAIN_TOWNS, EVAL_TOWNS = 60, 20

ONSETS = ["b", "br", "d", "dr", "f", "g", "gl", "k", "kr", "l", "m", "n", "p", "qu", "r", "s", "st", "t", "th",
          "tr", "v", "w", "z"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "io", "ou"]
CODAS = ["", "n", "r", "l", "s", "th", "m", "x", "nd", "rk"]
ENDINGS = ["a", "ia", "or", "en", "ith", "ost", "une", "ara", "um", "ey"]

DETAILS = {
    "climate": {
        "values": [("snow", "bitter winters with deep snow from autumn to spring"),
                   ("rain", "a damp sky: it rains on most days and fog rolls in every evening"),
                   ("heat", "long scorching summers, when the afternoon heat empties the streets"),
                   ("wind", "fierce winds off the sea that bend the trees and rattle the shutters"),
                   ("mild", "a gentle climate, neither hot nor cold, with clear skies nearly all year")],
        "passages": ["Visitors travelling to {town} should expect {v}.", "Merchants in {town} curse {v}.",
                     "Festival nights in {town} are spoiled by {v}."],
    },
    "trade": {
        "values": [("copper", "copper ore dug from the hills"), ("wool", "wool from its mountain sheep"),
                   ("glass", "coloured glass blown in small workshops"), ("salt", "salt raked from coastal pans"),
                   ("timber", "timber floated down the river"), ("dye", "indigo dye pressed from marsh plants")],
        "passages": ["Carts taking the road out of {town} carry {v}.", "On feast days the market of {town} sells {v}.",
                     "The families of {town} have always lived off {v}."],
    },
    "food": {
        "values": [("fish", "smoked river fish served with barley bread"), ("stew", "a thick lamb and bean stew"),
                   ("dumplings", "mushroom dumplings fried in butter"), ("pie", "pies of goat cheese and wild herbs"),
                   ("porridge", "sweet chestnut porridge with honey"), ("noodles", "cold noodles in a sour plum broth")],
        "passages": ["At every celebration {town} serves {v}.", "Travellers stopping in {town} are fed {v}.",
                     "Since its founding, the homes of {town} have cooked {v}."],
    },
    "history": {
        "values": [("monks", "a band of wandering monks"), ("miners", "miners following a silver vein"),
                   ("fishermen", "fishermen sheltering from a storm"), ("exiles", "exiles banished from the capital"),
                   ("traders", "traders who camped at the river ford"), ("soldiers", "soldiers guarding a mountain pass")],
        "passages": ["Long before any road reached {town}, it was settled by {v}.",
                     "The houses of {town} were first raised by {v}.", "Tales told at {town}'s feasts name {v} as its founders."],
    },
    "festival": {
        "values": [("lanterns", "a parade of paper lanterns on the lake"), ("horses", "horse races through the square"),
                   ("masks", "a march in carved wooden masks"), ("bonfires", "bonfires lit on the hilltops"),
                   ("music", "three nights of drums and flutes"), ("flowers", "garlands of flowers on every door")],
        "passages": ["Once a year the people of {town} stop work for {v}.", "Visitors come to {town} each spring for {v}.",
                     "The oldest custom of {town}, kept since it was founded, is {v}."],
    },
    "travel": {
        "values": [("ferry", "a slow ferry across the bay"), ("train", "a narrow-gauge railway through the pines"),
                   ("mule", "a mule track over the ridge"), ("canal", "a canal barge from the lowlands"),
                   ("road", "a paved road along the valley"), ("bridge", "a long rope bridge over the gorge")],
        "passages": ["Merchants bringing goods to {town} come by {v}.", "For the yearly feast, guests reach {town} by {v}.",
                     "The only way into {town} is {v}."],
    },
}

# (training templates, held-out templates): the held-out ones are only used for evaluation queries
QUERIES = {
    "climate": (["Should I pack a warm coat for a trip to {town}?", "What is it like outside in {town} most of the year?",
                 "Do people in {town} complain about the sky?"],
                ["Will I need an umbrella or sunscreen when I visit {town}?", "How does the air feel in {town}?"]),
    "trade": (["What does {town} sell to other places?", "How do the people of {town} earn a living?",
               "Which goods are shipped out of {town}?"],
              ["What keeps the economy of {town} going?", "Where does the money in {town} come from?"]),
    "food": (["What would I eat for supper in {town}?", "Which dish is typical of {town}?",
              "What is on the table at home in {town}?"],
             ["What is the local cuisine of {town}?", "Which meal should a guest try in {town}?"]),
    "history": (["Who built {town} in the first place?", "How did {town} get started?",
                 "Who were the earliest people to live in {town}?"],
                ["What are the origins of {town}?", "Who established {town}?"]),
    "festival": (["How does {town} throw a party?", "What happens in {town} on its holiday?",
                  "What is the big yearly celebration in {town}?"],
                 ["Which tradition makes {town} famous once a year?", "What do locals of {town} do to celebrate?"]),
    "travel": (["How can I get to {town}?", "What transport goes to {town}?", "Which route leads into {town}?"],
               ["How do visitors arrive at {town}?", "What is the journey to {town} like?"]),
}
TOPICS = sorted(DETAILS)


def town_names(rng: random.Random, count: int) -> list[str]:
    names: set[str] = set()
    while len(names) < count:
        name = rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) + rng.choice(ONSETS) + rng.choice(ENDINGS)
        names.add(name.capitalize())
    ordered = sorted(names)
    rng.shuffle(ordered)
    return ordered


def passages_of(rng: random.Random, town: str) -> dict[str, str]:
    out = {}
    for topic in TOPICS:
        spec = DETAILS[topic]
        _, value = rng.choice(spec["values"])
        out[topic] = rng.choice(spec["passages"]).format(town=town, v=value)
    return out


def build(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    towns = town_names(rng, TRAIN_TOWNS + EVAL_TOWNS)
    passages = {town: passages_of(rng, town) for town in towns}
    splits = {"train": towns[:TRAIN_TOWNS], "eval": towns[TRAIN_TOWNS:]}
    rows: dict[str, list[dict]] = {"train": [], "eval": []}
    for split, members in splits.items():
        for town in members:
            for topic in TOPICS:
                templates = QUERIES[topic][0 if split == "train" else 1]
                query = rng.choice(templates).format(town=town)
                other_topic = rng.choice([t for t in TOPICS if t != topic])
                other_town = rng.choice([t for t in members if t != town])
                negatives = [passages[town][other_topic], passages[other_town][topic]]
                negatives = negatives[: rng.randint(1, 2)]
                rows[split].append({"query": query, "positive": passages[town][topic], "negatives": negatives})
        rng.shuffle(rows[split])
    train_queries = {r["query"] for r in rows["train"]}
    assert not train_queries & {r["query"] for r in rows["eval"]}, "a held-out query appears in training"
    return rows["train"], rows["eval"]


def write_jsonl(rows: list[dict], path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    train, evaluation = build()
    write_jsonl(train, os.path.join(HERE, "train.jsonl"))
    write_jsonl(evaluation, os.path.join(HERE, "eval.jsonl"))
    print(f"wrote {len(train)} training rows and {len(evaluation)} held-out rows to {HERE}")


if __name__ == "__main__":
    main()
