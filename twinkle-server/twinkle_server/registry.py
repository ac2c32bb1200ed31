"""What the server must remember across a restart: sessions, training runs and checkpoints, per tenant.

One JSON document (``state_dir/registry.json``), rewritten atomically (temporary file, fsync, rename) after every
change, so a server killed at any instant restarts with the last complete registry. Checkpoint directories live
under ``state_dir/tenants/<tenant>/<model_id>/<kind>/<name>`` and are registered only after they are complete.

Native-API adapters (:mod:`twinkle_server.native_adapters`) are kept as :class:`NativeAdapterRecord` s beside the
runs, not as runs: every run is a Tinker training run that Tinker's listings show and its ids address, and a native
adapter is neither (the native API addresses it by the tenant's name for it).

Every lookup takes the asking tenant: another tenant's id answers :class:`NotFound`, exactly like an id that
does not exist, so ids are not an oracle for other tenants' work.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from twinkle_server.config import SAFE_NAME
from twinkle_server.errors import BadRequest, NotFound

CHECKPOINT_KINDS = {"state": "weights", "sampler": "sampler_weights", "external": "external_weights"}  # Tinker's


@dataclass
class SessionRecord:
    session_id: str
    tenant: str
    created: float
    last_seen: float
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunRecord:
    model_id: str
    tenant: str
    base_model: str
    lora_rank: int
    lora: dict[str, Any]
    created: float
    session_id: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def adapter_id(self) -> str:
        """The adapter's name inside the host: unique across tenants."""
        return f"{self.tenant}.{self.model_id}"


@dataclass
class NativeAdapterRecord:
    """What re-creates a native-API adapter after a restart: its LoRA config and seed (fresh weights, as at its
    creation; the trained state comes back from one of its checkpoints, as the client decides)."""

    tenant: str
    name: str  # the tenant's name for it
    adapter_id: str  # its name inside the host's model: unique across tenants, the record's key
    base_model: str
    config: dict[str, Any]
    seed: int
    created: float


@dataclass
class CheckpointRecord:
    tinker_path: str
    tenant: str
    model_id: str
    kind: str
    name: str
    path: str
    created: float
    optimizer: bool = True
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def directory(self) -> Path:
        return Path(self.path)


