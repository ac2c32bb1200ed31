"""Generate the VLM GRPO quickstart's data: colour questions about small pictures, and SFT labels with a
systematic error that the GRPO reward corrects.

Writes under ``grpo_data/`` next to this script (generated, not committed; see ``.gitignore``):

* ``images/``, ``train.jsonl``, ``eval.jsonl``: "What colour is the shape?" about pictures of make_images.py, with
  the true colour as the answer (the GRPO prompts and the held-out set; the reward compares against it);
* ``sft.jsonl``: the training rows again, but with a labelling error: a red or a blue shape is called "yellow" in
  ``--error-rate`` of the rows (0.6). A model fine-tuned on them answers those two colours wrong when decoding
  greedily, yet still samples the right word some of the time; a reward that checks the true colour is what fixes
  it. (Red mislabelled as "green" instead stayed wrong: the tiny vision tower had not learnt to tell red from green
  shapes apart after SFT, and GRPO's rewards alone did not teach it in 200 steps; measured.)

    python examples/vlm/make_grpo_data.py [--train 1000] [--eval 200] [--error-rate 0.6]
"""

from __future__ import annotations

import argparse
import copy
import os
import random

from make_images import HERE, build, write_jsonl

#: the error in the SFT labels: a true colour -> the colour the labeller wrote
MISLABEL = {"red": "yellow", "blue": "yellow"}


def mislabelled(rows: list[dict], rate: float, seed: int = 0) -> list[dict]:
    """``rows`` with :data:`MISLABEL` applied to the answer of about ``rate`` of the rows it concerns."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        row = copy.deepcopy(row)
        answer = row["messages"][-1]["content"][0]
        if answer["text"] in MISLABEL and rng.random() < rate:
            answer["text"] = MISLABEL[answer["text"]]
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "grpo_data"), help="directory for the data")
    parser.add_argument("--train", type=int, default=1000, help="training pictures")
    parser.add_argument("--eval", type=int, default=200, help="held-out pictures")
    parser.add_argument("--error-rate", type=float, default=0.6, help="share of red / blue rows mislabelled for SFT")
    args = parser.parse_args()
    train, evaluation = build(args.out, args.train, args.eval, ("colour",))
    write_jsonl(train, os.path.join(args.out, "train.jsonl"))
    write_jsonl(evaluation, os.path.join(args.out, "eval.jsonl"))
    write_jsonl(mislabelled(train, args.error_rate), os.path.join(args.out, "sft.jsonl"))
    print(f"wrote {len(train)} training and {len(evaluation)} held-out colour questions to {args.out} (sft.jsonl: "
          f"red and blue called yellow in {args.error_rate:.0%} of those rows)")


if __name__ == "__main__":
    main()
