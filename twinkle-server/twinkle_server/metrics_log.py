"""Per-run training metrics as the API layers report them (loss per ``forward_backward``, step counts), kept in
memory for the console and appended to ``state_dir/tenants/<tenant>/<key>/metrics.jsonl``, so curves survive a
restart.

A run's key: a Tinker run's ``model_id`` (``run-...``); a native adapter's ``native:<its name inside the host>``
(unique across tenants, and new when a name is re-created); a full-parameter model's ``full:<base model>``
(:func:`native_key`). In the file's path the key is URL-quoted (a base model's ``/`` names no directory).
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

MAX_POINTS = 5000  # per run in memory; the file keeps everything


def adapter_key(adapter_id: str) -> str:
    """A native adapter's key, by its name inside the host."""
    return f"native:{adapter_id}"


def full_key(base_model: str) -> str:
    """The key of a full-parameter base model's training (by its owner)."""
    return f"full:{base_model}"


def native_key(entry: Any) -> str:
    """The key of a native call's target (``entry``: a native adapter, or a full-parameter model whose
    ``adapter_id`` is ``None``)."""
    return full_key(entry.base_model) if entry.adapter_id is None else adapter_key(entry.adapter_id)


class MetricsLog:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self._lock = threading.Lock()
        self._points: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self._torn: set[tuple[str, str]] = set()  # files whose last line a crash cut: the next write starts a line

    def _file(self, tenant: str, model_id: str) -> Path:
        return self.state_dir / "tenants" / tenant / quote(model_id, safe=":") / "metrics.jsonl"

    def record(self, tenant: str, model_id: str, kind: str, values: dict[str, Any]) -> None:
        point = {"time": time.time(), "kind": kind,
                 **{k: float(v) for k, v in values.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}}
        with self._lock:
            points = self._loaded(tenant, model_id)
            point["index"] = (points[-1]["index"] + 1) if points else 0
            points.append(point)
            del points[:-MAX_POINTS]
            path = self._file(tenant, model_id)
            path.parent.mkdir(parents=True, exist_ok=True)
            start = "\n" if (tenant, model_id) in self._torn else ""
            self._torn.discard((tenant, model_id))
            with open(path, "a") as handle:
                handle.write(start + json.dumps(point) + "\n")

    def points(self, tenant: str, model_id: str, *, since: int = -1) -> list[dict[str, Any]]:
        with self._lock:
            return [p for p in self._loaded(tenant, model_id) if p["index"] > since]

    def _loaded(self, tenant: str, model_id: str) -> list[dict[str, Any]]:
        """The run's points in memory, read from its file the first time (under the lock)."""
        key = (tenant, model_id)
        if key not in self._points:
            self._points[key] = self._read(tenant, model_id)
        return self._points[key]

    def _read(self, tenant: str, model_id: str) -> list[dict[str, Any]]:
        path = self._file(tenant, model_id)
        if not path.exists():
            return []
        text = path.read_text()
        if text and not text.endswith("\n"):
            self._torn.add((tenant, model_id))
        points = []
        for line in text.splitlines():
            try:
                points.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash: the rest are whole
                continue
        return points[-MAX_POINTS:]
