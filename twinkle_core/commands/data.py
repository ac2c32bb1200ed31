"""``twinkle data preview RECIPE.yaml [KEY=VALUE ...] [-n 3] [--split train|eval] [--color auto|always|never]``:
a recipe's samples as training reads them, with the trained tokens marked, and the per-source row counts of a
mixture of several sources (:mod:`twinkle_core.commands.data_preview`).

The task and tokenizer come from the recipe exactly as ``twinkle train`` builds them; the model is not built and
nothing is written. Trained tokens (``labels != -100``) are green on a terminal and between ``[[`` ``]]``
otherwise.
"""

from __future__ import annotations

import argparse
import sys

from twinkle_core.commands import Command, take_recipe_overrides
from twinkle_core.errors import ConfigError

COLORS = ("auto", "always", "never")


class DataCommand(Command):
    description = ("Look at a recipe's data as training reads it. preview: templated samples with the trained tokens "
                   "marked (green on a terminal, [[between brackets]] otherwise) and the per-source counts of a "
                   "mixture.")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
        preview = actions.add_parser("preview", help="print templated samples with their trained tokens marked",
                                     description=self.description)
        preview.add_argument("recipe", help="the recipe YAML file")
        preview.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides (as twinkle train)")
        preview.add_argument("-n", "--samples", type=int, default=3, help="how many samples to show (default 3)")
        preview.add_argument("--split", choices=("train", "eval"), default="train",
                             help="data.train (default) or data.eval")
        preview.add_argument("--color", choices=COLORS, default="auto",
                             help="colour the trained tokens: auto (on a terminal, default), always, never ([[ ]])")

    def take_unparsed(self, args: argparse.Namespace, unparsed: list[str]) -> list[str]:
        return take_recipe_overrides(args, unparsed)

    def run(self, args: argparse.Namespace) -> int:
        from twinkle_core.commands.data_preview import load_preview, preview_lines
        from twinkle_core.train.recipe import load_recipe

        if args.samples < 1:
            raise ConfigError(f"-n {args.samples}: show at least one sample")
        recipe = load_recipe(args.recipe, args.overrides)
        color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
        preview = load_preview(recipe, split=args.split)
        try:
            for line in preview_lines(preview, samples=args.samples, color=color):
                print(line)
        finally:
            preview.task.close()
        return 0
