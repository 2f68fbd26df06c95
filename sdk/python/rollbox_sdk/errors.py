"""Exceptions: one per kind of refusal, all under :class:`RollboxError`.

The message is the daemon's own. A 400's message starts with the field or query parameter at
fault (``"ttl_s: 0 is out of range (1-2592000)"``); :attr:`RollboxError.field` holds it.
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple, Type

__all__ = [
    "RollboxError",
    "ConfigError",
    "TransportError",
    "StreamError",
    "ApiError",
    "BadRequest",
    "Unauthorized",
    "Forbidden",
    "NotFound",
    "MethodNotAllowed",
    "Conflict",
    "TooLarge",
    "Overloaded",
    "ServerError",
    "Unavailable",
]

# "ttl_s: ...", "labels.team: ...", "vcpus, memory_mib: ..." (serde paths and query names).
_FIELDS = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*(?:, [A-Za-z_][A-Za-z0-9_.\[\]]*)*): ")


def parse_fields(message: str) -> Tuple[str, ...]:
    """The field names a daemon 400 message starts with (empty when it names none)."""
    found = _FIELDS.match(message)
    if found is None:
        return ()
    return tuple(found.group(1).split(", "))


class RollboxError(Exception):
    """Base of every error this SDK raises."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> Tuple[object, ...]:
        # Pickled whole (Ray hands an actor's exceptions back this way): the keyword-only
        # fields of the subclasses are in __dict__, which a plain Exception pickle would drop.
        return (_restore, (type(self), self.message, dict(self.__dict__)))


def _restore(cls: Type["RollboxError"], message: str, state: Dict[str, object]) -> "RollboxError":
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class ConfigError(RollboxError):
    """The client is not configured (no API key, a bad URL)."""


class TransportError(RollboxError):
    """The daemon could not be reached, or the connection broke (wraps httpx's error)."""


class StreamError(RollboxError):
    """A streaming exec broke off: an ``error`` line, or a body that ended before ``exit``."""


class ApiError(RollboxError):
    """The daemon refused or failed a request.

    Attributes:
        status: the HTTP status code.
        field: the first field or parameter the message names (400s), else None.
        fields: every field the message names.
        method, path: the request.
    """

    status: int = 0

    def __init__(self, message: str, *, status: int, method: str = "", path: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.method = method
        self.path = path
        self.fields = parse_fields(message) if status == 400 else ()
        self.field: Optional[str] = self.fields[0] if self.fields else None

    def __str__(self) -> str:
        where = f" ({self.method} {self.path})" if self.method else ""
        return f"{self.status}: {self.message}{where}"


class BadRequest(ApiError):
    """400: the request is malformed; ``field`` names what is wrong."""


class Unauthorized(ApiError):
    """401: missing or wrong API key."""


class Forbidden(ApiError):
    """403: a tenant's key asked for an admin's action (templates' writes, keys, metrics), or
    a template file or registry is outside what the daemon allows."""


class NotFound(ApiError):
    """404: no such sandbox, template, snapshot or process."""


class MethodNotAllowed(ApiError):
    """405."""


class Conflict(ApiError):
    """409: the name is taken, or the sandbox is not in a state that allows this."""


class TooLarge(ApiError):
    """413: the body is over the daemon's limit."""


class Overloaded(ApiError):
    """429: too many creates in flight, or the node is full; retry after ``retry_after``
    seconds. ``limit`` names the node's limit that refused it (``"max_sandboxes"`` or
    ``"memory_budget_mib"``), None for creates in flight."""

    def __init__(
        self,
        message: str,
        *,
        status: int,
        method: str = "",
        path: str = "",
        retry_after: Optional[float] = None,
        limit: Optional[str] = None,
    ) -> None:
        super().__init__(message, status=status, method=method, path=path)
        self.retry_after = retry_after
        self.limit = limit


class ServerError(ApiError):
    """500: the daemon failed (for a create: the VMM did not start; nothing is left)."""


class Unavailable(ApiError):
    """503: the guest agent did not answer, the host lacks what was asked (cpu_limit), or the
    node is draining."""


_BY_STATUS: Dict[int, Type[ApiError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    405: MethodNotAllowed,
    409: Conflict,
    413: TooLarge,
    429: Overloaded,
    500: ServerError,
    503: Unavailable,
}


def error_for(
    status: int,
    message: str,
    method: str,
    path: str,
    retry_after: Optional[str],
    limit: Optional[str] = None,
) -> ApiError:
    """The exception for a non-2xx answer."""
    if status == 429:
        seconds: Optional[float] = None
        if retry_after is not None:
            try:
                seconds = float(retry_after)
            except ValueError:
                seconds = None
        return Overloaded(
            message, status=status, method=method, path=path, retry_after=seconds, limit=limit
        )
    kind = _BY_STATUS.get(status, ServerError if status >= 500 else ApiError)
    return kind(message, status=status, method=method, path=path)
