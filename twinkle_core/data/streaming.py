"""Streaming pre-training data: text read lazily and packed into fixed-length rows.

``data.streaming: true`` with ``data.mode: pretrain`` (and ``data.max_length``): the ``text`` of each
row is tokenised when it is reached (with the tokenizer's own special tokens, then EOS), appended to a
token buffer, and the buffer is cut into rows of exactly ``max_length`` tokens (the standard
pre-training packing: documents are concatenated, a row may hold the end of one and the start of the
next; every token is trained but the first of a row). Nothing but the buffer is held in memory.

Files are read in the order given (a directory: its ``.jsonl`` / ``.parquet`` files in name order):
JSONL line by line, Parquet in record batches (``pyarrow``). The order is not shuffled. The tokens
left over at the end of the data (less than one row) are dropped.

:class:`StreamingDataLoader` deals the packed rows to data-parallel ranks: every group of
``dp_size * batch_size`` consecutive rows is one step, rank ``r`` taking rows ``r, r + dp_size, ...``
of it, so ranks get disjoint rows and every row is used once per epoch (an incomplete last group is
dropped, equally on all ranks). Every rank reads and tokenises the whole stream (so that all agree on
where rows begin without communicating). Its ``state_dict`` records the position in the data (file,
byte offset or row index) and the leftover token buffer, so a resumed run continues with exactly the
rows an uninterrupted run would have seen. The number of rows is unknown in advance, so a run needs
``train.max_steps``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from twinkle_core.data.formats import IGNORE_INDEX, InputFeature, RowError
from twinkle_core.errors import ConfigError, DataFormatError

STREAM_SUFFIXES = (".jsonl", ".ndjson", ".parquet")


def _kind(path: str) -> str:
    lower = path.lower()
    if lower.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if lower.endswith(".parquet"):
        return "parquet"
    raise DataFormatError(path, None, "streaming reads .jsonl and .parquet files only (or a directory of them); "
                          "convert the file or set data.streaming: false")


def resolve_stream_files(spec: Any, columns: dict[str, str] | None = None) -> list[tuple[str, dict[str, str] | None]]:
    """``[(file, columns), ...]`` in reading order for a data spec (a path, a directory, a list of them,
    or ``{path, columns}`` sources; weights are not supported while streaming)."""
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        if "://" in path:
            from twinkle_core.data.hub import resolve_dataset

            path = resolve_dataset(path)
        if os.path.isdir(path):
            found = []
            for root, dirs, files in os.walk(path):
                dirs.sort()
                found += [os.path.join(root, f) for f in sorted(files) if f.lower().endswith(STREAM_SUFFIXES)]
            if not found:
                raise DataFormatError(path, None, "the directory holds no .jsonl or .parquet file to stream")
            return [(f, columns) for f in found]
        if not os.path.isfile(path):
            raise DataFormatError(path, None, "no such file")
        _kind(path)
        return [(path, columns)]
    if isinstance(spec, dict):
        unknown = set(spec) - {"path", "columns", "split"}
        if "path" not in spec or unknown:
            raise ConfigError("a streamed data source is a path or {path, columns}; weights are not supported "
                              f"with data.streaming (got {', '.join(map(repr, spec))})")
        return resolve_stream_files(spec["path"], spec.get("columns") or columns)
    if isinstance(spec, (list, tuple)) and spec:
        files: list[tuple[str, dict[str, str] | None]] = []
        for item in spec:
            files += resolve_stream_files(item, columns)
        return files
    raise ConfigError("data.streaming needs data files (a path, a directory or a list of them), not rows")


class StreamingPretrainDataset:
    """A lazily read, packed pre-training stream (see the module documentation)."""

    is_streaming = True

    def __init__(self, spec: Any, template: Any, *, columns: dict[str, str] | None = None,
                 max_length: int | None = None) -> None:
        self.files = resolve_stream_files(spec, columns)
        self.template = template
        self.tokenizer = template.tokenizer
        self.max_length = int(max_length if max_length is not None else template.max_length)
        if self.max_length < 2:
            raise ConfigError(f"data.max_length must be at least 2 for streaming, got {self.max_length}")
        self.pad_token_id = template.pad_token_id
        self.eos_token_id = getattr(self.tokenizer, "eos_token_id", None)

    @property
    def identity(self) -> str:
        """Which files are read, in which order, at which row length (checked when resuming)."""
        names = json.dumps([[os.path.abspath(f), c] for f, c in self.files] + [self.max_length], sort_keys=True)
        return hashlib.sha256(names.encode("utf-8")).hexdigest()[:16]

    def __len__(self) -> int:
        raise TypeError("a streamed data set has no known length")

    # ------------------------------------------------------------------ rows
    def _jsonl_rows(self, path: str, offset: int) -> Iterator[tuple[int, Any]]:
        with open(path, "rb") as handle:
            handle.seek(offset)
            while True:
                start = handle.tell()
                raw = handle.readline()
                if not raw:
                    return
                end = handle.tell()
                try:
                    line = raw.decode("utf-8-sig" if start == 0 else "utf-8")
                except UnicodeDecodeError:
                    raise DataFormatError(path, None, f"the line at byte {start} is not valid UTF-8") from None
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DataFormatError(path, None, f"the line at byte {start}: invalid JSON ({exc.msg})") from None
                    yield end, row

    def _parquet_rows(self, path: str, offset: int) -> Iterator[tuple[int, Any]]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataFormatError(path, None, "streaming .parquet needs pyarrow: pip install pyarrow") from None
        parquet = pq.ParquetFile(path)
        index = 0
        for batch in parquet.iter_batches(batch_size=1024):
            if index + batch.num_rows <= offset:
                index += batch.num_rows
                continue
            for row in batch.to_pylist():
                if index >= offset:
                    yield index + 1, row
                index += 1

    def rows(self, file_index: int, offset: int) -> Iterator[tuple[int, int, str, Any]]:
        """``(file_index, next_offset, path, row)`` from the position ``(file_index, offset)`` on."""
        from twinkle_core.data.mixing import map_columns

        while file_index < len(self.files):
            path, columns = self.files[file_index]
            reader = self._jsonl_rows if _kind(path) == "jsonl" else self._parquet_rows
            for next_offset, row in reader(path, offset):
                if columns:
                    try:
                        row = map_columns(row, columns)
                    except RowError as exc:
                        raise DataFormatError(path, None, str(exc)) from None
                yield file_index, next_offset, path, row
            file_index, offset = file_index + 1, 0

    def tokenize(self, path: str, row: Any) -> list[int]:
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise DataFormatError(path, None, "streaming pre-training expects {'text': ...} rows with string text")
        if not row["text"]:
            return []
        ids = list(self.tokenizer(row["text"], add_special_tokens=True)["input_ids"])
        if self.eos_token_id is not None and (not ids or ids[-1] != self.eos_token_id):
            ids.append(int(self.eos_token_id))
        return ids

    def packed_rows(self, file_index: int = 0, offset: int = 0,
                    buffer: list[int] | None = None) -> Iterator[tuple[list[int], tuple[int, int, list[int], int]]]:
        """Packed rows of ``max_length`` tokens from a position; each with the position after it
        ``(file_index, offset, buffer, start)``: the leftover tokens are ``buffer[start:]``, valid only
        until the generator is advanced."""
        length = self.max_length
        buffer = list(buffer or [])
        for fi, next_offset, path, row in self.rows(file_index, offset):
            buffer += self.tokenize(path, row)
            file_index, offset = fi, next_offset
            start = 0
            while len(buffer) - start >= length:
                out = buffer[start:start + length]
                start += length
                yield out, (file_index, offset, buffer, start)  # leftover: buffer[start:] (read it at once)
            if start:
                buffer = buffer[start:]

    def feature(self, ids: list[int]) -> InputFeature:
        labels = list(ids)
        labels[0] = IGNORE_INDEX
        return InputFeature(input_ids=list(ids), labels=labels)


class StreamingDataLoader:
    """Batches of packed rows from a :class:`StreamingPretrainDataset`, sharded over data-parallel ranks,
    with an exactly resumable position (see the module documentation)."""

    is_streaming = True

    def __init__(self, dataset: StreamingPretrainDataset, batch_size: int,
                 collate_fn: Callable[[list[Any]], Any] | None = None, *, dp_rank: int | None = None,
                 dp_size: int | None = None, **_ignored: Any) -> None:
        from twinkle_core.data.loader import data_parallel_layout

        self.dp_rank, self.dp_size = data_parallel_layout(batch_size, dp_rank, dp_size)
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.collate_fn = collate_fn if collate_fn is not None else (lambda items: items)
        self.epoch = 0
        self.position = 0  # steps (groups of dp_size * batch_size rows) of this epoch already yielded
        self._cursor: tuple[int, int, list[int]] = (0, 0, [])

    def __len__(self) -> int:
        raise TypeError("a streaming data loader has no known length (set train.max_steps)")

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position, self._cursor = int(epoch), 0, (0, 0, [])

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        group_size = self.dp_size * self.batch_size
        rows = self.dataset.packed_rows(*self._cursor)
        while self.epoch == epoch:
            group: list[list[int]] = []
            state = None
            for ids, row_state in rows:
                group.append(ids)
                state = row_state
                if len(group) == group_size:
                    break
            if len(group) < group_size:  # the end of the data: the next epoch starts over
                self.epoch, self.position, self._cursor = epoch + 1, 0, (0, 0, [])
                return
            file_index, offset, buffer, start = state
            self._cursor = (file_index, offset, buffer[start:])
            self.position += 1
            yield self.collate_fn([self.dataset.feature(ids) for ids in group[self.dp_rank::self.dp_size]])

    def state_dict(self) -> dict[str, Any]:
        file_index, offset, buffer = self._cursor
        return {"streaming": True, "epoch": self.epoch, "position": self.position, "file_index": file_index,
                "offset": offset, "buffer": list(buffer), "batch_size": self.batch_size, "dp_size": self.dp_size,
                "data": self.dataset.identity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state.get("streaming"):
            raise ValueError("cannot resume the streaming data loader from a checkpoint of a non-streaming run")
        for key, mine in (("batch_size", self.batch_size), ("dp_size", self.dp_size),
                          ("data", self.dataset.identity)):
            if key in state and state[key] != mine:
                raise ValueError(f"cannot resume the streaming data loader: the checkpoint has {key}={state[key]!r} "
                                 f"but this run has {mine!r}; the rows would differ")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._cursor = (int(state["file_index"]), int(state["offset"]), [int(t) for t in state["buffer"]])


__all__ = ["StreamingDataLoader", "StreamingPretrainDataset", "resolve_stream_files"]
