"""What the sync and async clients share: configuration, and each API call as a `Call`
(method, path, query, body, and how to read the answer), so both send exactly the same; and
the one thing in which they truly differ, how an upload body is handed to httpx."""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass, field
from typing import (
    IO,
    Any,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Dict,
    Generic,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)
from urllib.parse import quote

import httpx

from .errors import ConfigError, error_for
from .types import (
    Gpu,
    ExecResult,
    FileInfo,
    ItemResult,
    NodeInfo,
    Sandbox,
    Snapshot,
    Template,
    Usage,
    Volume,
    VolumeInfo,
    Written,
    items,
)

T = TypeVar("T")

DEFAULT_SOCKET = "/run/rollbox/rollbox.sock"
"""Where `rollbox serve` listens by default (as the CLI)."""

SandboxRef = Union[str, Sandbox]
"""A sandbox id, or a Sandbox."""

VolumeRef = Union[str, VolumeInfo]
"""A volume's name, or a VolumeInfo."""

Mounts = Sequence[Union[Volume, Mapping[str, Any]]]
"""A create's volume mounts: Volume, or its JSON object."""

Command = Union[str, Sequence[str]]
"""An argv, or a string that the sandbox runs with /bin/sh -c."""

Params = List[Tuple[str, str]]

CHUNK = 256 * 1024
"""Bytes per chunk: file objects are uploaded, and downloads streamed, in pieces this big."""

Upload = Union[bytes, str, IO[bytes], Iterable[bytes]]
"""An upload body: bytes, text (UTF-8), a binary file object, or an iterable of chunks."""

AsyncUpload = Union[bytes, str, IO[bytes], Iterable[bytes], AsyncIterable[bytes]]
"""An upload body: bytes, text (UTF-8), a binary file object, or a (async) iterable of chunks."""


@dataclass
class ImageSource:
    """Where a template's rootfs comes from when the daemon builds it from an image.

    Without ``docker_archive`` or ``oci_layout``, ``reference`` is pulled from its registry.
    """

    reference: Optional[str] = None
    docker_archive: Optional[str] = None
    oci_layout: Optional[str] = None
    insecure: bool = False
    size_mib: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        body: Dict[str, Any] = {
            key: value
            for key, value in (
                ("reference", self.reference),
                ("docker_archive", self.docker_archive),
                ("oci_layout", self.oci_layout),
                ("size_mib", self.size_mib),
            )
            if value is not None
        }
        if self.insecure:
            body["insecure"] = True
        return body


@dataclass(repr=False)
class RegistryAuth:
    """Registry credentials for one template build (``add_template(registry_auth=...)``): a
    ``username`` and ``password`` (basic auth, or traded for a token at the registry's token
    server), or a registry ``token``. They go with that request only; the daemon never stores,
    logs or answers them. Its repr hides the secret."""

    username: Optional[str] = None
    password: Optional[str] = None
    token: Optional[str] = None

    def __repr__(self) -> str:
        if self.token is not None:
            return "RegistryAuth(token=<redacted>)"
        return f"RegistryAuth(username={self.username!r}, password=<redacted>)"

    def to_json(self) -> Dict[str, str]:
        if self.token is not None and self.username is None and self.password is None:
            return {"token": self.token}
        if self.username is not None and self.password is not None and self.token is None:
            return {"username": self.username, "password": self.password}
        raise ConfigError("registry_auth: give username and password, or token alone")


RegistryAuthArg = Union[RegistryAuth, Tuple[str, str], Mapping[str, str]]
"""Registry credentials: RegistryAuth, a (username, password) pair, or image.auth's JSON."""


def registry_auth_json(auth: RegistryAuthArg) -> Dict[str, str]:
    if isinstance(auth, RegistryAuth):
        return auth.to_json()
    if isinstance(auth, tuple):
        if len(auth) != 2:
            raise ConfigError("registry_auth: a pair is (username, password)")
        return RegistryAuth(username=auth[0], password=auth[1]).to_json()
    return RegistryAuth(**dict(auth)).to_json()


@dataclass
class Page:
    """One page of GET /sandboxes."""

    sandboxes: List[Sandbox]
    next_page_token: Optional[str]


@dataclass
class Config:
    """Where the daemon is and the key to send."""

    base_url: str
    socket: Optional[str]
    api_key: str
    timeout: float


