"""The torch / torch_npu / CANN combinations this backend accepts: data, one table, nothing else.

The rule torch_npu releases follow: a torch_npu release ``X.Y.Z`` or ``X.Y.Z.postN`` is built against
torch ``X.Y.Z`` and only that. :data:`SUPPORTED` lists the torch releases a torch_npu exists for and the
CANN toolkit releases Ascend documents each with (empty: not recorded here, see the torch_npu release
notes). The CANN column is shown in messages and the README; it is not checked at run time, because
the toolkit's version is only known to CANN itself.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class SupportedTorch(NamedTuple):
    torch: str
    cann: tuple[str, ...]


SUPPORTED: tuple[SupportedTorch, ...] = (
    SupportedTorch("2.1.0", ("8.0.RC1", "8.0.RC2", "8.0.RC3", "8.0.0", "8.1.RC1", "8.2.RC1", "8.3.RC1")),
    SupportedTorch("2.3.1", ("8.0.RC3", "8.0.0", "8.1.RC1")),
    SupportedTorch("2.4.0", ("8.0.RC3", "8.0.0", "8.1.RC1")),
    SupportedTorch("2.5.1", ("8.1.RC1", "8.2.RC1")),
    SupportedTorch("2.6.0", ("8.2.RC1", "8.3.RC1")),
    SupportedTorch("2.7.1", ("8.3.RC1",)),
    SupportedTorch("2.8.0", ("8.3.RC1",)),
    SupportedTorch("2.9.0", ()),
    SupportedTorch("2.9.1", ()),
    SupportedTorch("2.10.0", ()),
    SupportedTorch("2.11.0", ()),
    SupportedTorch("2.12.0", ()),
    SupportedTorch("2.13.0", ()),
    SupportedTorch("2.14.0", ()),
)

_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)")


def release(version: str) -> str:
    """``2.6.0`` of ``2.6.0.post3``, ``2.6.0+cpu`` or ``2.6.0rc1``; the input unchanged when it has no X.Y.Z."""
    match = _RELEASE.match(version)
    return ".".join(match.groups()) if match else version


def supported_torch(torch_version: str) -> SupportedTorch | None:
    base = release(torch_version)
    return next((row for row in SUPPORTED if row.torch == base), None)


def version_problem(torch_version: str, torch_npu_version: str) -> str | None:
    """Why this torch / torch_npu pair is not supported, naming what to install; ``None`` when it is."""
    torch_base, npu_base = release(torch_version), release(torch_npu_version)
    if supported_torch(torch_version) is None:
        known = ", ".join(row.torch for row in SUPPORTED)
        return (f"torch {torch_version} has no torch_npu release in twinkle-backend-npu's table (torch {known}); "
                f"install one of those torch versions and the torch_npu of the same version")
    if npu_base != torch_base:
        return (f"torch_npu {torch_npu_version} is built for torch {npu_base}, but torch {torch_version} is "
                f"installed; pip install 'torch_npu=={torch_base}.*' (or torch=={npu_base})")
    return None


def describe_table() -> str:
    """The table as text, one torch release per line (for the README and error messages)."""
    lines = []
    for row in SUPPORTED:
        cann = ", ".join(row.cann) if row.cann else "not recorded here (see the torch_npu release notes)"
        lines.append(f"torch {row.torch}  torch_npu {row.torch}[.postN]  CANN {cann}")
    return "\n".join(lines)
