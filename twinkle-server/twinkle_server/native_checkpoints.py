"""The native API's checkpoints: ``save`` / ``load`` / ``resume_from_checkpoint`` (as calls) and the routes that list
a checkpoint's files and download them.

A checkpoint lives under ``state_dir/tenants/<tenant>/native/<adapter name>/<checkpoint name>``: by the tenant's
names, so it outlives the adapter (a re-created adapter of the same name, also after a restart, finds it). Its
marker lists every file with its size and sha256; only listed files are ever served.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from twinkle_server import tensor_wire
from twinkle_server.errors import BadRequest, NotFound
from twinkle_server.native_args import REQUIRED, Call, plain_options, take
from twinkle_server.native_http import authenticate, service_of
from twinkle_server.native_table import ADAPTER_NAME

router = APIRouter()

CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: the training-state folder of a checkpoint, not part of the PEFT adapter directory the client downloads
STATE_DIR = "twinkle_state"
MARKER = "twinkle_checkpoint.json"


def checkpoint_root(service: Any, tenant: str, adapter: str) -> Path:
    return Path(service.config.state_dir) / "tenants" / tenant / "native" / adapter


def checkpoint_name(value: Any, method: str) -> str:
    if not isinstance(value, str) or not CHECKPOINT_NAME.match(value) or ".." in value:
        raise BadRequest(f"{method}: checkpoint name {value!r} must be 1-64 letters, digits, '_', '.' or '-'")
    return value


def checkpoint_files(directory: Path) -> list[dict[str, Any]]:
    """The files of a saved checkpoint: path, size, sha256 (from its marker), and whether it belongs to the plain
    PEFT adapter directory (weights, adapter config, tokenizer) rather than to the training state."""
    marker = directory / MARKER
    try:
        recorded = json.loads(marker.read_text()).get("files") or {}
    except (OSError, ValueError):
        raise NotFound(f"checkpoint {directory.name!r} is not complete") from None
    return [{"path": path, "size": int(info["size"]), "sha256": info["sha256"],
             "weights": not path.startswith(f"{STATE_DIR}/")}
            for path, info in sorted(recorded.items())]


# ============================================================================================ calls
def prepare_save(call: Call) -> Any:
    a = take(call.args, "save", name=REQUIRED, save_optimizer=True, extra_state=None)
    name = checkpoint_name(a["name"], "save")
    extra = plain_options(a["extra_state"], "save")
    root = call.checkpoints

    def run() -> Any:
        path = call.guard("save", lambda: call.model.save(name, output_dir=str(root), adapter_name=call.aid,
                                                            save_optimizer=bool(a["save_optimizer"]),
                                                            extra_state=extra))
        return {"name": name, "files": checkpoint_files(Path(path))}
    return run


def _saved(call: Call, method: str) -> Path:
    a = take(call.args, method, name=REQUIRED)
    name = checkpoint_name(a["name"], method)
    path = call.checkpoints / name
    if not (path / MARKER).is_file():
        raise NotFound(f"{method}: {call.entry.name!r} has no checkpoint {name!r} on the server (save() names "
                       f"them)")
    return path


def prepare_load(call: Call) -> Any:
    path = _saved(call, "load")
    return lambda: call.guard("load", lambda: call.model.load(str(path), adapter_name=call.aid))


def prepare_resume_from_checkpoint(call: Call) -> Any:
    path = _saved(call, "resume_from_checkpoint")
    return lambda: tensor_wire.jsonable(call.guard("resume_from_checkpoint", lambda: call.model.resume_from_checkpoint(
        str(path), adapter_name=call.aid)))


# ============================================================================================ routes
def _checkpoint_dir(request: Request, tenant: Any, adapter: str, name: str) -> Path:
    if not ADAPTER_NAME.match(adapter):
        raise NotFound(f"adapter {adapter!r} not found")
    name = checkpoint_name(name, "checkpoint")
    directory = checkpoint_root(service_of(request), tenant.name, adapter) / name
    if not (directory / MARKER).is_file():
        raise NotFound(f"adapter {adapter!r} has no checkpoint {name!r}")
    return directory


@router.get("/adapters/{adapter}/checkpoints")
async def list_checkpoints(adapter: str, request: Request) -> dict[str, Any]:
    tenant = authenticate(request)
    if not ADAPTER_NAME.match(adapter):
        raise NotFound(f"adapter {adapter!r} not found")
    return {"checkpoints": saved_names(checkpoint_root(service_of(request), tenant.name, adapter))}


@router.get("/adapters/{adapter}/checkpoints/{name}")
async def checkpoint(adapter: str, name: str, request: Request) -> dict[str, Any]:
    tenant = authenticate(request)
    directory = _checkpoint_dir(request, tenant, adapter, name)
    return {"name": name, "files": await run_in_threadpool(checkpoint_files, directory)}


@router.get("/adapters/{adapter}/checkpoints/{name}/files/{path:path}")
async def checkpoint_file(adapter: str, name: str, path: str, request: Request) -> Any:
    tenant = authenticate(request)
    directory = _checkpoint_dir(request, tenant, adapter, name)
    return await file_response(directory, path, f"checkpoint {name!r} of adapter {adapter!r}")


def saved_names(root: Path) -> list[str]:
    """The names of the complete checkpoints under ``root``."""
    return sorted(p.name for p in root.iterdir() if (p / MARKER).is_file()) if root.is_dir() else []


async def file_response(directory: Path, path: str, what: str) -> FileResponse:
    """The file ``path`` of the checkpoint at ``directory``, if its manifest lists it (404 naming ``what`` else)."""
    listed = {f["path"] for f in await run_in_threadpool(checkpoint_files, directory)}
    if path not in listed:  # only files the checkpoint's manifest names: no way out of the directory
        raise NotFound(f"{what} has no file {path!r}")
    target = directory / path
    if not os.path.realpath(target).startswith(os.path.realpath(directory) + os.sep):
        raise NotFound(f"{what} has no file {path!r}")
    return FileResponse(target, media_type="application/octet-stream")