def resolve_config(
    url: Optional[str], socket: Optional[str], api_key: Optional[str], timeout: float
) -> Config:
    """Like the CLI: url, else socket, else $ROLLBOX_URL, else $ROLLBOX_SOCKET, else
    /run/rollbox/rollbox.sock; the key from api_key, else $ROLLBOX_API_KEY."""

    def env(name: str) -> Optional[str]:
        value = os.environ.get(name, "")
        return value if value else None

    key = api_key if api_key is not None else env("ROLLBOX_API_KEY")
    if key is None or not key.strip():
        raise ConfigError("no API key: pass api_key= or set ROLLBOX_API_KEY")
    if url is None and socket is None:
        url = env("ROLLBOX_URL")
        if url is None:
            socket = env("ROLLBOX_SOCKET") or DEFAULT_SOCKET
    if url is not None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"url: {url!r} is not an http:// or https:// URL")
        return Config(url.rstrip("/"), None, key.strip(), timeout)
    return Config("http://rollbox", socket, key.strip(), timeout)


def sandbox_id(sandbox: SandboxRef) -> str:
    return sandbox.id if isinstance(sandbox, Sandbox) else sandbox


def seg(value: Union[str, int]) -> str:
    """One path segment, escaped."""
    return quote(str(value), safe="")


@dataclass
class Call(Generic[T]):
    """One request and how to read its answer."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    params: Params = field(default_factory=list)
    json: Any = None
    content: Any = None
    headers: Dict[str, str] = field(default_factory=dict)
    timeout: Any = "default"
    """httpx timeout for this call; "default" keeps the client's."""


def raise_for(response: httpx.Response, method: str, path: str) -> None:
    """Raises the matching ApiError for a non-2xx answer (its body already read)."""
    if response.is_success:
        return
    message = ""
    limit = None
    try:
        body = response.json()
        if isinstance(body, dict):
            message = str(body.get("error") or body.get("message") or "")
            limit = body.get("limit") if isinstance(body.get("limit"), str) else None
    except (ValueError, UnicodeDecodeError):
        message = ""
    if not message:
        message = response.text.strip() or response.reason_phrase or "no message"
    raise error_for(
        response.status_code,
        message,
        method,
        path,
        response.headers.get("retry-after"),
        limit,
    )


def _json(response: httpx.Response) -> Any:
    return response.json()


def _none(response: httpx.Response) -> None:
    return None


def _sandbox(response: httpx.Response) -> Sandbox:
    return Sandbox.from_json(response.json())


def _template(response: httpx.Response) -> Template:
    return Template.from_json(response.json())


def _snapshot(response: httpx.Response) -> Snapshot:
    return Snapshot.from_json(response.json())


def _written(response: httpx.Response) -> Written:
    body = response.json()
    return Written(path=body.get("path", ""), bytes=body.get("bytes", 0))


def _items(response: httpx.Response) -> List[ItemResult]:
    return items(response.json())


def _drop_none(body: Dict[str, Any]) -> Dict[str, Any]:
    return {key: value for key, value in body.items() if value is not None}


def _labels_params(labels: Optional[Mapping[str, str]]) -> Params:
    return [("label", f"{key}={value}") for key, value in (labels or {}).items()]


def _ids_params(ids: Optional[Sequence[SandboxRef]]) -> Params:
    if ids is None:
        return []
    if isinstance(ids, (str, Sandbox)):
        ids = [ids]
    return [("ids", ",".join(sandbox_id(i) for i in ids))] if ids else []


# --- daemon ---------------------------------------------------------------------------------


def healthz() -> Call[Dict[str, Any]]:
    return Call("GET", "/healthz", _json)


def metrics() -> Call[str]:
    return Call("GET", "/metrics", lambda r: r.text)


def node() -> Call[NodeInfo]:
    return Call("GET", "/node", lambda r: NodeInfo.from_json(r.json()))


def drain(deadline_s: Optional[int]) -> Call[NodeInfo]:
    body: Dict[str, Any] = {} if deadline_s is None else {"deadline_s": deadline_s}
    return Call("POST", "/node/drain", lambda r: NodeInfo.from_json(r.json()), json=body)


def undrain() -> Call[NodeInfo]:
    return Call("DELETE", "/node/drain", lambda r: NodeInfo.from_json(r.json()))


