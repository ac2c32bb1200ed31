"""Turn a model URI into a local directory through the source plugins.

``resolve_model("hf://Qwen/Qwen2.5-0.5B")`` asks the plugins which source handles the URI
(``twinkle_select_source``; the core answers by scheme: ``hf://``, ``ms://`` or a local path) and
returns the directory that source produced. Resolution never hangs: network look-ups run under a
hard wall-clock deadline and every failure becomes a :class:`~twinkle_core.errors.SourceError` that
says what went wrong and how to fix it.

Environment:

* ``TWINKLE_OFFLINE=1`` or ``HF_HUB_OFFLINE=1`` — use only what is already cached locally;
* ``TWINKLE_DOWNLOAD_TIMEOUT=SECONDS`` — wall-clock limit of one model download (default 4 hours,
  ``0`` for none); the look-up before it is limited by ``timeout_s``;
* ``TWINKLE_TRUST_REMOTE_CODE=1`` — allow model repositories to run their own code when the
  recipe does not say (``model.trust_remote_code``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from twinkle_core.envflags import env_flag
from twinkle_core.errors import ConfigError, SourceError

logger = logging.getLogger("twinkle.sources")
T = TypeVar("T")

DEFAULT_DOWNLOAD_TIMEOUT_S = 4 * 3600.0


def resolve_model(uri: str, revision: str | None = None, timeout_s: float = 30.0) -> str:
    """Return a local directory holding the model named by ``uri``."""
    if not isinstance(uri, str) or not uri.strip():
        raise SourceError(f"model URI must be a non-empty string, got {uri!r}")
    from twinkle_core.plugins import get_plugins

    plugins = get_plugins()
    source = plugins.load_record("source", plugins.select_source(uri))
    if inspect.isclass(source):
        source = source()
    path = source.resolve(uri, revision=revision, timeout_s=timeout_s)
    logger.info("resolved %s -> %s", uri, path)
    return str(path)


def trust_remote_code(value: bool | None = None) -> bool:
    """Whether a model repository may run its own code: ``value`` if set, else ``TWINKLE_TRUST_REMOTE_CODE``.

    ``value`` is the recipe's ``model.trust_remote_code`` or a backend's ``trust_remote_code=``; the
    default is off. The training loop and every backend ask this one function, so the rule cannot drift.
    """
    if value is not None:
        return bool(value)
    return env_flag("TWINKLE_TRUST_REMOTE_CODE", False)


REMOTE_CODE_FIX = ("read that code, then allow it with `model.trust_remote_code: true` in the recipe, "
                   "TWINKLE_TRUST_REMOTE_CODE=1 in the environment, or trust_remote_code=True from Python")


@contextlib.contextmanager
def explain_remote_code_refusal(what: str) -> Iterator[None]:
    """Turn transformers' refusal to run a repository's code ("pass `trust_remote_code=True`", which a
    recipe user cannot do) into a :class:`ConfigError` naming Twinkle's switches."""
    try:
        yield
    except ValueError as exc:
        if "trust_remote_code=True" not in str(exc) or isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{what} contains custom code that must run to load it, and running a model "
                          f"repository's code is off; {REMOTE_CODE_FIX}") from exc


def offline_mode() -> bool:
    """True when the user asked for no network access (``TWINKLE_OFFLINE`` or ``HF_HUB_OFFLINE``)."""
    return env_flag("TWINKLE_OFFLINE") or env_flag("HF_HUB_OFFLINE")


def download_timeout_s() -> float | None:
    raw = os.environ.get("TWINKLE_DOWNLOAD_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_DOWNLOAD_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise SourceError(f"TWINKLE_DOWNLOAD_TIMEOUT={raw!r} is not a number of seconds") from None
    return value if value > 0 else None


def split_revision(path: str, revision: str | None) -> tuple[str, str | None]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; an explicit ``revision`` argument wins."""
    repo_id, sep, rev = path.partition("@")
    if sep and rev and revision is None:
        revision = rev
    return repo_id.strip(), revision


def check_repo_id(uri: str, repo_id: str, example: str) -> None:
    parts = repo_id.split("/")
    if not repo_id or len(parts) > 2 or any(not p for p in parts):
        raise SourceError(f"{uri!r} does not name a model; write it as {example}")


def call_with_deadline(fn: Callable[[], T], timeout_s: float | None, what: str) -> T:
    """Run ``fn`` in a daemon thread and wait at most ``timeout_s`` seconds for it.

    Network libraries can block in DNS or on a stalled socket far longer than their own timeouts;
    this turns such a stall into a :class:`SourceError` instead of a hang. The abandoned thread is a
    daemon, so it never keeps the process alive.
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=target, name=f"twinkle-source: {what}", daemon=True)
    thread.start()
    if not done.wait(timeout_s):
        raise SourceError(
            f"{what} did not finish within {timeout_s:g} s; the network is unreachable or too slow. "
            f"Check your connection (or the hub's endpoint), set TWINKLE_OFFLINE=1 to use the local cache, "
            f"or raise the limit (TWINKLE_DOWNLOAD_TIMEOUT for downloads)"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def supported_kwargs(fn: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    """Keep only the keyword arguments ``fn`` accepts (hub libraries change their signatures)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
