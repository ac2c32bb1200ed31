"""``twinkle data preview``: a recipe's samples as the collator hands them to training, trained tokens marked, and
the per-source counts of a mixture. The quickstart's bundled tokenizer and data: nothing is downloaded, no model is
built."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from twinkle_core import cli
from twinkle_core.commands.data_preview import CLOSE, GREEN, OPEN, RESET, Preview, load_preview, preview_lines
from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_core.train.recipe import load_recipe

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart" / "recipe.yaml"
MARKED = re.compile(re.escape(OPEN) + "(.*?)" + re.escape(CLOSE), re.DOTALL)


def trained_runs(batch) -> list[list[int]]:
    """The runs of consecutive trained token ids of a one-row batch, from its labels."""
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    runs: list[list[int]] = []
    previous = False
    for token, label in zip(ids, labels, strict=True):
        trained = label != IGNORE_INDEX
        if trained:
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = trained
    return runs


def samples(lines: list[str]) -> list[tuple[str, str]]:
    """``(header, text)`` of each shown sample."""
    return [(lines[i], lines[i + 1]) for i, line in enumerate(lines) if line.startswith("--- sample")]


def test_the_marked_text_is_what_the_collator_trains_on(tmp_path):
    recipe = load_recipe(QUICKSTART, [f"train.output_dir={tmp_path / 'run'}"])
    preview = load_preview(recipe)
    lines = list(preview_lines(preview, samples=3, color=False))
    assert lines[0] == "3000 samples; showing 3"
    assert lines[1] == "legend: trained tokens (labels != -100) are [[between double brackets]]; the rest is context"
    shown = samples(lines)
    assert len(shown) == 3
    tokenizer = preview.tokenizer
    for index, (header, text) in enumerate(shown):
        batch = preview.task.collate([preview.dataset[index]])
        runs = trained_runs(batch)
        assert runs, "every quickstart sample trains its assistant turns"
        assert MARKED.findall(text) == [tokenizer.decode(run, skip_special_tokens=False) for run in runs]
        whole = tokenizer.decode(batch["input_ids"][0].tolist(), skip_special_tokens=False)
        assert text.replace(OPEN, "").replace(CLOSE, "") == whole
        trained = int((batch["labels"][0] != IGNORE_INDEX).sum())
        assert header == f"--- sample {index + 1}: {batch['input_ids'].shape[1]} tokens, {trained} trained"
    assert not (tmp_path / "run").exists()  # nothing written into the run's directory


def test_colour_marks_the_same_tokens(tmp_path):
    recipe = load_recipe(QUICKSTART, [f"train.output_dir={tmp_path / 'run'}"])
    preview = load_preview(recipe)
    plain = [text for _, text in samples(list(preview_lines(preview, samples=1, color=False)))]
    coloured = [text for _, text in samples(list(preview_lines(preview, samples=1, color=True)))]
    assert [t.replace(GREEN, OPEN).replace(RESET, CLOSE) for t in coloured] == plain


def write_chats(path: Path, n: int, word: str) -> str:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"upper: {word}{i}"},
                                                     {"role": "assistant", "content": f"{word.upper()}{i}"}]}) + "\n"
                            for i in range(n)))
    return str(path)


def test_the_command_prints_the_counts_of_a_two_source_mixture(tmp_path, capsys):
    a = write_chats(tmp_path / "a.jsonl", 6, "ab")
    b = write_chats(tmp_path / "b.jsonl", 2, "cd")
    spec = json.dumps([{"path": a, "weight": 3}, {"path": b, "weight": 1}])
    code = cli.main(["data", "preview", str(QUICKSTART), f"data.train={spec}", f"train.output_dir={tmp_path / 'run'}",
                     "-n", "2", "--color", "never"])
    assert code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    # 8 rows split 3:1: a.jsonl gives 6 (all its rows), b.jsonl 2
    assert lines[0] == "data: 2 sources, 8 rows: a.jsonl 6 (weight 3), b.jsonl 2 (weight 1)"
    assert lines[1] == "8 samples; showing 2"
    assert "upper: ab0<|im_end|>\n<|im_start|>assistant\n[[AB0<|im_end|>]]" in out  # the first row, its answer marked
    assert sum(line.startswith("--- sample ") for line in lines) == 2


def test_bad_arguments_name_the_fix(tmp_path, capsys):
    recipe = load_recipe(QUICKSTART, [f"train.output_dir={tmp_path / 'run'}", "data.eval=null"])
    with pytest.raises(ConfigError, match="no data.eval"):
        load_preview(recipe, split="eval")
    assert cli.main(["data", "preview", str(QUICKSTART), "-n", "0"]) == 2
    assert "-n 0: show at least one sample" in capsys.readouterr().err


@dataclass
class PromptRow:
    prompt_ids: list[int]
    text: str


class PairsAndPromptsTask:
    """Collates a pair row into a chosen and a rejected sequence (padded, as a preference task does) and a prompt
    row into a batch without labels (as an online RL task does)."""

    def collate(self, features):
        [feature] = features
        if isinstance(feature, PromptRow):
            return {"prompts": [feature]}
        pad = IGNORE_INDEX
        return {"input_ids": torch.tensor([[5, 6, 7], [5, 8, 0]]), "labels": torch.tensor([[pad, 6, 7], [pad, 8, pad]]),
                "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]), "is_chosen": torch.tensor([True, False])}

    def close(self):
        pass


class LetterTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i) for i in ids)


def test_pairs_show_chosen_and_rejected_and_rows_without_labels_say_so():
    pairs = Preview(PairsAndPromptsTask(), LetterTokenizer(), ["pair"], "pairs.jsonl")
    lines = list(preview_lines(pairs, samples=5, color=False))
    assert lines[2:] == ["--- sample 1 chosen: 3 tokens, 2 trained", "f[[gh]]",
                         "--- sample 1 rejected: 2 tokens, 1 trained", "f[[i]]"]  # the padding is not shown
    prompts = Preview(PairsAndPromptsTask(), LetterTokenizer(), [PromptRow([0, 1], "say: ab")], "prompts.jsonl")
    lines = list(preview_lines(prompts, samples=1, color=False))
    assert lines[1].startswith("the task's batches carry no labels, so no token is marked")
    assert lines[2:] == ["--- sample 1", "text: say: ab"]