# --- templates ------------------------------------------------------------------------------


def add_template(
    name: str,
    kernel: str,
    rootfs: Optional[str],
    image: Union[ImageSource, Mapping[str, Any], None],
    boot_snapshot: bool,
    initrd: Optional[str],
    cmdline: Optional[str],
    vcpus: Optional[int],
    memory_mib: Optional[int],
    start_cmd: Optional[str] = None,
    ready_cmd: Optional[str] = None,
    ready_timeout_s: Optional[int] = None,
    volumes: Optional[Mounts] = None,
    network: bool = False,
    egress: Union[str, Sequence[str], None] = None,
    expose: Optional[Sequence[int]] = None,
    registry_auth: Optional[RegistryAuthArg] = None,
    docker: bool = False,
) -> Call[Template]:
    body = _drop_none(
        {
            "name": name,
            "kernel": str(kernel),
            "rootfs": None if rootfs is None else str(rootfs),
            "initrd": None if initrd is None else str(initrd),
            "cmdline": cmdline,
            "vcpus": vcpus,
            "memory_mib": memory_mib,
            "start_cmd": start_cmd,
            "ready_cmd": ready_cmd,
            "ready_timeout_s": ready_timeout_s,
        }
    )
    if image is not None:
        body["image"] = image.to_json() if isinstance(image, ImageSource) else dict(image)
    if registry_auth is not None:
        if not body.get("image", {}).get("reference"):
            raise ConfigError("registry_auth: needs an image with a registry reference to pull")
        body["image"]["auth"] = registry_auth_json(registry_auth)
    if boot_snapshot:
        body["boot_snapshot"] = True
    if docker:
        body["docker"] = True
    if volumes:
        body["volumes"] = [v.to_json() if isinstance(v, Volume) else dict(v) for v in volumes]
    net = network_body(network, egress, expose)
    if net is not None:
        body["network"] = net
    # An image build and a boot snapshot take as long as they take.
    return Call("POST", "/templates", _template, json=body, timeout=None)


def list_templates() -> Call[List[Template]]:
    return Call(
        "GET",
        "/templates",
        lambda r: [Template.from_json(t) for t in r.json().get("templates", [])],
    )


def get_template(name: str) -> Call[Template]:
    return Call("GET", f"/templates/{seg(name)}", _template)


def delete_template(name: str) -> Call[None]:
    return Call("DELETE", f"/templates/{seg(name)}", _none)


# --- sandboxes ------------------------------------------------------------------------------


def create_body(
    template: Optional[str],
    snapshot: Optional[str],
    vcpus: Optional[int],
    memory_mib: Optional[int],
    ttl_s: Optional[int],
    idle_ttl_s: Optional[int],
    labels: Optional[Mapping[str, str]],
    metadata: Optional[Mapping[str, str]],
    env: Optional[Mapping[str, str]],
    cpu_limit: Optional[float],
    idempotency_key: Optional[str],
    deterministic: bool = False,
    volumes: Optional[Mounts] = None,
    gpu: Optional[str] = None,
    gpu_count: Optional[int] = None,
    gpu_wait_s: Optional[int] = None,
    network: bool = False,
    egress: Union[str, Sequence[str], None] = None,
    expose: Optional[Sequence[int]] = None,
) -> Dict[str, Any]:
    body = _drop_none(
        {
            "template": template,
            "snapshot": snapshot,
            "vcpus": vcpus,
            "memory_mib": memory_mib,
            "ttl_s": ttl_s,
            "idle_ttl_s": idle_ttl_s,
            "cpu_limit": cpu_limit,
            "idempotency_key": idempotency_key,
            "gpu": gpu,
            "gpu_count": gpu_count,
            "gpu_wait_s": gpu_wait_s,
        }
    )
    for key, value in (("labels", labels), ("metadata", metadata), ("env", env)):
        if value:
            body[key] = dict(value)
    if deterministic:
        body["deterministic"] = True
    if volumes:
        body["volumes"] = [v.to_json() if isinstance(v, Volume) else dict(v) for v in volumes]
    net = network_body(network, egress, expose)
    if net is not None:
        body["network"] = net
    return body


