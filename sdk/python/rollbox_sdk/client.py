# Generated from aio.py by sdk/python/tools/unasync.py: do not edit. Edit aio.py, then run
# `python3 sdk/python/tools/unasync.py` (scripts/check-sdk-sync.sh fails while they differ).
"""The synchronous client."""

from __future__ import annotations

import os
from typing import (
    Any,
    Iterator,
    Dict,
    List,
    Mapping,
    Optional,
    Sequence,
    TypeVar,
    Union,
)

import httpx

from . import _core
from ._core import (
    CHUNK,
    Upload,
    Call,
    Command,
    ImageSource,
    Mounts,
    Page,
    RegistryAuthArg,
    SandboxRef,
    VolumeRef,
)
from .errors import StreamError, TransportError
from .types import (
    Gpu,
    ExecEvent,
    ExecResult,
    FileInfo,
    ItemResult,
    NodeInfo,
    Sandbox,
    Snapshot,
    Template,
    Usage,
    VolumeInfo,
    Written,
)

T = TypeVar("T")

class Client:
    """A client of `rollbox serve`'s native API.

    Args:
        url: ``http://127.0.0.1:PORT`` of a daemon serving loopback TCP.
        socket: the daemon's Unix socket.
        api_key: the bearer key.
        timeout: seconds for ordinary calls. Creates, forks, resets, snapshots and execs wait
            as long as they take (an exec with ``timeout_s`` waits that plus 30 s).

    Without ``url`` or ``socket``: ``$ROLLBOX_URL``, else ``$ROLLBOX_SOCKET``, else
    ``/run/rollbox/rollbox.sock``. Without ``api_key``: ``$ROLLBOX_API_KEY``.

    Every method raises a :class:`~rollbox_sdk.errors.ApiError` subclass when the daemon
    refuses (BadRequest with ``.field``, NotFound, Conflict, Overloaded with
    ``.retry_after``...), and :class:`~rollbox_sdk.errors.TransportError` when it cannot be
    reached. Use it as a context manager, or call :meth:`close`.

    Example::

        with Client() as rb:
            sb = rb.create_sandbox("python", ttl_s=600)
            print(rb.run(sb, ["python3", "-c", "print(6*7)"]).stdout)
            rb.delete_sandbox(sb)
    """

    def __init__(
        self,
        url: Optional[str] = None,
        *,
        socket: Optional[str] = None,
        api_key: Optional[str] = None,
        timeout: float = 60.0,
    ) -> None:
        self.config = _core.resolve_config(url, socket, api_key, timeout)
        transport = (
            httpx.HTTPTransport(uds=self.config.socket) if self.config.socket else None
        )
        self._http = httpx.Client(
            base_url=self.config.base_url,
            transport=transport,
            headers={"Authorization": f"Bearer {self.config.api_key}"},
            timeout=timeout,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, call: Call[T]) -> T:
        extra: Dict[str, Any] = {}
        if call.timeout != "default":
            extra["timeout"] = call.timeout
        try:
            response = self._http.request(
                call.method,
                call.path,
                params=tuple(call.params) or None,
                json=call.json,
                content=call.content,
                headers=call.headers or None,
                **extra,
            )
        except httpx.TransportError as e:
            raise TransportError(f"{call.method} {call.path}: {e!r}") from e
        _core.raise_for(response, call.method, call.path)
        return call.parse(response)

    def _stream_bytes(self, call: Call[Any], chunk_size: int) -> Iterator[bytes]:
        try:
            with self._http.stream(
                call.method, call.path, params=tuple(call.params), timeout=httpx.Timeout(30.0, read=None)
            ) as response:
                if not response.is_success:
                    response.read()
                    _core.raise_for(response, call.method, call.path)
                for chunk in response.iter_bytes(chunk_size):
                    yield chunk
        except httpx.TransportError as e:
            raise TransportError(f"{call.method} {call.path}: {e!r}") from e

    # --- daemon ---------------------------------------------------------------------------

    def healthz(self) -> Dict[str, Any]:
        """``{"status": "ok"}`` when the daemon answers (and the key is right)."""
        return self._send(_core.healthz())

    def metrics(self) -> str:
        """The Prometheus text of GET /metrics."""
        return self._send(_core.metrics())

    def node(self) -> NodeInfo:
        """GET /node: the daemon as a node (slots, memory, CPU fingerprint, templates,
        snapshots); needs an admin key."""
        return self._send(_core.node())

    def drain(self, deadline_s: Optional[int] = None) -> NodeInfo:
        """Take no new sandboxes (creates get :class:`Unavailable`); with ``deadline_s``,
        end what is still live then."""
        return self._send(_core.drain(deadline_s))

    def undrain(self) -> NodeInfo:
        """Take new sandboxes again."""
        return self._send(_core.undrain())

    # --- templates ------------------------------------------------------------------------

    def add_template(
        self,
        name: str,
        kernel: str,
        *,
        rootfs: Optional[str] = None,
        image: Union[ImageSource, Mapping[str, Any], None] = None,
        boot_snapshot: bool = False,
        initrd: Optional[str] = None,
        cmdline: Optional[str] = None,
        vcpus: Optional[int] = None,
        memory_mib: Optional[int] = None,
        start_cmd: Optional[str] = None,
        ready_cmd: Optional[str] = None,
        ready_timeout_s: Optional[int] = None,
        volumes: Optional[Mounts] = None,
        network: bool = False,
        egress: Union[str, Sequence[str], None] = None,
        expose: Optional[Sequence[int]] = None,
        registry_auth: Optional[RegistryAuthArg] = None,
        docker: bool = False,
    ) -> Template:
        """Register a template from files on the daemon's host, or build its rootfs from an
        OCI/Docker ``image``. With ``boot_snapshot`` the daemon boots it once and keeps a
        snapshot that creates restore. ``start_cmd`` is started in the background after a
        boot (before the boot snapshot), and ``ready_cmd`` runs until it exits 0 (at most
        ``ready_timeout_s``, default 300). ``volumes`` are mounted in every sandbox of it
        that names none (its boot snapshot has them, so those creates are restores), and
        ``network``/``egress`` (as on :meth:`create_sandbox`) give every sandbox of it a
        network unless its create names another egress (``expose``: ports every sandbox of
        it exposes, each on host ports of its own, unless its create names others).
        ``registry_auth`` (a
        :class:`RegistryAuth`, or a ``(username, password)`` pair) authenticates ``image``'s
        pull for this build only (else the daemon's ``--registry-auth`` file, else anonymous);
        a registry that refuses is :class:`Forbidden` naming it. With ``docker`` the agent
        starts dockerd after each boot, before ``start_cmd`` and the boot snapshot, so every
        sandbox of it has Docker ready (within ``ready_timeout_s``; the rootfs needs dockerd).
        Returns once all of it is done; on an error nothing of the template is left."""
        return self._send(
            _core.add_template(
                name,
                kernel,
                rootfs,
                image,
                boot_snapshot,
                initrd,
                cmdline,
                vcpus,
                memory_mib,
                start_cmd,
                ready_cmd,
                ready_timeout_s,
                volumes,
                network,
                egress,
                expose,
                registry_auth,
                docker,
            )
        )

    def list_templates(self) -> List[Template]:
        return self._send(_core.list_templates())

    def get_template(self, name: str) -> Template:
        return self._send(_core.get_template(name))

    def delete_template(self, name: str) -> None:
        """Remove a template (its running sandboxes keep running)."""
        self._send(_core.delete_template(name))

    # --- sandboxes ------------------------------------------------------------------------

    def create_sandbox(
        self,
        template: Optional[str] = None,
        *,
        snapshot: Union[str, Snapshot, None] = None,
        vcpus: Optional[int] = None,
        memory_mib: Optional[int] = None,
        ttl_s: Optional[int] = None,
        idle_ttl_s: Optional[int] = None,
        labels: Optional[Mapping[str, str]] = None,
        metadata: Optional[Mapping[str, str]] = None,
        env: Optional[Mapping[str, str]] = None,
        cpu_limit: Optional[float] = None,
        idempotency_key: Optional[str] = None,
        deterministic: bool = False,
        volumes: Optional[Mounts] = None,
        gpu: Optional[str] = None,
        gpu_count: Optional[int] = None,
        gpu_wait_s: Optional[int] = None,
        network: bool = False,
        egress: Union[str, Sequence[str], None] = None,
        expose: Optional[Sequence[int]] = None,
    ) -> Sandbox:
        """Create a running sandbox: boot ``template``, or restore ``snapshot`` (exactly one).

        ``ttl_s`` is the hard TTL (required unless the daemon has --default-ttl),
        ``idle_ttl_s`` ends it after that long without an API call on it, ``env`` is the
        environment of every exec, ``cpu_limit`` caps its CPU in cores. A repeated
        ``idempotency_key`` returns the first sandbox. ``deterministic`` makes a machine
        without RDRAND/RDSEED whose restores (this create, every reset) put back the
        snapshot's guest time and generation exactly: every episode starts identical. It
        restores only snapshots of deterministic sandboxes. ``volumes`` mounts named volumes
        (``[Volume("data", "/data")]``); a restore gets its snapshot's and takes none. ``gpu``
        passes ``gpu_count`` (default 1) of the node's GPUs through (a name such as ``"H100"``,
        ``"any"``, or a PCI address; see :meth:`gpus`), waiting up to ``gpu_wait_s`` for busy
        ones (else Conflict at once): such a sandbox boots, and cannot be paused, snapshotted,
        forked or reset. ``network=True`` gives it a network (``eth0``, NAT through the host)
        with the daemon's default egress; ``egress`` (``"none"``, ``"all"``, a list of
        ``CIDR|HOST[:PORT[-PORT]]``, or those comma-separated) implies one. Its snapshots, forks
        and resets keep a network (each clone its own address); a restore of a snapshot with
        a network gets one with that snapshot's egress unless ``egress`` says otherwise.
        ``expose`` (guest TCP ports; implies a network) puts each on a host port of its own:
        ``sandbox.network.host(port)`` gives ``(host_address, host_port)``. They are on
        127.0.0.1, and reachable from other hosts only on the daemon's ``--publish`` address.
        """
        snap = snapshot.id if isinstance(snapshot, Snapshot) else snapshot
        return self._send(
            _core.create_sandbox(
                _core.create_body(
                    template, snap, vcpus, memory_mib, ttl_s, idle_ttl_s, labels, metadata,
                    env, cpu_limit, idempotency_key, deterministic, volumes, gpu, gpu_count,
                    gpu_wait_s, network, egress, expose,
                )
            )
        )

    def create_batch(
        self,
        count: int,
        template: Optional[str] = None,
        *,
        snapshot: Union[str, Snapshot, None] = None,
        vcpus: Optional[int] = None,
        memory_mib: Optional[int] = None,
        ttl_s: Optional[int] = None,
        idle_ttl_s: Optional[int] = None,
        labels: Optional[Mapping[str, str]] = None,
        metadata: Optional[Mapping[str, str]] = None,
        env: Optional[Mapping[str, str]] = None,
        cpu_limit: Optional[float] = None,
        idempotency_key: Optional[str] = None,
        deterministic: bool = False,
        volumes: Optional[Mounts] = None,
        gpu: Optional[str] = None,
        gpu_count: Optional[int] = None,
        gpu_wait_s: Optional[int] = None,
        network: bool = False,
        egress: Union[str, Sequence[str], None] = None,
        expose: Optional[Sequence[int]] = None,
    ) -> List[ItemResult]:
        """Create ``count`` sandboxes of one spec; each succeeds or fails on its own (one
        :class:`ItemResult` per item, in order). Raises Overloaded when fewer than ``count``
        places are free among the pending creates (then nothing was created)."""
        snap = snapshot.id if isinstance(snapshot, Snapshot) else snapshot
        return self._send(
            _core.create_batch(
                count,
                _core.create_body(
                    template, snap, vcpus, memory_mib, ttl_s, idle_ttl_s, labels, metadata,
                    env, cpu_limit, idempotency_key, deterministic, volumes, gpu, gpu_count,
                    gpu_wait_s, network, egress, expose,
                ),
            )
        )

    def get_sandbox(self, sandbox: SandboxRef) -> Sandbox:
        """One sandbox, in any state (counts as activity for its idle TTL)."""
        return self._send(_core.get_sandbox(sandbox))

    def list_sandboxes_page(
        self,
        *,
        ids: Optional[Sequence[SandboxRef]] = None,
        labels: Optional[Mapping[str, str]] = None,
        state: Optional[str] = None,
        limit: Optional[int] = None,
        page_token: Optional[str] = None,
    ) -> Page:
        """One page of sandboxes, oldest first (see :meth:`list_sandboxes`)."""
        return self._send(_core.list_page(ids, labels, state, limit, page_token))

    def list_sandboxes(
        self,
        *,
        ids: Optional[Sequence[SandboxRef]] = None,
        labels: Optional[Mapping[str, str]] = None,
        state: Optional[str] = None,
        page_size: Optional[int] = None,
    ) -> Iterator[Sandbox]:
        """Every matching sandbox, oldest first, fetched a page at a time as you iterate.

        Without ``state`` (or ``ids``) only live ones (creating, running, paused); every
        label given must match."""
        token: Optional[str] = None
        while True:
            page = self.list_sandboxes_page(
                ids=ids, labels=labels, state=state, limit=page_size, page_token=token
            )
            for sandbox in page.sandboxes:
                yield sandbox
            token = page.next_page_token
            if not token:
                return

    def delete_sandbox(self, sandbox: SandboxRef) -> None:
        """End a sandbox. Idempotent: one already gone (or never made) is success."""
        self._send(_core.delete_sandbox(sandbox))

    def delete_sandboxes(
        self,
        *,
        ids: Optional[Sequence[SandboxRef]] = None,
        labels: Optional[Mapping[str, str]] = None,
    ) -> List[str]:
        """End every live sandbox named by ``ids`` and/or ``labels`` (both must match when
        both are given); returns the ids it ended. Naming nothing is a BadRequest."""
        return self._send(_core.delete_sandboxes(ids, labels))

    def keepalive(self, sandbox: SandboxRef, ttl_s: int) -> Sandbox:
        """Set the hard TTL to ``ttl_s`` seconds from now."""
        return self._send(_core.keepalive(sandbox, ttl_s))

    def set_network(self, sandbox: SandboxRef, egress: Union[str, Sequence[str]]) -> Sandbox:
        """Change a sandbox's egress policy (as ``egress=`` on create): new connections meet
        it at once, established ones keep flowing."""
        return self._send(_core.set_network(sandbox, egress))

    def pause(self, sandbox: SandboxRef) -> Sandbox:
        """Pause its vCPUs (pausing a paused sandbox is success)."""
        return self._send(_core.pause(sandbox))

    def resume(self, sandbox: SandboxRef) -> Sandbox:
        """Resume its vCPUs (resuming a running sandbox is success)."""
        return self._send(_core.resume(sandbox))

    def usage(self, sandbox: SandboxRef) -> Usage:
        """Running seconds (paused time not counted), vCPU and memory seconds, CPU time."""
        return self._send(_core.usage(sandbox))

    # --- exec -----------------------------------------------------------------------------

    def run(
        self,
        sandbox: SandboxRef,
        cmd: Command,
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Union[str, bytes, None] = None,
        timeout_s: Optional[float] = None,
        max_output_bytes: Optional[int] = None,
    ) -> ExecResult:
        """Run a command to its end; a non-zero exit is a result, not an exception.

        ``cmd`` is an argv or a string for ``/bin/sh -c``. At ``timeout_s`` the process group
        gets SIGTERM, then SIGKILL 2 s later (``timed_out`` set)."""
        body = _core.exec_body(cmd, env, cwd, user, stdin, False, timeout_s, max_output_bytes)
        return self._send(_core.run(sandbox, body))

    def docker_run(
        self,
        sandbox: SandboxRef,
        image: str,
        cmd: Optional[Command] = None,
        *,
        detach: bool = False,
        name: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        network: Optional[str] = None,
        docker_args: Optional[Sequence[str]] = None,
        timeout_s: Optional[float] = None,
        max_output_bytes: Optional[int] = None,
    ) -> ExecResult:
        """``docker run`` in the sandbox (a ``docker: true`` template's, or any with dockerd
        running), through :meth:`run`: ``--rm``, or ``--detach`` (the result's stdout is the
        container id); ``env`` is the container's; ``docker_args`` go before the image; a
        string ``cmd`` runs under the image's ``sh -c``. The image is pulled by the guest's
        dockerd, so the sandbox's egress policy applies to the pull. A failed pull or a
        non-zero exit is a result, not an exception."""
        argv = _core.docker_run_argv(image, cmd, detach, name, env, network, docker_args)
        body = _core.exec_body(argv, None, None, None, None, False, timeout_s, max_output_bytes)
        return self._send(_core.run(sandbox, body))

    def stream(
        self,
        sandbox: SandboxRef,
        cmd: Command,
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Union[str, bytes, None] = None,
        stdin_open: bool = False,
        timeout_s: Optional[float] = None,
        max_output_bytes: Optional[int] = None,
    ) -> "ExecStream":
        """Start a command and stream its events (see :class:`ExecStream`).

        With ``stdin_open`` its stdin stays open for :meth:`ExecStream.write_stdin`."""
        body = _core.exec_body(
            cmd, env, cwd, user, stdin, stdin_open, timeout_s, max_output_bytes
        )
        return ExecStream(self, sandbox, body)

    def write_stdin(
        self, sandbox: SandboxRef, pid: int, data: Union[str, bytes], *, close: bool = False
    ) -> None:
        """Write to the stdin of a process a streaming exec started with ``stdin_open``."""
        self._send(_core.stdin_call(sandbox, pid, data, close))

    def close_stdin(self, sandbox: SandboxRef, pid: int) -> None:
        self._send(_core.stdin_call(sandbox, pid, b"", True))

    def signal(
        self, sandbox: SandboxRef, pid: int, signal: Union[int, str], *, group: bool = False
    ) -> None:
        """Signal a process a streaming exec started: 1-64 or a name (TERM, SIGKILL...);
        ``group`` signals its process group."""
        self._send(_core.signal_call(sandbox, pid, signal, group))

    # --- files ----------------------------------------------------------------------------

    def read_file(self, sandbox: SandboxRef, path: str) -> bytes:
        """A file's bytes (``path`` absolute in the sandbox)."""
        return self._send(_core.read_file(sandbox, path))

    def iter_file(
        self, sandbox: SandboxRef, path: str, *, chunk_size: int = CHUNK
    ) -> Iterator[bytes]:
        """A file's bytes, streamed in chunks (read it to the end, or close the iterator)."""
        return self._stream_bytes(_core.read_file(sandbox, path), chunk_size)

    def write_file(
        self,
        sandbox: SandboxRef,
        path: str,
        content: Upload,
        *,
        mode: Union[int, str, None] = None,
        parents: bool = False,
    ) -> Written:
        """Upload one file, replaced atomically; a file object or iterable is streamed.

        ``mode``: permission bits (``0o755`` or ``"755"``; default those of the file replaced,
        else 644). ``parents`` creates missing parent directories."""
        body = _core.upload_body(content)
        return self._send(_core.write_file(sandbox, path, body, mode, parents))

    def stat(self, sandbox: SandboxRef, path: str) -> FileInfo:
        """A file's metadata (a final symlink is followed)."""
        return self._send(_core.stat(sandbox, path))

    def list_dir(self, sandbox: SandboxRef, path: str) -> List[FileInfo]:
        """A directory's entries, sorted by name."""
        return self._send(_core.list_dir(sandbox, path))

    def remove(self, sandbox: SandboxRef, path: str, *, recursive: bool = False) -> None:
        """Remove a file, symlink or directory (a non-empty one only with ``recursive``)."""
        self._send(_core.remove(sandbox, path, recursive))

    def download_tar(self, sandbox: SandboxRef, path: str) -> bytes:
        """A tar archive of a directory's contents (or of one file)."""
        return self._send(_core.download_tar(sandbox, path))

    def iter_tar(
        self, sandbox: SandboxRef, path: str, *, chunk_size: int = CHUNK
    ) -> Iterator[bytes]:
        """:meth:`download_tar`, streamed in chunks."""
        return self._stream_bytes(_core.download_tar(sandbox, path), chunk_size)

    def upload_tar(self, sandbox: SandboxRef, path: str, tar: Upload) -> Written:
        """Unpack a tar archive into directory ``path`` (created if missing)."""
        return self._send(_core.upload_tar(sandbox, path, _core.upload_body(tar)))

    # --- volumes --------------------------------------------------------------------------

    def gpus(self) -> List[Gpu]:
        """The node's GPUs (PCI devices bound to vfio-pci); ``holder`` is shown to admin
        keys."""
        return self._send(_core.list_gpus())

    def create_volume(
        self,
        name: str,
        host_path: Optional[str] = None,
        *,
        size_limit_mib: Optional[int] = None,
    ) -> VolumeInfo:
        """Make a named shared volume (1-32 of a-z 0-9 _ . -, starting with a letter or
        digit). Its files live under the daemon's state directory, or in ``host_path``, an
        existing directory on the daemon's host (admin keys only). ``size_limit_mib`` makes it
        an ext4 file system of that size. Conflict when the name is taken."""
        return self._send(_core.create_volume(name, host_path, size_limit_mib))

    def volumes(self) -> List[VolumeInfo]:
        """The volumes this key sees, by name."""
        return self._send(_core.list_volumes())

    def volume(self, name: VolumeRef) -> VolumeInfo:
        return self._send(_core.get_volume(name))

    def delete_volume(self, name: VolumeRef) -> None:
        """Remove a volume: Conflict while a live sandbox mounts it. One under the state
        directory loses its files; a ``host_path`` directory is left as it is."""
        self._send(_core.delete_volume(name))

    def read_volume_file(self, name: VolumeRef, path: str) -> bytes:
        """A file's bytes (``path`` relative to the volume's root; a leading ``/`` is the
        root). Raises IsADirectoryError for a directory."""
        return self._send(_core.read_volume_file(name, path))

    def list_volume(self, name: VolumeRef, path: str = "/") -> List[FileInfo]:
        """A directory's entries, sorted by name (their ``path`` from the volume's root).
        Raises NotADirectoryError for a file."""
        return self._send(_core.list_volume(name, path))

    def write_volume_file(self, name: VolumeRef, path: str, data: bytes) -> None:
        """Write a file into the volume, making missing parent directories."""
        self._send(_core.write_volume_file(name, path, bytes(data)))

    # --- snapshots, fork, reset -----------------------------------------------------------

    def snapshot(
        self, sandbox: SandboxRef, *, stop: bool = False, ttl_s: Optional[int] = None
    ) -> Snapshot:
        """Take a memory snapshot. The sandbox keeps running, or ends with ``stop``.
        ``ttl_s`` removes the snapshot that long after, unless a live sandbox came from it."""
        return self._send(_core.take_snapshot(sandbox, stop, ttl_s))

    def list_snapshots(self, *, sandbox: Optional[SandboxRef] = None) -> List[Snapshot]:
        """Snapshots, oldest first; only those of ``sandbox`` when given."""
        return self._send(_core.list_snapshots(sandbox))

    def get_snapshot(self, snapshot: Union[str, Snapshot]) -> Snapshot:
        return self._send(_core.get_snapshot(snapshot))

    def delete_snapshot(self, snapshot: Union[str, Snapshot]) -> None:
        """Delete a snapshot (one already gone is success; a template's boot snapshot is a
        Conflict)."""
        self._send(_core.delete_snapshot(snapshot))

    def export_snapshot(
        self, snapshot: Union[str, Snapshot], path: Union[str, "os.PathLike[str]"]
    ) -> int:
        """Write the snapshot as an archive (a tar; memory and disk sparse) at ``path``, for
        :meth:`import_snapshot` on another node; returns its size in bytes. ``path`` appears
        only once the archive is whole (a cut download raises and leaves no file)."""
        target = os.fspath(path)
        partial = os.path.join(os.path.dirname(target), "." + os.path.basename(target) + ".partial")
        written = 0
        try:
            with open(partial, "wb") as out:
                for chunk in self._stream_bytes(_core.export_snapshot(snapshot), 1 << 20):
                    out.write(chunk)
                    written += len(chunk)
            os.replace(partial, target)
        except BaseException:
            if os.path.exists(partial):
                os.unlink(partial)
            raise
        return written

    def import_snapshot(self, path: Union[str, "os.PathLike[str]"]) -> Snapshot:
        """Import an archive :meth:`export_snapshot` wrote on another node; the snapshot keeps
        its id. This node needs the CPU fingerprint, template and volumes it was taken with
        (else :class:`Conflict` saying which); importing one that is here already returns it."""
        size = os.path.getsize(path)
        with open(path, "rb") as archive:
            body = _core.upload_body(archive)
            return self._send(_core.import_snapshot(body, size))

    def fork(
        self,
        sandbox: SandboxRef,
        count: int,
        *,
        ttl_s: Optional[int] = None,
        labels: Optional[Mapping[str, str]] = None,
    ) -> List[ItemResult]:
        """Fork a running sandbox into ``count`` (1-64) new ones from a fresh snapshot of it.
        Each succeeds or fails on its own; their ``metadata["forked_from"]`` names the
        parent."""
        return self._send(_core.fork(sandbox, count, ttl_s, labels))

    def reset(
        self, sandbox: SandboxRef, *, snapshot: Union[str, Snapshot, None] = None
    ) -> Sandbox:
        """Same id, fresh state: restore ``snapshot`` (default: the one it was created or
        last reset from; a sandbox that came from none boots afresh)."""
        return self._send(_core.reset(sandbox, snapshot))


