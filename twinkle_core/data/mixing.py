"""Data specifications: one or several sources, column mapping, and mixing by weight.

A *data spec* (the recipe's ``data.train`` / ``data.eval``) is either one source or a list of
sources. A source is a path or id string (a file, a data set directory, ``hf://org/name``,
``ms://org/name``) or a mapping::

    {path: a.jsonl, weight: 0.7, columns: {question: instruction, answer: output}, split: train}

**Column mapping** (``columns``, per source, or ``data.columns`` for every source that has none):
``{source column: target}`` renames a row's columns before the row is read. A target is a row key
Twinkle reads (:data:`ROW_TARGETS`: ``instruction``, ``input``, ``output``, ``system``, ``history``,
``messages``, ``conversations``, ``text``, ``tools``) or a message role: ``user`` / ``assistant``
build a one-turn conversation ``[user, assistant]`` (after ``system`` if mapped). A mapped column
missing from a row is an error naming the file, the row and the column.

**Mixing** (:func:`mix`): without any ``weight``, the sources are concatenated (every row once).
With weights (every source must then have one, > 0), the mixture has ``N = n_1 + ... + n_k`` rows
(the sources' row counts together); source ``i`` contributes ``k_i = N * w_i / sum(w)`` rows,
rounded by largest remainder so the ``k_i`` add up to ``N``. A source gives ``k_i // n_i`` copies of
all its rows plus ``k_i % n_i`` rows drawn without replacement by a NumPy generator seeded with
``(seed, i)`` (kept in file order); so a small source is repeated and a large one subsampled.
The mixture is materialised once, before training, in source order (the data loader shuffles it
per epoch): it depends only on the files, the weights and the seed, so it is the same on every
rank and after a resume (the loader's saved position then points into the same list).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from twinkle_core.data.formats import RowError
from twinkle_core.errors import ConfigError, DataFormatError

#: row keys a column can be mapped to
ROW_TARGETS = ("instruction", "input", "output", "system", "history", "messages", "conversations", "text",
               "tools")
#: message roles a column can be mapped to (a one-turn conversation)
ROLE_TARGETS = ("user", "assistant")
SOURCE_KEYS = ("path", "weight", "columns", "split")


@dataclass
class DataSource:
    path: str
    weight: float | None = None
    columns: dict[str, str] | None = None
    split: str | None = None

    @property
    def name(self) -> str:
        return self.path if self.split is None else f"{self.path}[{self.split}]"


@dataclass
class Record:
    """A row and where it came from (for error messages)."""

    source: str
    line: int | None
    row: Any
    #: index of the source in the spec (mixing); -1 for rows given directly
    index: int = -1
    extra: dict[str, Any] = field(default_factory=dict)


def is_source_item(item: Any) -> bool:
    return isinstance(item, (str, os.PathLike, DataSource)) or (
        isinstance(item, Mapping) and "path" in item and set(item) <= set(SOURCE_KEYS))


def is_data_spec(value: Any) -> bool:
    """A path / id, a :class:`DataSource`, or a non-empty list of them (mappings with ``path``)."""
    if is_source_item(value):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and all(is_source_item(v) for v in value)


def check_columns(columns: Any, where: str = "columns") -> dict[str, str]:
    if columns is None:
        return {}
    if not isinstance(columns, Mapping):
        raise ConfigError(f"{where}: expected a mapping {{source column: target}}, got {type(columns).__name__}")
    targets = (*ROW_TARGETS, *ROLE_TARGETS)
    seen: dict[str, str] = {}
    for src, dst in columns.items():
        if not isinstance(src, str) or not isinstance(dst, str):
            raise ConfigError(f"{where}: column names must be strings, got {src!r}: {dst!r}")
        if dst not in targets:
            raise ConfigError(f"{where}.{src}: unknown target {dst!r}; map a column to one of {', '.join(targets)}")
        if dst in seen:
            raise ConfigError(f"{where}: both {seen[dst]!r} and {src!r} are mapped to {dst!r}")
        seen[dst] = src
    if ("user" in seen) != ("assistant" in seen):
        raise ConfigError(f"{where}: mapping a column to 'user' needs one mapped to 'assistant' too (and back)")
    return dict(columns)


def parse_source(item: Any, at: str) -> DataSource:
    """One source of a data spec: a :class:`DataSource`, a path, or a mapping of :data:`SOURCE_KEYS`."""
    if isinstance(item, DataSource):
        return item
    if isinstance(item, (str, os.PathLike)):
        return DataSource(path=os.fspath(item))
    if not isinstance(item, Mapping):
        raise ConfigError(f"{at}: expected a path or a mapping with 'path', got {type(item).__name__}")
    unknown = sorted(set(item) - set(SOURCE_KEYS))
    if unknown:
        raise ConfigError(f"{at}: unknown key(s) {', '.join(unknown)}; a source takes {', '.join(SOURCE_KEYS)}")
    if not isinstance(item.get("path"), (str, os.PathLike)) or not os.fspath(item["path"]):
        raise ConfigError(f"{at}.path: a source needs a path (a file, a directory, hf://org/name)")
    weight = item.get("weight")
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                               or not weight > 0 or weight == float("inf")):
        raise ConfigError(f"{at}.weight: must be a number > 0, got {weight!r}")
    split = item.get("split")
    if split is not None and not isinstance(split, str):
        raise ConfigError(f"{at}.split: must be a string, got {split!r}")
    return DataSource(path=os.fspath(item["path"]), weight=None if weight is None else float(weight),
                      columns=check_columns(item.get("columns"), f"{at}.columns") or None, split=split)


def parse_sources(spec: Any, *, columns: Mapping[str, str] | None = None, where: str = "data.train") -> list[DataSource]:
    """The sources of a data spec; ``columns`` applies to sources without their own."""
    several = isinstance(spec, (list, tuple))
    items = list(spec) if several else [spec]
    if not items:
        raise ConfigError(f"{where}: the list of data sources is empty")
    default_columns = check_columns(columns, "data.columns")
    sources = []
    for i, item in enumerate(items):
        source = parse_source(item, f"{where}[{i}]" if several else where)
        if source.columns is None and default_columns:
            source.columns = dict(default_columns)
        sources.append(source)
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        missing = [f"{where}[{i}]" for i, w in enumerate(weighted) if not w]
        raise ConfigError(f"{', '.join(missing)}: has no weight; give every source a weight, or none (concatenate)")
    return sources


def map_columns(row: Any, columns: Mapping[str, str] | None) -> Any:
    """``row`` with its columns renamed by ``columns`` (see the module doc); raises :class:`RowError`."""
    if not columns:
        return row
    if not isinstance(row, dict):
        raise RowError(f"a row must be an object, got {type(row).__name__}")
    missing = [src for src in columns if src not in row]
    if missing:
        have = ", ".join(map(repr, list(row)[:20])) or "none"
        raise RowError(f"column {missing[0]!r} (mapped by columns: {missing[0]} -> {columns[missing[0]]}) is missing; "
                       f"the row has the columns {have}")
    out = {k: v for k, v in row.items() if k not in columns}
    roles = {}
    for src, dst in columns.items():
        if dst in ROLE_TARGETS:
            roles[dst] = row[src]
        else:
            out[dst] = row[src]
    if roles:
        if out.get("messages") is not None or out.get("conversations") is not None:
            raise RowError("columns map to 'user'/'assistant' but the row also has 'messages'/'conversations'")
        out["messages"] = [{"role": "user", "content": roles["user"]},
                           {"role": "assistant", "content": roles["assistant"]}]
    return out


def _largest_remainder(total: int, weights: Sequence[float]) -> list[int]:
    norm = sum(weights)
    exact = [total * w / norm for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def mixed_rows(sizes: Sequence[int], weights: Sequence[float] | None) -> list[int]:
    """How many rows the mixture takes from each source of ``sizes`` rows (see the module doc): every row once
    without ``weights``, else the largest-remainder shares of their total. :func:`mix` draws exactly these."""
    if weights is None:
        return list(sizes)
    return _largest_remainder(sum(sizes), weights)


def mix(groups: Sequence[Sequence[Any]], weights: Sequence[float] | None, seed: int) -> list[Any]:
    """Concatenate ``groups`` (``weights`` None) or mix them by ``weights`` (see the module doc)."""
    if weights is None:
        return [item for group in groups for item in group]
    import numpy as np

    out: list[Any] = []
    for i, (group, k) in enumerate(zip(groups, mixed_rows([len(g) for g in groups], weights), strict=True)):
        n = len(group)
        copies, rest = divmod(k, n)
        out.extend(list(group) * copies)
        if rest:
            picked = np.sort(np.random.default_rng([int(seed), i]).choice(n, size=rest, replace=False))
            out.extend(group[j] for j in picked.tolist())
    return out


def load_spec(spec: Any, *, columns: Mapping[str, str] | None = None, seed: int = 0,
              validate: Callable[[Any], None] | None = None, where: str = "data.train") -> list[Record]:
    """Read every source of ``spec``, map its columns, validate each row, and mix (see the module doc).

    A bad row raises :class:`DataFormatError` naming its file and line."""
    from twinkle_core.data.loading import load_records

    sources = parse_sources(spec, columns=columns, where=where)
    groups = []
    for index, source in enumerate(sources):
        records = []
        for line, row in load_records(source.path, validate=None, split=source.split):
            try:
                row = map_columns(row, source.columns)
                if validate is not None:
                    validate(row)
            except RowError as exc:
                raise DataFormatError(source.name, line, str(exc)) from None
            records.append(Record(source.name, line, row, index))
        groups.append(records)
    weights = [s.weight for s in sources] if sources[0].weight is not None else None
    return mix(groups, weights, seed)


@dataclass(frozen=True)
class SourceCount:
    """One source of a mixture: its name (as the spec gives it), the rows it holds, the rows the mixture takes
    from it (repeated or subsampled by weight) and its weight (None: concatenated)."""

    name: str
    file_rows: int
    rows: int
    weight: float | None


@dataclass(frozen=True)
class MixtureCounts:
    """The per-source row counts of a data spec's mixture (:func:`count_mixture`)."""

    sources: tuple[SourceCount, ...]

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.sources)

    def describe(self) -> str:
        """One line: ``3 sources, 1,200 rows: a.jsonl 800 (weight 2), b.jsonl 400 (weight 1)``."""
        labels = short_names([s.name for s in self.sources])
        parts = [f"{label} {s.rows:,}" + (f" (weight {s.weight:g})" if s.weight is not None else "")
                 for label, s in zip(labels, self.sources, strict=True)]
        return f"{len(self.sources)} sources, {self.rows:,} rows: {', '.join(parts)}"

    def as_dict(self) -> dict[str, Any]:
        """For a run's summary and log: ``{"rows": N, "sources": [{name, file_rows, rows, weight}, ...]}``."""
        return {"rows": self.rows, "sources": [{"name": s.name, "file_rows": s.file_rows, "rows": s.rows,
                                                "weight": s.weight} for s in self.sources]}