def network_body(
    network: bool,
    egress: Union[str, Sequence[str], None],
    expose: Optional[Sequence[int]] = None,
) -> Optional[Dict[str, Any]]:
    """``network`` of a create or template: ``egress`` (a policy string, or a list of
    ``CIDR|HOST[:PORT[-PORT]]``) and ``expose`` (guest TCP ports) imply one; ``network=True``
    takes the daemon's default egress."""
    if not network and egress is None and not expose:
        return None
    body: Dict[str, Any] = {}
    if isinstance(egress, str):
        body["egress"] = egress
    elif egress is not None:
        body["egress"] = {"allow": list(egress)}
    if expose:
        body["expose"] = [int(p) for p in expose]
    return body


def create_sandbox(body: Dict[str, Any]) -> Call[Sandbox]:
    return Call("POST", "/sandboxes", _sandbox, json=body, timeout=None)


def create_batch(count: int, body: Dict[str, Any]) -> Call[List[ItemResult]]:
    return Call("POST", "/sandboxes/batch", _items, json={**body, "count": count}, timeout=None)


def get_sandbox(sandbox: SandboxRef) -> Call[Sandbox]:
    return Call("GET", f"/sandboxes/{seg(sandbox_id(sandbox))}", _sandbox)


def list_page(
    ids: Optional[Sequence[SandboxRef]],
    labels: Optional[Mapping[str, str]],
    state: Optional[str],
    limit: Optional[int],
    page_token: Optional[str],
) -> Call[Page]:
    params = _ids_params(ids) + _labels_params(labels)
    if state is not None:
        params.append(("state", state))
    if limit is not None:
        params.append(("limit", str(limit)))
    if page_token is not None:
        params.append(("page_token", page_token))

    def parse(response: httpx.Response) -> Page:
        body = response.json()
        return Page(
            [Sandbox.from_json(s) for s in body.get("sandboxes", [])],
            body.get("next_page_token"),
        )

    return Call("GET", "/sandboxes", parse, params=params)


def delete_sandbox(sandbox: SandboxRef) -> Call[None]:
    return Call("DELETE", f"/sandboxes/{seg(sandbox_id(sandbox))}", _none, timeout=None)


def delete_sandboxes(
    ids: Optional[Sequence[SandboxRef]], labels: Optional[Mapping[str, str]]
) -> Call[List[str]]:
    params = _ids_params(ids) + _labels_params(labels)
    return Call(
        "DELETE",
        "/sandboxes",
        lambda r: list(r.json().get("deleted", [])),
        params=params,
        timeout=None,
    )


def keepalive(sandbox: SandboxRef, ttl_s: int) -> Call[Sandbox]:
    return Call(
        "POST", f"/sandboxes/{seg(sandbox_id(sandbox))}/keepalive", _sandbox, json={"ttl_s": ttl_s}
    )


def set_network(sandbox: SandboxRef, egress: Union[str, Sequence[str]]) -> Call[Sandbox]:
    return Call(
        "PATCH",
        f"/sandboxes/{seg(sandbox_id(sandbox))}/network",
        _sandbox,
        json=network_body(True, egress),
    )


def pause(sandbox: SandboxRef) -> Call[Sandbox]:
    return Call("POST", f"/sandboxes/{seg(sandbox_id(sandbox))}/pause", _sandbox)


def resume(sandbox: SandboxRef) -> Call[Sandbox]:
    return Call("POST", f"/sandboxes/{seg(sandbox_id(sandbox))}/resume", _sandbox)


def usage(sandbox: SandboxRef) -> Call[Usage]:
    return Call(
        "GET",
        f"/sandboxes/{seg(sandbox_id(sandbox))}/usage",
        lambda r: Usage.from_json(r.json()),
    )


# --- exec -----------------------------------------------------------------------------------


def exec_body(
    cmd: Command,
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    user: Optional[str],
    stdin: Union[str, bytes, None],
    stdin_open: bool,
    timeout_s: Optional[float],
    max_output_bytes: Optional[int],
) -> Dict[str, Any]:
    if isinstance(stdin, bytes):
        try:
            stdin = stdin.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                "stdin: the exec body carries stdin as text; for other bytes use "
                f"stream(..., stdin_open=True) and write_stdin ({e})"
            ) from e
    body = _drop_none(
        {
            "cmd": cmd if isinstance(cmd, str) else list(cmd),
            "cwd": cwd,
            "user": user,
            "stdin": stdin,
            "timeout_s": timeout_s,
            "max_output_bytes": max_output_bytes,
        }
    )
    if env:
        body["env"] = dict(env)
    if stdin_open:
        body["stdin_open"] = True
    return body


