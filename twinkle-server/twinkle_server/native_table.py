"""The native API's adapters in memory: each tenant's adapters by the tenant's name for them, with their name
inside the host's model, their LoRA config and seed, and whether they exist in the model yet."""

from __future__ import annotations

import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from twinkle_server.errors import BadRequest, NotFound
from twinkle_server.registry import NativeAdapterRecord

#: the tenant's name for an adapter: no '.' (it is part of the adapter's name inside the model, and PEFT module
#: names cannot hold one) and no '/' (it names a checkpoint directory and a URL path segment)
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


@dataclass
class NativeAdapter:
    tenant: str
    name: str           # the tenant's name for it
    adapter_id: str     # the name inside the host's model
    base_model: str
    config: dict[str, Any]
    seed: int
    created: float = field(default_factory=time.time)
    ready: bool = False  # in the model (False while its creation is queued)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "base_model": self.base_model, "config": self.config, "seed": self.seed,
                "created": self.created, "ready": self.ready}

    @property
    def rename(self) -> tuple[str, str]:
        """For :func:`~twinkle_server.native_http.user_errors`: messages name the adapter by the tenant's name."""
        return self.adapter_id, self.name

    def record(self) -> NativeAdapterRecord:
        return NativeAdapterRecord(tenant=self.tenant, name=self.name, adapter_id=self.adapter_id,
                                   base_model=self.base_model, config=dict(self.config), seed=self.seed,
                                   created=self.created)

    @classmethod
    def from_record(cls, record: NativeAdapterRecord) -> NativeAdapter:
        return cls(tenant=record.tenant, name=record.name, adapter_id=record.adapter_id,
                   base_model=record.base_model, config=dict(record.config), seed=record.seed,
                   created=record.created)


class NativeAdapters:
    """The tenants' adapters, by (tenant, name). Handlers and the lane's worker both use it, hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple[str, str], NativeAdapter] = {}

    def get(self, tenant: str, name: str) -> NativeAdapter:
        with self._lock:
            entry = self._by_key.get((tenant, name))
        if entry is None:
            raise NotFound(f"adapter {name!r} not found; create it with add_adapter_to_model (POST "
                           f"/twinkle/v1/adapters)")
        return entry

    def reserve(self, entry: NativeAdapter) -> None:
        with self._lock:
            if (entry.tenant, entry.name) in self._by_key:
                raise BadRequest(f"adapter {entry.name!r} already exists; remove_adapter({entry.name!r}) first, or "
                                 f"add_adapter_to_model(..., replace=True)")
            self._by_key[(entry.tenant, entry.name)] = entry

    def drop(self, entry: NativeAdapter) -> None:
        with self._lock:
            if self._by_key.get((entry.tenant, entry.name)) is entry:
                del self._by_key[(entry.tenant, entry.name)]

    def current(self, entry: NativeAdapter) -> bool:
        with self._lock:
            return self._by_key.get((entry.tenant, entry.name)) is entry

    def of_tenant(self, tenant: str, base_model: str | None = None) -> list[NativeAdapter]:
        with self._lock:
            found = [e for (t, _), e in self._by_key.items()
                     if t == tenant and (base_model is None or e.base_model == base_model)]
        return sorted(found, key=lambda e: e.name)


def adapters_of(state: Any) -> NativeAdapters:
    """The table on an app's ``state``, made the first time it is asked for (by a handler, or at startup by
    :func:`twinkle_server.native_adapters.restore`); both run on the event loop's one thread: no race creating
    it."""
    table = getattr(state, "native_adapters", None)
    if table is None:
        table = state.native_adapters = NativeAdapters()
    return table


def new_adapter_id(tenant: str, name: str) -> str:
    # PEFT module names cannot hold '.'; the random part keeps a re-created adapter apart from a removed one
    return f"native_{tenant.replace('.', '_')}_{name}_{uuid.uuid4().hex[:8]}"
