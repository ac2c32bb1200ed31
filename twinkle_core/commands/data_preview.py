"""What ``twinkle data preview`` shows: a recipe's samples as the collator hands them to the model, with the trained
tokens marked, and the per-source row counts of a mixture.

The task and the tokenizer are built by the code ``twinkle train`` uses (:mod:`twinkle_core.train.build`), the data
is read by the task's own ``load_dataset`` with the recipe's data options, and each sample is collated alone by the
task's ``collate``: what is shown is exactly what training reads, without building the model. A token is *trained*
where the batch's ``labels`` is not ``IGNORE_INDEX`` (-100); the labels are aligned with ``input_ids`` (the loss
shifts them), so the marked tokens are those the model learns to predict.

Marks: on a terminal (or ``color="always"``) the trained tokens are green; otherwise they stand between ``[[`` and
``]]``. A task whose batches carry no ``labels`` (online RL: prompts, whose completions are sampled during training;
embedding pairs) gets its rows shown as the data loader yields them (their text fields), with a line saying so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError

#: the marks around trained tokens in plain text
OPEN, CLOSE = "[[", "]]"
#: the colour of trained tokens on a terminal (ANSI green) and the reset after them
GREEN, RESET = "\x1b[32m", "\x1b[0m"
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class SequenceView:
    """One sequence of a collated sample: its tokens, which of them are trained, and what it is (``chosen`` /
    ``rejected`` for a preference pair, else empty)."""

    input_ids: list[int]
    trained: list[bool]
    role: str = ""

    @property
    def trained_tokens(self) -> int:
        return sum(self.trained)


def spans(view: SequenceView) -> Iterator[tuple[bool, list[int]]]:
    """``(trained, token ids)`` runs of ``view``, in order."""
    start = 0
    for i in range(1, len(view.input_ids) + 1):
        if i == len(view.input_ids) or view.trained[i] != view.trained[start]:
            yield view.trained[start], view.input_ids[start:i]
            start = i


def render(view: SequenceView, tokenizer: Any, *, color: bool) -> str:
    """The text of ``view`` with its trained runs marked (green, or between ``[[`` ``]]``)."""
    parts = []
    for trained, ids in spans(view):
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if trained:
            text = f"{GREEN}{text}{RESET}" if color else f"{OPEN}{text}{CLOSE}"
        parts.append(text)
    return "".join(parts)


def sequences(batch: dict[str, Any]) -> list[SequenceView]:
    """The sequences of one collated sample (several for a preference pair or a packed row's rows), without
    padding; empty when the batch has no ``labels``."""
    if "labels" not in batch or "input_ids" not in batch:
        return []
    ids, labels = batch["input_ids"].tolist(), batch["labels"].tolist()
    mask = batch["attention_mask"].tolist() if batch.get("attention_mask") is not None else None
    chosen = batch["is_chosen"].tolist() if batch.get("is_chosen") is not None else None
    views = []
    for row, (row_ids, row_labels) in enumerate(zip(ids, labels, strict=True)):
        keep = [i for i in range(len(row_ids)) if mask is None or mask[row][i]]
        role = ("chosen" if chosen[row] else "rejected") if chosen is not None else ""
        views.append(SequenceView([row_ids[i] for i in keep], [row_labels[i] != IGNORE_INDEX for i in keep], role))
    return views


def unlabelled_text(feature: Any, tokenizer: Any) -> str:
    """What a row without labels holds, as text: its text fields (``name: value`` lines), else its decoded
    ``prompt_ids`` / ``input_ids``, else its ``repr``."""
    if dataclasses.is_dataclass(feature) and not isinstance(feature, type):
        fields = {f.name: getattr(feature, f.name) for f in dataclasses.fields(feature)}
    else:
        fields = dict(feature) if isinstance(feature, dict) else {}
    texts = [f"{name}: {value}" for name, value in fields.items() if isinstance(value, str)]
    if texts:
        return "\n".join(texts)
    for name in ("prompt_ids", "input_ids"):
        if fields.get(name) is not None:
            return tokenizer.decode(list(fields[name]), skip_special_tokens=False)
    return repr(feature)[:500]


@dataclass
class Preview:
    """A recipe's data as training reads it: the task, its tokenizer, the split's data set and its spec."""

    task: Any
    tokenizer: Any
    dataset: Any
    spec: Any

    def collated(self, index: int) -> dict[str, Any]:
        return self.task.collate([self.dataset[index]])


def load_preview(recipe: Any, *, split: str = "train") -> Preview:
    """Build ``recipe``'s task and tokenizer and load its ``data.<split>`` as ``twinkle train`` does (the model is
    not built, nothing is cached or written)."""
    from twinkle_core.plugins import get_plugins
    from twinkle_core.sources.resolve import trust_remote_code
    from twinkle_core.train.build import load_tokenizer
    from twinkle_core.train.data_options import data_options
    from twinkle_core.train.recipe import validate_plugin_names

    if split not in SPLITS:
        raise ConfigError(f"--split {split!r}: choose one of {', '.join(SPLITS)}")
    spec = recipe.data.train if split == "train" else recipe.data.eval
    if spec is None:
        raise ConfigError(f"the recipe has no data.{split}: preview --split train, or set data.{split}")
    plugins = get_plugins()
    validate_plugin_names(recipe, plugins)
    task = plugins.load("task", recipe.task)(**recipe.task_options)
    try:
        model_cls = plugins.load("model", recipe.model.class_name)
        _, tokenizer = load_tokenizer(recipe, model_cls, trust_remote_code(recipe.model.trust_remote_code))
        options = data_options(recipe, task, Path(recipe.train.output_dir))
        options.pop("cache_dir", None)  # a preview writes nothing into the run's directory
        dataset = task.load_dataset(spec, tokenizer, **options)
    except BaseException:
        task.close()
        raise
    return Preview(task, tokenizer, dataset, spec)


def preview_lines(preview: Preview, *, samples: int, color: bool) -> Iterator[str]:
    """The lines ``twinkle data preview`` prints for the first ``samples`` rows of ``preview``."""
    from twinkle_core.data.mixing import count_mixture

    spec, dataset, tokenizer = preview.spec, preview.dataset, preview.tokenizer
    if isinstance(spec, (list, tuple)) and len(spec) > 1:
        yield f"data: {count_mixture(spec).describe()}"
    size = len(dataset) if hasattr(dataset, "__len__") else None
    shown = min(samples, size) if size is not None else samples
    count = "a stream of samples" if size is None else f"{size} sample" + ("" if size == 1 else "s")
    yield f"{count}; showing {shown}"
    legend = f"{GREEN}green{RESET}" if color else f"{OPEN}between double brackets{CLOSE}"
    labelled = None
    for index in range(shown):
        batch = preview.collated(index)
        views = sequences(batch)
        if labelled is None:
            labelled = bool(views)
            yield (f"legend: trained tokens (labels != {IGNORE_INDEX}) are {legend}; the rest is context" if labelled
                   else "the task's batches carry no labels, so no token is marked (an online RL task samples "
                        "the completions it trains on, an embedding task trains on whole texts): showing the rows "
                        "as the data loader yields them")
        if not views:
            yield f"--- sample {index + 1}"
            yield unlabelled_text(dataset[index], tokenizer)
            continue
        for number, view in enumerate(views, 1):
            what = f" {view.role}" if view.role else (f" sequence {number}/{len(views)}" if len(views) > 1 else "")
            yield (f"--- sample {index + 1}{what}: {len(view.input_ids)} tokens, {view.trained_tokens} trained")
            yield render(view, tokenizer, color=color)
