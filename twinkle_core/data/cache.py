"""An on-disk cache of tokenised features, so a restart (or another rank) does not tokenise again.

A cache entry is a directory ``<cache_dir>/<fingerprint>/`` holding

* ``input_ids.bin``: every feature's token ids, concatenated (``uint32``)
* ``labels.bin``: the labels, concatenated (``int32``; -100 = no loss)
* ``position_ids.bin``: only when the features are packed (``int32``)
* ``offsets.bin``: ``int64``, ``len(features) + 1`` boundaries into the arrays above
* ``meta.json``: the format version, the count, the fingerprint's inputs and each feature's ``extra``
  (only when one is not empty)

The fingerprint covers the data files (path, size, modification time), the tokenizer (a hash of its
serialisation / vocabulary, special tokens and chat template), every encoding option (mode,
max_length, truncation, template, columns, packing, mixing seed) and :data:`FORMAT_VERSION`, so a
changed input or option makes a new entry. An entry is written into a temporary directory that is
renamed into place, so a reader never sees half of one. :class:`CachedFeatures` reads an entry
through ``numpy.memmap``: the tokens stay on disk and a feature is built when it is indexed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from twinkle_core.data.formats import InputFeature

logger = logging.getLogger(__name__)

#: bump when the encoding of rows into features changes (old entries are then not reused)
FORMAT_VERSION = 1

_UINT32_MAX = 2**32 - 1


def _hash_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what decides how the tokenizer encodes text (its serialisation or vocabulary,
    special tokens, chat template, class)."""
    parts: dict[str, Any] = {"class": type(tokenizer).__name__}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    serialised = None
    if backend is not None and hasattr(backend, "to_str"):
        try:
            serialised = backend.to_str()
        except Exception:  # pragma: no cover - a backend that cannot serialise
            serialised = None
    if serialised is not None:
        parts["backend"] = _hash_bytes(serialised.encode("utf-8"))
    else:
        try:
            vocab = tokenizer.get_vocab()
            parts["vocab"] = _hash_bytes(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode("utf-8"))
        except Exception:
            parts["repr"] = repr(tokenizer)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "chat_template", "add_bos_token",
                 "add_eos_token", "padding_side"):
        value = getattr(tokenizer, attr, None)
        if value is None or isinstance(value, (str, int, float, bool)):
            parts[attr] = value
    parts["special"] = json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str)
    return _hash_bytes(json.dumps(parts, sort_keys=True, default=str).encode("utf-8"))


def _file_entries(path: str) -> list[list[Any]]:
    if os.path.isdir(path):
        entries = []
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(root, name)
                st = os.stat(full)
                entries.append([os.path.relpath(full, path), st.st_size, st.st_mtime_ns])
        return [[os.path.abspath(path), entries]]
    st = os.stat(path)
    return [[os.path.abspath(path), st.st_size, st.st_mtime_ns]]


def source_fingerprint(spec: Any) -> Any | None:
    """What identifies the data of ``spec`` (a data spec: a path, an ``hf://`` id, a list of sources);
    ``None`` when it is not cacheable (a list of in-memory rows)."""
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        if "://" in path:
            try:
                from twinkle_core.data.hub import resolve_dataset

                local = resolve_dataset(path)
            except Exception:
                return None
            return [path, _file_entries(local)]
        if not os.path.exists(path):
            return None
        return _file_entries(path)
    if isinstance(spec, dict) and "path" in spec:
        inner = source_fingerprint(spec["path"])
        if inner is None:
            return None
        return [inner, {k: v for k, v in sorted(spec.items()) if k != "path"}]
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(s, (str, os.PathLike, dict)) for s in spec):
        parts = [source_fingerprint(s) for s in spec]
        return None if any(p is None for p in parts) else parts
    return None


def fingerprint(source: Any, tokenizer: Any, options: dict[str, Any]) -> str:
    payload = {"version": FORMAT_VERSION, "source": source, "tokenizer": tokenizer_fingerprint(tokenizer),
               "options": options}
    return _hash_bytes(json.dumps(payload, sort_keys=True, default=str).encode("utf-8"))[:32]


class CachedFeatures(Sequence[InputFeature]):
    """The features of a cache entry, read lazily from memory-mapped files."""

    def __init__(self, directory: str) -> None:
        import numpy as np

        self.directory = directory
        with open(os.path.join(directory, "meta.json"), encoding="utf-8") as handle:
            self.meta = json.load(handle)
        if self.meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"{directory}: cache format {self.meta.get('version')} is not {FORMAT_VERSION}")
        self._offsets = np.fromfile(os.path.join(directory, "offsets.bin"), dtype=np.int64)
        total = int(self._offsets[-1]) if len(self._offsets) else 0

        def _map(name: str, dtype: Any) -> Any:
            path = os.path.join(directory, name)
            if total == 0:
                return np.zeros(0, dtype=dtype)
            return np.memmap(path, dtype=dtype, mode="r", shape=(total,))

        self._input_ids = _map("input_ids.bin", np.uint32)
        self._labels = _map("labels.bin", np.int32)
        self._position_ids = _map("position_ids.bin", np.int32) if self.meta.get("packed") else None
        self._extras = {int(k): v for k, v in self.meta.get("extras", {}).items()}

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def length(self, index: int) -> int:
        return int(self._offsets[index + 1] - self._offsets[index])

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(index)
        start, end = int(self._offsets[index]), int(self._offsets[index + 1])
        position_ids = self._position_ids[start:end].tolist() if self._position_ids is not None else None
        return InputFeature(input_ids=self._input_ids[start:end].tolist(), labels=self._labels[start:end].tolist(),
                            position_ids=position_ids, extra=dict(self._extras.get(index, {})))

    def __iter__(self) -> Iterator[InputFeature]:
        for i in range(len(self)):
            yield self[i]


