"""Checkpoint downloads (what ``tinker checkpoint download`` and ``RestClient.get_external_weights_urls`` do):
signed per-file URLs of an exported adapter, fetched without an API key until they expire. The signing key is made
per app run, so a restarted server refuses the links of the previous one."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from tinker import types as ttypes

from twinkle_server import tinker_wire as wire
from twinkle_server.errors import BadRequest, NotFound
from twinkle_server.tinker_common import checkpoint_at, json_response, per_app, service_of, tenant_of

#: lifetime of the signed file URLs of get_external_weights_urls
DOWNLOAD_URL_TTL_S = 3600

router = APIRouter()


class UrlSigner:
    """Signs and verifies the claims of a download link (an HMAC over base64 JSON)."""

    def __init__(self) -> None:
        self.secret = secrets.token_bytes(32)

    def mac(self, payload: str) -> str:
        return hmac.new(self.secret, payload.encode(), hashlib.sha256).hexdigest()[:32]

    def sign(self, claims: dict[str, Any]) -> str:
        payload = base64.urlsafe_b64encode(json.dumps(claims, separators=(",", ":")).encode()).decode().rstrip("=")
        return f"{payload}.{self.mac(payload)}"

    def verify(self, token: str) -> dict[str, Any]:
        payload, _, mac = token.partition(".")
        if not mac or not hmac.compare_digest(mac, self.mac(payload)):
            raise NotFound("download link not found (invalid or from a previous server run); ask for new URLs")
        try:
            claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        except ValueError:
            raise NotFound("download link not found") from None
        if claims.get("e", 0) < time.time():
            raise NotFound("download link expired; ask for new URLs (get_external_weights_urls)")
        return claims


def url_signer_of(request: Request) -> UrlSigner:
    """The download-link signer of the app serving ``request``."""
    return per_app(request, "tinker_url_signer", UrlSigner)


@router.get("/api/v1/training_runs/{model_id}/checkpoints/{segment}/{name}/external_weights_urls")
async def external_weights_urls(model_id: str, segment: str, name: str, request: Request) -> JSONResponse:
    tenant = tenant_of(request)
    record = checkpoint_at(service_of(request).registry, tenant.name, model_id, segment, name)
    if record.kind == "state":
        raise BadRequest(f"{record.tinker_path} is a training checkpoint (adapter and optimizer state in the "
                         f"server's format); download an export of it: save_weights_external or "
                         f"save_weights_for_sampler gives a PEFT adapter directory")
    expires = int(time.time()) + DOWNLOAD_URL_TTL_S
    token = url_signer_of(request).sign({"t": tenant.name, "p": record.tinker_path, "e": expires})
    base = str(request.base_url).rstrip("/")
    urls = {}
    for path in sorted(p for p in record.directory.rglob("*") if p.is_file()):
        relative = path.relative_to(record.directory).as_posix()
        urls[relative] = f"{base}/api/v1/checkpoint_files/{token}/{relative}"
    return json_response({"urls": urls, "expires": wire.iso_time(expires)}, ttypes.ExternalWeightsUrlsResponse)


@router.get("/api/v1/checkpoint_files/{token}/{relative:path}")
async def checkpoint_file(token: str, relative: str, request: Request) -> Response:
    """A signed download URL (no API key: the signature names the tenant, checkpoint and expiry)."""
    claims = url_signer_of(request).verify(token)
    record = service_of(request).registry.checkpoint(claims["t"], claims["p"])
    root = record.directory.resolve()
    target = (root / relative).resolve()
    if not target.is_relative_to(root) or not target.is_file():
        raise NotFound(f"{relative} is not a file of {record.tinker_path}")
    return FileResponse(target, media_type="application/octet-stream")
