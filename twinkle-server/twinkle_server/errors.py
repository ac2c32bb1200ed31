"""The service's errors: each carries the HTTP status it answers with and a message that names the fix."""

from __future__ import annotations

from twinkle_core.errors import TwinkleError


class ServiceError(TwinkleError):
    """A request the service refuses; ``status`` is the HTTP status, ``category`` Tinker's error category
    (``user`` for the caller's mistakes, ``server`` for ours)."""

    status: int = 400
    category: str = "user"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(ServiceError):
    status = 400


class Unauthorized(ServiceError):
    status = 401


class NotFound(ServiceError):
    """Also what another tenant's resource answers: its existence is not disclosed."""

    status = 404


class PayloadTooLarge(ServiceError):
    status = 413


class TooManyRequests(ServiceError):
    status = 429


class Unavailable(ServiceError):
    """The server is shutting down or the model is not loaded."""

    status = 503
    category = "server"
