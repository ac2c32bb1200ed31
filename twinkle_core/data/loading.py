"""Read dataset files into rows (dicts).

* ``.jsonl`` is parsed line by line here, so a malformed line raises
  ``DataFormatError(path, line_number, reason)`` (so do bytes that are not UTF-8); blank lines are
  skipped.
* ``.json`` (a list of rows, or JSON lines), ``.parquet``, ``.arrow`` and ``.csv`` go through
  ``datasets.load_dataset``, and a directory written by ``datasets.save_to_disk`` through
  ``datasets.load_from_disk`` (a ``DatasetDict`` takes its ``split``, default ``train``); any other
  directory is read as a data set folder by ``datasets.load_dataset(directory, split=split)``.
  ``datasets`` is imported lazily, only for these; without it the error says ``pip install datasets``.
  Their "line" is the row index + 1 (for CSV, the data row number, not counting the header).
* ``hf://org/name[@revision]`` and ``ms://org/name[@revision]`` are data set repositories, fetched
  through :mod:`twinkle_core.data.hub` (offline: only the local cache, else a clear error).

A file without any row is a :class:`DataFormatError` too. Rows are validated as they are read
(:func:`validate_row`): a row must be an object, and a conversation row (``messages`` /
``conversations``) must have well-formed messages. Mode-specific checks (e.g. "the last message
is from the assistant") happen when the row is encoded; use :func:`load_records` to keep each
row's line number for those errors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from twinkle_core.data.formats import RowError, Trajectory, is_conversation_row
from twinkle_core.errors import DataFormatError

SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv")


def validate_row(row: Any) -> None:
    """Structural checks shared by every mode; raises :class:`RowError`."""
    if not isinstance(row, dict):
        raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
    if is_conversation_row(row):
        Trajectory.from_dict(row, require_assistant_last=False)
    elif "text" in row and row["text"] is not None and not isinstance(row["text"], str):
        raise RowError(f"'text' must be a string, got {type(row['text']).__name__}")


def _format_of(path: str) -> str:
    lower = path.lower()
    for suffix in SUFFIXES:
        if lower.endswith(suffix):
            return suffix[1:]
    if lower.endswith(".ndjson"):
        return "jsonl"
    raise DataFormatError(path, None, f"unsupported file type; expected one of {', '.join(SUFFIXES)}")


def _decode(path: str, number: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        raise DataFormatError(path, number, f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} "
                              "of the line); save the file as UTF-8") from None


def _read_jsonl(path: str) -> list[tuple[int, Any]]:
    records = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            line = _decode(path, number, raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFormatError(path, number, f"invalid JSON ({exc.msg} at column {exc.colno})") from None
            records.append((number, row))
    return records


def import_datasets(path: str, what: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataFormatError(path, None, f"reading {what} needs the 'datasets' library: "
                              "pip install datasets  (or pip install 'twinkle-core[data]')") from None
    return datasets


def _read_with_datasets(path: str, kind: str) -> list[tuple[int, Any]]:
    datasets = import_datasets(path, f".{kind} files")
    try:
        table = datasets.load_dataset(kind, data_files=os.path.abspath(path), split="train")
    except Exception as exc:  # datasets/pyarrow raise many types for a bad file
        raise DataFormatError(path, None, f"could not read the file as {kind}: {type(exc).__name__}: {exc}") from exc
    return [(index + 1, row) for index, row in enumerate(table)]


def _is_saved_dataset(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, name)) for name in ("state.json", "dataset_dict.json"))


def _read_directory(path: str, split: str | None) -> list[tuple[int, Any]]:
    datasets = import_datasets(path, "a data set directory")
    try:
        if _is_saved_dataset(path):
            table = datasets.load_from_disk(path)
        else:
            table = datasets.load_dataset(os.path.abspath(path))
    except Exception as exc:
        raise DataFormatError(path, None, f"could not read the directory as a data set "
                              f"({type(exc).__name__}: {exc})") from exc
    if isinstance(table, dict):  # a DatasetDict
        names = list(table)
        wanted = split or "train"
        if wanted not in table:
            if split is None and len(names) == 1:
                wanted = names[0]
            else:
                raise DataFormatError(path, None, f"the data set has no split {wanted!r}; it has "
                                      f"{', '.join(map(repr, names))}: choose one with 'split' "
                                      "(data.train: [{path: ..., split: NAME}])")
        table = table[wanted]
    return [(index + 1, row) for index, row in enumerate(table)]


def load_records(path: str | os.PathLike[str], validate: Callable[[Any], None] | None = validate_row, *,
                 split: str | None = None) -> list[tuple[int, dict[str, Any]]]:
    """``[(line, row), ...]``; ``line`` is the 1-based line (jsonl) or row number (other formats).

    ``path``: a file, a data set directory, or an ``hf://`` / ``ms://`` data set id; ``split`` picks
    the split of a data set with several (default ``train``)."""
    path = os.fspath(path)
    if "://" in path:
        from twinkle_core.data.hub import resolve_dataset

        local = resolve_dataset(path)
        records = _read_directory(local, split) if os.path.isdir(local) else load_records(local, None)
    elif os.path.isdir(path):
        records = _read_directory(path, split)
    else:
        kind = _format_of(path)
        if not os.path.isfile(path):
            raise DataFormatError(path, None, "no such file")
        records = _read_jsonl(path) if kind == "jsonl" else _read_with_datasets(path, kind)
    if not records:
        raise DataFormatError(path, None, "the file is empty (it holds no rows)")
    if validate is not None:
        for line, row in records:
            try:
                validate(row)
            except RowError as exc:
                raise DataFormatError(path, line, str(exc)) from None
    return records


def load_rows(path: str | os.PathLike[str], validate: Callable[[Any], None] | None = validate_row) -> list[dict[str, Any]]:
    """Read ``path`` (.jsonl / .json / .parquet / .arrow / .csv, a data set directory) into validated rows."""
    return [row for _, row in load_records(path, validate)]


__all__ = ["SUFFIXES", "load_records", "load_rows", "validate_row"]
