"""rollbox_sdk: a typed Python client for `rollbox serve`'s native API.

Sandboxes (microVMs) from templates, exec (unary and streaming, with stdin and signals),
files and tar, memory snapshots, fork into N clones, reset to a snapshot, batches, labels,
TTLs, usage and metrics, named shared volumes that sandboxes mount, and ``@function``: a
Python function run in a sandbox of its own (``.remote()``, ``.map()``, ``.spawn()``). :class:`Client` is
synchronous, :class:`AsyncClient` asynchronous; both speak to the daemon over its Unix
socket or loopback TCP.
"""

from ._core import DEFAULT_SOCKET, ImageSource, Page, RegistryAuth
from .aio import AsyncClient, AsyncExecStream
from .client import Client, ExecStream
from .function import Function, FunctionCall, FunctionError, RemoteTraceback, function
from .errors import (
    ApiError,
    BadRequest,
    ConfigError,
    Conflict,
    Forbidden,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    RollboxError,
    ServerError,
    StreamError,
    TooLarge,
    TransportError,
    Unauthorized,
    Unavailable,
)
from .types import (
    ExecEvent,
    ExecResult,
    ExitInfo,
    FileInfo,
    Gpu,
    ItemResult,
    ExposedPort,
    Network,
    NodeInfo,
    Sandbox,
    Snapshot,
    Template,
    Usage,
    Volume,
    VolumeInfo,
    Written,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_SOCKET",
    "ApiError",
    "AsyncClient",
    "AsyncExecStream",
    "BadRequest",
    "Client",
    "ConfigError",
    "Conflict",
    "ExecEvent",
    "ExecResult",
    "ExecStream",
    "ExitInfo",
    "FileInfo",
    "Forbidden",
    "Function",
    "FunctionCall",
    "FunctionError",
    "Gpu",
    "ImageSource",
    "ItemResult",
    "MethodNotAllowed",
    "ExposedPort",
    "Network",
    "NodeInfo",
    "NotFound",
    "Overloaded",
    "Page",
    "RegistryAuth",
    "RemoteTraceback",
    "RollboxError",
    "Sandbox",
    "ServerError",
    "Snapshot",
    "StreamError",
    "Template",
    "TooLarge",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "Usage",
    "Volume",
    "VolumeInfo",
    "Written",
    "function",
]
