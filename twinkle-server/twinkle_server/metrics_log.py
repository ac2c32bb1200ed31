"""Per-run training metrics as the API layers report them (loss per ``forward_backward``, step counts), kept in
memory for the console and appended to ``state_dir/tenants/<tenant>/<model_id>/metrics.jsonl``, so curves survive a
restart."""

from __future__ import annotations

import json
import math
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

MAX_POINTS = 5000  # per run in memory; the file keeps everything


class MetricsLog:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self._lock = threading.Lock()
        self._points: dict[str, list[dict[str, Any]]] = defaultdict(list)

    def _file(self, tenant: str, model_id: str) -> Path:
        return self.state_dir / "tenants" / tenant / model_id / "metrics.jsonl"

    def record(self, tenant: str, model_id: str, kind: str, values: dict[str, Any]) -> None:
        point = {"time": time.time(), "kind": kind,
                 **{k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}}
        with self._lock:
            points = self._points[model_id]
            point["index"] = (points[-1]["index"] + 1) if points else self._count_on_disk(tenant, model_id)
            points.append(point)
            del points[:-MAX_POINTS]
            path = self._file(tenant, model_id)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as handle:
                handle.write(json.dumps(point) + "\n")

    def _count_on_disk(self, tenant: str, model_id: str) -> int:
        path = self._file(tenant, model_id)
        return sum(1 for _ in open(path)) if path.exists() else 0

    def points(self, tenant: str, model_id: str, *, since: int = -1) -> list[dict[str, Any]]:
        with self._lock:
            if model_id not in self._points:
                self._points[model_id] = self._read(tenant, model_id)
            return [p for p in self._points[model_id] if p["index"] > since]

    def _read(self, tenant: str, model_id: str) -> list[dict[str, Any]]:
        path = self._file(tenant, model_id)
        if not path.exists():
            return []
        points = []
        for line in path.read_text().splitlines():
            try:
                points.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash: the rest are whole
                continue
        return points[-MAX_POINTS:]