def docker_run_argv(
    image: str,
    cmd: Optional[Command],
    detach: bool,
    name: Optional[str],
    env: Optional[Mapping[str, str]],
    network: Optional[str],
    docker_args: Optional[Sequence[str]],
) -> List[str]:
    """The argv of ``docker run`` in the guest: ``--rm`` unless detached, then the flags, the
    image and the command (a string runs under the image's ``sh -c``). An argv goes to the
    exec as is, so nothing needs quoting."""
    if not image or image.startswith("-") or any(c.isspace() for c in image):
        raise ConfigError(f"image: {image!r} is not an image reference")
    argv = ["docker", "run", "--detach" if detach else "--rm"]
    if name is not None:
        argv += ["--name", name]
    for key, value in (env or {}).items():
        if not key or "=" in key:
            raise ConfigError(f"env: {key!r} is not a variable name")
        argv += ["--env", f"{key}={value}"]
    if network is not None:
        argv += ["--network", network]
    argv += list(docker_args or [])
    argv.append(image)
    if isinstance(cmd, str):
        argv += ["sh", "-c", cmd]
    elif cmd is not None:
        argv += list(cmd)
    return argv


def exec_timeout(timeout_s: Optional[float]) -> Optional[httpx.Timeout]:
    """An exec's answer comes when the process ends: wait for its timeout (plus the daemon's
    2 s to SIGKILL and some slack), or without limit when it has none."""
    if timeout_s is None:
        return httpx.Timeout(30.0, read=None)
    return httpx.Timeout(30.0, read=float(timeout_s) + 30.0)


def run(sandbox: SandboxRef, body: Dict[str, Any]) -> Call[ExecResult]:
    return Call(
        "POST",
        f"/sandboxes/{seg(sandbox_id(sandbox))}/exec",
        lambda r: ExecResult.from_json(r.json()),
        json=body,
        timeout=exec_timeout(body.get("timeout_s")),
    )


def stream_path(sandbox: SandboxRef) -> str:
    return f"/sandboxes/{seg(sandbox_id(sandbox))}/exec"


def stdin_call(sandbox: SandboxRef, pid: int, data: Union[str, bytes], close: bool) -> Call[None]:
    body: Dict[str, Any] = {}
    if isinstance(data, bytes):
        try:
            body["data"] = data.decode("utf-8")
        except UnicodeDecodeError:
            body["data"] = base64.b64encode(data).decode("ascii")
            body["encoding"] = "base64"
    elif data:
        body["data"] = data
    if close:
        body["close"] = True
    return Call(
        "POST", f"/sandboxes/{seg(sandbox_id(sandbox))}/processes/{seg(pid)}/stdin", _none, json=body
    )


def signal_call(sandbox: SandboxRef, pid: int, signal: Union[int, str], group: bool) -> Call[None]:
    body: Dict[str, Any] = {"signal": signal}
    if group:
        body["group"] = True
    return Call(
        "POST",
        f"/sandboxes/{seg(sandbox_id(sandbox))}/processes/{seg(pid)}/signal",
        _none,
        json=body,
    )


# --- files ----------------------------------------------------------------------------------


def files_path(sandbox: SandboxRef, suffix: str = "files") -> str:
    return f"/sandboxes/{seg(sandbox_id(sandbox))}/{suffix}"


def read_file(sandbox: SandboxRef, path: str) -> Call[bytes]:
    return Call("GET", files_path(sandbox), lambda r: r.content, params=[("path", path)])


def write_params(path: str, mode: Union[int, str, None], parents: bool) -> Params:
    params = [("path", path)]
    if mode is not None:
        params.append(("mode", format(mode, "o") if isinstance(mode, int) else mode))
    if parents:
        params.append(("parents", "true"))
    return params


def _whole(content: Any) -> Optional[bytes]:
    """Text or bytes as the bytes to send; None for a file object or an iterable."""
    if isinstance(content, str):
        return content.encode("utf-8")
    if isinstance(content, (bytes, bytearray, memoryview)):
        return bytes(content)
    return None