class Registry:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._file = self.state_dir / "registry.json"
        self._lock = threading.RLock()
        self.sessions: dict[str, SessionRecord] = {}
        self.runs: dict[str, RunRecord] = {}
        self.checkpoints_by_path: dict[str, CheckpointRecord] = {}
        self.native_adapters: dict[str, NativeAdapterRecord] = {}
        self._load()

    # ------------------------------------------------------------------ persistence
    def _load(self) -> None:
        if not self._file.exists():
            return
        data = json.loads(self._file.read_text())
        self.sessions = {k: SessionRecord(**v) for k, v in data.get("sessions", {}).items()}
        self.runs = {k: RunRecord(**v) for k, v in data.get("runs", {}).items()}
        self.checkpoints_by_path = {k: CheckpointRecord(**v) for k, v in data.get("checkpoints", {}).items()}
        # absent from registries written before native adapters were durable
        self.native_adapters = {k: NativeAdapterRecord(**v) for k, v in data.get("native_adapters", {}).items()}

    def _save(self) -> None:
        data = {"sessions": {k: asdict(v) for k, v in self.sessions.items()},
                "runs": {k: asdict(v) for k, v in self.runs.items()},
                "checkpoints": {k: asdict(v) for k, v in self.checkpoints_by_path.items()},
                "native_adapters": {k: asdict(v) for k, v in self.native_adapters.items()}}
        tmp = self._file.with_name(f".{self._file.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self._file)

    # ------------------------------------------------------------------ sessions
    def new_session(self, tenant: str, meta: dict[str, Any] | None = None) -> str:
        with self._lock:
            now = time.time()
            record = SessionRecord(session_id=f"session-{uuid.uuid4().hex}", tenant=tenant, created=now,
                                   last_seen=now, meta=dict(meta or {}))
            self.sessions[record.session_id] = record
            self._save()
            return record.session_id

    def session(self, tenant: str, session_id: str) -> SessionRecord:
        record = self.sessions.get(session_id)
        if record is None or record.tenant != tenant:
            raise NotFound(f"session {session_id!r} not found")
        return record

    def touch_session(self, tenant: str, session_id: str) -> None:
        with self._lock:
            self.session(tenant, session_id).last_seen = time.time()  # heartbeats are not worth an fsync each

    # ------------------------------------------------------------------ runs
    def new_run(self, tenant: str, *, base_model: str, lora_rank: int, lora: dict[str, Any] | None = None,
                session_id: str | None = None, meta: dict[str, Any] | None = None,
                model_id: str | None = None) -> RunRecord:
        """A new run; ``model_id`` when the client decides it (Tinker's ``<session>:train:<n>``), else a fresh id."""
        with self._lock:
            if model_id is not None and model_id in self.runs:
                raise BadRequest(f"model_id {model_id!r} already exists")
            record = RunRecord(model_id=model_id or f"run-{uuid.uuid4().hex[:16]}", tenant=tenant, base_model=base_model,
                               lora_rank=int(lora_rank), lora=dict(lora or {}), created=time.time(),
                               session_id=session_id, meta=dict(meta or {}))
            self.runs[record.model_id] = record
            self._save()
            return record

    def run(self, tenant: str, model_id: str) -> RunRecord:
        record = self.runs.get(model_id)
        if record is None or record.tenant != tenant:
            raise NotFound(f"training run (model_id) {model_id!r} not found")
        return record

    def tenant_runs(self, tenant: str) -> list[RunRecord]:
        return sorted((r for r in self.runs.values() if r.tenant == tenant), key=lambda r: r.created)

    def remove_run(self, tenant: str, model_id: str) -> RunRecord:
        with self._lock:
            record = self.run(tenant, model_id)
            del self.runs[model_id]
            self._save()
            return record

    # ------------------------------------------------------------------ native adapters
    def add_native_adapter(self, record: NativeAdapterRecord) -> None:
        with self._lock:
            if record.adapter_id in self.native_adapters:
                raise BadRequest(f"native adapter {record.adapter_id!r} is already registered")
            self.native_adapters[record.adapter_id] = record
            self._save()

    def remove_native_adapter(self, adapter_id: str) -> None:
        """Forget a native adapter; one not registered is no error (its creation may have failed before)."""
        with self._lock:
            if self.native_adapters.pop(adapter_id, None) is not None:
                self._save()

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_dir(self, run: RunRecord, kind: str, name: str) -> Path:
        """Where a checkpoint of ``run`` is written (not yet registered)."""
        if kind not in CHECKPOINT_KINDS:
            raise BadRequest(f"checkpoint kind {kind!r} is not one of {sorted(CHECKPOINT_KINDS)}")
        if not SAFE_NAME.match(name):
            raise BadRequest(f"checkpoint name {name!r} must be 1-64 letters, digits, '_', '.' or '-' (it names a "
                             f"directory)")
        return self.state_dir / "tenants" / run.tenant / run.model_id / CHECKPOINT_KINDS[kind] / name

    def add_checkpoint(self, run: RunRecord, *, kind: str, name: str, optimizer: bool = True,
                       meta: dict[str, Any] | None = None) -> CheckpointRecord:
        with self._lock:
            directory = self.checkpoint_dir(run, kind, name)
            if not directory.is_dir():
                raise NotFound(f"checkpoint directory {directory} was not written")
            path = f"tinker://{run.model_id}/{CHECKPOINT_KINDS[kind]}/{name}"
            record = CheckpointRecord(tinker_path=path, tenant=run.tenant, model_id=run.model_id, kind=kind,
                                      name=name, path=str(directory), created=time.time(), optimizer=optimizer,
                                      meta=dict(meta or {}))
            self.checkpoints_by_path[path] = record
            self._save()
            return record

    def checkpoint(self, tenant: str, tinker_path: str) -> CheckpointRecord:
        record = self.checkpoints_by_path.get(tinker_path)
        if record is None or record.tenant != tenant:
            raise NotFound(f"checkpoint {tinker_path!r} not found")
        return record

    def checkpoints(self, tenant: str, model_id: str | None = None) -> list[CheckpointRecord]:
        if model_id is not None:
            self.run(tenant, model_id)
        found = [c for c in self.checkpoints_by_path.values()
                 if c.tenant == tenant and (model_id is None or c.model_id == model_id)]
        return sorted(found, key=lambda c: c.created)

    def remove_checkpoint(self, tenant: str, tinker_path: str) -> CheckpointRecord:
        with self._lock:
            record = self.checkpoint(tenant, tinker_path)
            del self.checkpoints_by_path[tinker_path]
            self._save()
            return record