def write_features(directory: str, features: Sequence[InputFeature], info: dict[str, Any] | None = None) -> None:
    """Write ``features`` as a cache entry at ``directory`` (atomically: a temporary directory renamed)."""
    import numpy as np

    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        packed = any(f.position_ids is not None for f in features)
        offsets = np.zeros(len(features) + 1, dtype=np.int64)
        extras: dict[str, Any] = {}
        files = {"input_ids.bin": open(os.path.join(staging, "input_ids.bin"), "wb"),
                 "labels.bin": open(os.path.join(staging, "labels.bin"), "wb")}
        if packed:
            files["position_ids.bin"] = open(os.path.join(staging, "position_ids.bin"), "wb")
        try:
            total = 0
            for i, feature in enumerate(features):
                ids = np.asarray(feature.input_ids, dtype=np.int64)
                if ids.size and (ids.min() < 0 or ids.max() > _UINT32_MAX):
                    raise ValueError(f"feature {i} has a token id outside 0..2**32-1")
                files["input_ids.bin"].write(ids.astype(np.uint32).tobytes())
                files["labels.bin"].write(np.asarray(feature.labels, dtype=np.int32).tobytes())
                if packed:
                    positions = feature.position_ids if feature.position_ids is not None else range(len(ids))
                    files["position_ids.bin"].write(np.asarray(list(positions), dtype=np.int32).tobytes())
                total += len(ids)
                offsets[i + 1] = total
                if feature.extra:
                    extras[str(i)] = feature.extra
        finally:
            for handle in files.values():
                handle.close()
        offsets.tofile(os.path.join(staging, "offsets.bin"))
        meta = {"version": FORMAT_VERSION, "count": len(features), "tokens": int(offsets[-1]), "packed": packed,
                "extras": extras, "info": info or {}}
        with open(os.path.join(staging, "meta.json"), "w", encoding="utf-8") as handle:
            json.dump(meta, handle, default=str)
        try:
            os.rename(staging, directory)
        except OSError:  # another process wrote the same entry first: keep theirs
            if not os.path.isfile(os.path.join(directory, "meta.json")):
                raise
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _read(directory: str) -> CachedFeatures | None:
    if not os.path.isfile(os.path.join(directory, "meta.json")):
        return None
    try:
        return CachedFeatures(directory)
    except Exception as exc:  # a damaged or foreign entry: tokenise again
        logger.warning("ignoring the data cache entry %s (%s: %s)", directory, type(exc).__name__, exc)
        return None


def cached_features(cache_dir: str, key: str, build: Callable[[], Sequence[InputFeature]], *,
                    description: str = "", info: dict[str, Any] | None = None) -> Sequence[InputFeature]:
    """The features of entry ``key`` under ``cache_dir``, built with ``build()`` (and written) when missing.

    In a multi-process job whose process group exists, the main process builds and writes; the others wait for
    it, then read the entry (a rank that cannot see it, e.g. on another machine without a shared ``cache_dir``,
    builds its own features, with a warning). Before the group exists (the trainer loads its data before the
    model's strategy joins the group) the ranks cannot wait for each other: each reads the entry, or builds and
    writes it itself (an entry is renamed into place whole, and the first one written is kept)."""
    from twinkle_core import distributed

    directory = os.path.join(cache_dir, key)
    multi = distributed.world_size() > 1 and distributed.has_process_group()
    main = distributed.is_main_process()
    if not multi or main:
        found = _read(directory)
        if found is None:
            try:
                features = build()
                write_features(directory, features, info)
                logger.info("tokenised %s into the data cache %s", description or "the data", directory)
            except BaseException as exc:
                error = f"{type(exc).__name__}: {exc}"
                if multi:
                    distributed.broadcast_object(error)
                raise
            found = _read(directory)
            if found is None:  # pragma: no cover - written but unreadable: use the features in memory
                if multi:
                    distributed.broadcast_object(None)
                return features
        else:
            logger.info("read %s from the data cache %s (no tokenisation)", description or "the data", directory)
        if multi:
            distributed.broadcast_object(None)
        return found
    error = distributed.broadcast_object(None)  # waits for the main process
    if error is not None:
        raise RuntimeError(f"the main process failed to tokenise the data: {error}")
    found = _read(directory)
    if found is None:
        logger.warning("the data cache %s is not visible on this rank (not a shared file system?); "
                       "tokenising here", directory)
        return build()
    return found


def default_cache_dir(output_dir: str | os.PathLike[str]) -> str:
    return os.path.join(os.fspath(output_dir), "data_cache")


__all__ = ["FORMAT_VERSION", "CachedFeatures", "cached_features", "default_cache_dir", "fingerprint",
           "source_fingerprint", "tokenizer_fingerprint", "write_features"]