def _file_chunks(file: IO[bytes]) -> Iterator[bytes]:
    while True:
        chunk = file.read(CHUNK)
        if not chunk:
            return
        yield chunk


def upload_body(content: Upload) -> Any:
    """An upload as the sync client hands it to httpx: bytes, a file object read in
    CHUNK-sized pieces, or the caller's iterable as it is."""
    whole = _whole(content)
    if whole is not None:
        return whole
    if hasattr(content, "read"):
        return _file_chunks(content)  # type: ignore[arg-type]
    return content


async def _achunks(chunks: Iterable[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def aupload_body(content: AsyncUpload) -> Any:
    """An upload as the async client hands it to httpx, which streams only async iterables:
    bytes, the caller's async iterable, or a file object or iterable turned into one."""
    whole = _whole(content)
    if whole is not None:
        return whole
    if hasattr(content, "__aiter__"):
        return content
    if hasattr(content, "read"):
        return _achunks(_file_chunks(content))  # type: ignore[arg-type]
    return _achunks(content)  # type: ignore[arg-type]


def write_file(
    sandbox: SandboxRef, path: str, content: Any, mode: Union[int, str, None], parents: bool
) -> Call[Written]:
    return Call(
        "PUT",
        files_path(sandbox),
        _written,
        params=write_params(path, mode, parents),
        content=content,
        headers={"Content-Type": "application/octet-stream"},
        timeout=httpx.Timeout(30.0, read=None, write=None),
    )


def stat(sandbox: SandboxRef, path: str) -> Call[FileInfo]:
    return Call(
        "GET",
        files_path(sandbox, "files/stat"),
        lambda r: FileInfo.from_json(r.json()),
        params=[("path", path)],
    )


def list_dir(sandbox: SandboxRef, path: str) -> Call[List[FileInfo]]:
    return Call(
        "GET",
        files_path(sandbox, "files/list"),
        lambda r: [FileInfo.from_json(e) for e in r.json().get("entries", [])],
        params=[("path", path)],
    )


def remove(sandbox: SandboxRef, path: str, recursive: bool) -> Call[None]:
    params = [("path", path)]
    if recursive:
        params.append(("recursive", "true"))
    return Call("DELETE", files_path(sandbox), _none, params=params)


def download_tar(sandbox: SandboxRef, path: str) -> Call[bytes]:
    return Call(
        "GET",
        files_path(sandbox, "tar"),
        lambda r: r.content,
        params=[("path", path)],
        timeout=httpx.Timeout(30.0, read=None),
    )


def upload_tar(sandbox: SandboxRef, path: str, content: Any) -> Call[Written]:
    return Call(
        "PUT",
        files_path(sandbox, "tar"),
        _written,
        params=[("path", path)],
        content=content,
        headers={"Content-Type": "application/x-tar"},
        timeout=httpx.Timeout(30.0, read=None, write=None),
    )


# --- volumes --------------------------------------------------------------------------------


def volume_path(volume: VolumeRef, suffix: str = "") -> str:
    name = volume.name if isinstance(volume, VolumeInfo) else volume
    return f"/volumes/{seg(name)}{suffix}"


def _volume(response: httpx.Response) -> VolumeInfo:
    return VolumeInfo.from_json(response.json())


def create_volume(
    name: str, host_path: Optional[str], size_limit_mib: Optional[int] = None
) -> Call[VolumeInfo]:
    body: Dict[str, Any] = {"name": name}
    if host_path is not None:
        body["host_path"] = str(host_path)
    if size_limit_mib is not None:
        body["size_limit_mib"] = size_limit_mib
    return Call("POST", "/volumes", _volume, json=body)


def list_gpus() -> Call[List[Gpu]]:
    return Call("GET", "/gpus", lambda r: [Gpu.from_json(g) for g in r.json().get("gpus", [])])


def list_volumes() -> Call[List[VolumeInfo]]:
    return Call(
        "GET",
        "/volumes",
        lambda r: [VolumeInfo.from_json(v) for v in r.json().get("volumes", [])],
    )


def get_volume(volume: VolumeRef) -> Call[VolumeInfo]:
    return Call("GET", volume_path(volume), _volume)


def delete_volume(volume: VolumeRef) -> Call[None]:
    return Call("DELETE", volume_path(volume), _none)


def _is_listing(response: httpx.Response) -> bool:
    """GET /volumes/{name}/files answers a directory with a JSON listing, a file with bytes."""
    return response.headers.get("content-type", "").startswith("application/json")


def read_volume_file(volume: VolumeRef, path: str) -> Call[bytes]:
    where = volume_path(volume, "/files")

    def parse(response: httpx.Response) -> bytes:
        if _is_listing(response):
            raise IsADirectoryError(f"GET {where}: {path!r} is a directory (see list_volume)")
        return response.content

    return Call("GET", where, parse, params=[("path", path)])


def list_volume(volume: VolumeRef, path: str) -> Call[List[FileInfo]]:
    where = volume_path(volume, "/files")

    def parse(response: httpx.Response) -> List[FileInfo]:
        if not _is_listing(response):
            raise NotADirectoryError(f"GET {where}: {path!r} is a file (see read_volume_file)")
        return [FileInfo.from_json(e) for e in response.json().get("entries", [])]

    return Call("GET", where, parse, params=[("path", path)])


def write_volume_file(volume: VolumeRef, path: str, content: Any) -> Call[None]:
    return Call(
        "PUT",
        volume_path(volume, "/files"),
        _none,
        params=[("path", path)],
        content=content,
        headers={"Content-Type": "application/octet-stream"},
        timeout=httpx.Timeout(30.0, read=None, write=None),
    )


# --- snapshots, fork, reset -----------------------------------------------------------------


def take_snapshot(sandbox: SandboxRef, stop: bool, ttl_s: Optional[int]) -> Call[Snapshot]:
    body: Dict[str, Any] = {}
    if stop:
        body["stop"] = True
    if ttl_s is not None:
        body["ttl_s"] = ttl_s
    return Call(
        "POST",
        f"/sandboxes/{seg(sandbox_id(sandbox))}/snapshots",
        _snapshot,
        json=body,
        timeout=None,
    )


def list_snapshots(sandbox: Optional[SandboxRef]) -> Call[List[Snapshot]]:
    params = [] if sandbox is None else [("sandbox", sandbox_id(sandbox))]
    return Call(
        "GET",
        "/snapshots",
        lambda r: [Snapshot.from_json(s) for s in r.json().get("snapshots", [])],
        params=params,
    )


def get_snapshot(snapshot: Union[str, Snapshot]) -> Call[Snapshot]:
    sid = snapshot.id if isinstance(snapshot, Snapshot) else snapshot
    return Call("GET", f"/snapshots/{seg(sid)}", _snapshot)


def delete_snapshot(snapshot: Union[str, Snapshot]) -> Call[None]:
    sid = snapshot.id if isinstance(snapshot, Snapshot) else snapshot
    return Call("DELETE", f"/snapshots/{seg(sid)}", _none)


def export_snapshot(snapshot: Union[str, Snapshot]) -> Call[None]:
    sid = snapshot.id if isinstance(snapshot, Snapshot) else snapshot
    return Call("GET", f"/snapshots/{seg(sid)}/export", _none)


def import_snapshot(content: Any, size: int) -> Call[Snapshot]:
    return Call(
        "POST",
        "/snapshots/import",
        _snapshot,
        content=content,
        headers={"Content-Type": "application/x-tar", "Content-Length": str(size)},
        timeout=httpx.Timeout(30.0, read=None, write=None),
    )


def fork(
    sandbox: SandboxRef, count: int, ttl_s: Optional[int], labels: Optional[Mapping[str, str]]
) -> Call[List[ItemResult]]:
    body: Dict[str, Any] = {"count": count}
    if ttl_s is not None:
        body["ttl_s"] = ttl_s
    if labels:
        body["labels"] = dict(labels)
    return Call(
        "POST", f"/sandboxes/{seg(sandbox_id(sandbox))}/fork", _items, json=body, timeout=None
    )


def reset(sandbox: SandboxRef, snapshot: Union[str, Snapshot, None]) -> Call[Sandbox]:
    body: Optional[Dict[str, Any]] = None
    if snapshot is not None:
        body = {"snapshot": snapshot.id if isinstance(snapshot, Snapshot) else snapshot}
    return Call(
        "POST", f"/sandboxes/{seg(sandbox_id(sandbox))}/reset", _sandbox, json=body, timeout=None
    )


def parse_line(line: str) -> Dict[str, Any]:
    value = json.loads(line)
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {line!r}")
    return value