def short_names(names: Sequence[str]) -> list[str]:
    """The file names of ``names`` where they tell the sources apart, else the names as given."""
    short = [os.path.basename(n.rstrip("/")) or n if "://" not in n else n for n in names]
    return short if len(set(short)) == len(short) else list(names)


def count_mixture(spec: Any, *, where: str = "data.train") -> MixtureCounts:
    """The per-source counts of the mixture ``load_spec(spec)`` makes, from the sources' row counts alone (the
    counts do not depend on the seed, only which rows are drawn). Reads every source once more: call it where
    that costs little next to tokenising them (before training, once)."""
    from twinkle_core.data.loading import load_records

    sources = parse_sources(spec, where=where)
    sizes = [len(load_records(s.path, validate=None, split=s.split)) for s in sources]
    weights = [s.weight for s in sources] if sources[0].weight is not None else None
    taken = mixed_rows(sizes, weights)
    return MixtureCounts(tuple(SourceCount(s.name, n, k, s.weight)
                               for s, n, k in zip(sources, sizes, taken, strict=True)))


__all__ = ["ROLE_TARGETS", "ROW_TARGETS", "DataSource", "MixtureCounts", "Record", "SourceCount", "check_columns",
           "count_mixture", "is_data_spec", "load_spec", "map_columns", "mix", "mixed_rows", "parse_sources"]
