"""The model-source contract: turn a URI into a local directory."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar


class ModelSource(ABC):
    scheme: ClassVar[str] = ""

    @abstractmethod
    def resolve(self, uri: str, *, revision: str | None = None, timeout_s: float = 30.0) -> str:
        """Return a local directory holding the model named by ``uri`` (downloading if needed)."""


def split_uri(uri: str) -> tuple[str, str]:
    """``"ms://org/name"`` -> ``("ms", "org/name")``; a path -> ``("local", path)``."""
    if "://" in uri:
        scheme, rest = uri.split("://", 1)
        return scheme.lower(), rest
    return "local", uri