class ExecStream:
    """A streaming exec: iterate it for :class:`ExecEvent` s (``started``, ``stdout``,
    ``stderr``, then ``exit``); ``seq`` runs from 0 without gaps.

    An ``error`` line, a gap in ``seq`` or a body cut short raises
    :class:`~rollbox_sdk.errors.StreamError`. :attr:`pid` is known once it is open.

    Example::

        with rb.stream(sb, ["cat"], stdin_open=True) as proc:
            proc.write_stdin(b"hello\\n")
            proc.close_stdin()
            for event in proc:
                print(event.type, event.data)
    """

    def __init__(self, client: Client, sandbox: SandboxRef, body: Dict[str, Any]) -> None:
        self._client = client
        self.sandbox_id = _core.sandbox_id(sandbox)
        self._path = _core.stream_path(sandbox)
        self._body = body
        self._next_seq = 0
        self._pending: List[ExecEvent] = []
        self._context: Any = None
        self._closed = False
        self.exit: Optional[ExecEvent] = None
        self.pid: int = 0
        self._start()

    def _start(self) -> "ExecStream":
        self._context = self._client._http.stream(
            "POST",
            self._path,
            params={"stream": "true"},
            json=self._body,
            timeout=_core.exec_timeout(self._body.get("timeout_s")),
        )
        try:
            self._response = self._context.__enter__()
        except httpx.TransportError as e:
            self._closed = True
            raise TransportError(f"POST {self._path}: {e!r}") from e
        if not self._response.is_success:
            try:
                self._response.read()
                _core.raise_for(self._response, "POST", self._path)
            finally:
                self.close()
        self._lines = self._response.iter_lines()
        first = self._read()
        if first is None or first.type != "started":
            self.close()
            raise StreamError(f"POST {self._path}: the stream did not start with `started`")
        self.pid = first.pid or 0
        self._pending.append(first)
        return self

    def _read(self) -> Optional[ExecEvent]:
        try:
            for line in self._lines:
                if line.strip():
                    event = ExecEvent.from_json(_core.parse_line(line))
                    if event.seq != self._next_seq:
                        raise StreamError(
                            f"exec stream of {self.sandbox_id}: seq {event.seq}, "
                            f"expected {self._next_seq}"
                        )
                    self._next_seq += 1
                    return event
        except httpx.HTTPError as e:
            raise StreamError(f"exec stream of {self.sandbox_id} broke off: {e!r}") from e
        return None

    def __iter__(self) -> Iterator[ExecEvent]:
        if self._context is None:
            self._start()
        while True:
            if self._pending:
                event = self._pending.pop(0)
            elif self.exit is not None:
                return
            else:
                read = self._read()
                if read is None:
                    self.close()
                    raise StreamError(
                        f"exec stream of {self.sandbox_id} ended before its exit line"
                    )
                event = read
            if event.type == "error":
                self.close()
                raise StreamError(f"exec in {self.sandbox_id} broke off: {event.message}")
            if event.type == "exit":
                self.exit = event
                self.close()
            yield event
            if event.type == "exit":
                return

    def wait(self) -> ExecResult:
        """Read to the end: the output gathered from the events not yet read, and how it
        ended."""
        out: List[bytes] = []
        err: List[bytes] = []
        for event in self:
            if event.type == "stdout":
                out.append(event.data)
            elif event.type == "stderr":
                err.append(event.data)
        if self.exit is None or self.exit.exit is None:
            raise StreamError(f"exec stream of {self.sandbox_id} has no exit line")
        info = self.exit.exit
        return ExecResult(
            exit_code=info.exit_code,
            signal=info.signal,
            timed_out=info.timed_out,
            oom=info.oom,
            truncated=info.truncated,
            duration_ms=info.duration_ms,
            stdout_bytes=b"".join(out),
            stderr_bytes=b"".join(err),
            raw=self.exit.raw,
        )

    def write_stdin(self, data: Union[str, bytes]) -> None:
        """Write to its stdin (needs ``stdin_open=True``)."""
        self._client.write_stdin(self.sandbox_id, self.pid, data)

    def close_stdin(self) -> None:
        self._client.close_stdin(self.sandbox_id, self.pid)

    def signal(self, signal: Union[int, str], *, group: bool = False) -> None:
        self._client.signal(self.sandbox_id, self.pid, signal, group=group)

    def close(self) -> None:
        """Stop reading (the process keeps running until it ends or is signalled)."""
        if not self._closed and self._context is not None:
            self._closed = True
            self._context.__exit__(None, None, None)

    def __enter__(self) -> "ExecStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
