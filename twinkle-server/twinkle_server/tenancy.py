"""API keys to tenants. Keys are compared by their SHA-256 (the config need not hold the keys themselves)."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from twinkle_server.config import TenantConfig
from twinkle_server.errors import Unauthorized


@dataclass(frozen=True)
class Tenant:
    name: str


class Tenants:
    def __init__(self, configs: tuple[TenantConfig, ...]) -> None:
        self._by_digest = {c.api_key_sha256: Tenant(c.name) for c in configs}
        self.names = tuple(c.name for c in configs)

    def authenticate(self, api_key: str | None) -> Tenant:
        if not api_key:
            raise Unauthorized("no API key: send it in the X-API-Key header (the Tinker SDK's api_key / "
                               "TINKER_API_KEY)")
        digest = hashlib.sha256(api_key.encode()).hexdigest()
        for known, tenant in self._by_digest.items():  # constant time per key: no timing oracle on the prefix
            if hmac.compare_digest(known, digest):
                return tenant
        raise Unauthorized("unknown API key")
