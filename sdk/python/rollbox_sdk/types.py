"""The daemon's objects as typed dataclasses (docs/api/openapi.yaml's schemas).

Each has ``raw``: the JSON object as received, so fields newer than this SDK are not lost.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

__all__ = [
    "Template",
    "Sandbox",
    "Usage",
    "Snapshot",
    "FileInfo",
    "ExitInfo",
    "ExecResult",
    "ExecEvent",
    "ItemResult",
    "NodeInfo",
    "Written",
    "Volume",
    "VolumeInfo",
    "decode_data",
]

STATES = ("creating", "running", "paused", "exited", "failed", "deleted", "expired")


def decode_data(text: Optional[str], encoding: Optional[str]) -> bytes:
    """Bytes from an answer's text field (``utf-8`` text, or ``base64``)."""
    if text is None:
        return b""
    if encoding == "base64":
        return base64.b64decode(text)
    return text.encode("utf-8")


def _str_map(value: Any) -> Dict[str, str]:
    return dict(value) if isinstance(value, dict) else {}


@dataclass
class Volume:
    """A volume mount: the named volume at ``mount_path`` (absolute) in the sandbox,
    read-only with ``readonly``. Pass a list as ``volumes=`` to a create; a Sandbox's and a
    Snapshot's ``volumes`` are these too."""

    name: str
    mount_path: str
    readonly: bool = False

    def to_json(self) -> Dict[str, Any]:
        return {"name": self.name, "mount_path": self.mount_path, "readonly": self.readonly}

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Volume":
        return cls(
            name=data["name"],
            mount_path=data["mount_path"],
            readonly=bool(data.get("readonly", False)),
        )


def _volumes(value: Any) -> List[Volume]:
    return [Volume.from_json(v) for v in value] if isinstance(value, list) else []


@dataclass
class Gpu:
    """A GPU of the node: a PCI device bound to vfio-pci."""

    bdf: str
    """Its PCI address, DDDD:BB:DD.F."""
    name: str
    vendor: str
    device: str
    iommu_group: int
    holder: Optional[str]
    """The sandbox holding it (shown to admin keys; None otherwise, and when free)."""

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Gpu":
        return cls(
            bdf=data["bdf"],
            name=data.get("name", ""),
            vendor=data.get("vendor", ""),
            device=data.get("device", ""),
            iommu_group=int(data.get("iommu_group", 0)),
            holder=data.get("holder"),
        )


@dataclass
class VolumeInfo:
    """A named shared volume (virtio-fs) as the daemon shows it."""

    name: str
    host_path: str
    """Where its files are on the daemon's host."""
    created_at_ms: int
    tenant: Optional[str]
    """The tenant whose key made it (None for an admin key's)."""
    mounted_by: List[str]
    """The live sandboxes that mount it, sorted."""
    size_limit_mib: Optional[int] = None
    """Its size limit (an ext4 file system of that size), or None."""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "VolumeInfo":
        return cls(
            name=data["name"],
            host_path=data.get("host_path", ""),
            created_at_ms=data.get("created_at_ms", 0),
            tenant=data.get("tenant"),
            mounted_by=list(data.get("mounted_by") or []),
            size_limit_mib=data.get("size_limit_mib"),
            raw=data,
        )


@dataclass
class Template:
    """A registered template: what a sandbox boots."""

    name: str
    kernel: str
    rootfs: Optional[str]
    initrd: Optional[str]
    cmdline: str
    vcpus: int
    memory_mib: int
    created_at_ms: int
    image: Optional[str] = None
    """The image it was built from (REFERENCE@DIGEST), when the daemon built it."""
    boot_snapshot: Optional[str] = None
    """The snapshot that creates of its shape restore."""
    start_cmd: Optional[str] = None
    """Started in the background after a boot."""
    ready_cmd: Optional[str] = None
    """Run until it exits 0 before a create returns."""
    ready_timeout_s: Optional[int] = None
    volumes: List["Volume"] = field(default_factory=list)
    """Volumes every sandbox of it mounts unless its create names others."""
    docker: bool = False
    """dockerd is started after each boot (before the boot snapshot)."""
    base_rootfs: Optional[str] = None
    """The read-only base its rootfs stacks on: layers shared with images built before."""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Template":
        return cls(
            name=data["name"],
            kernel=data["kernel"],
            rootfs=data.get("rootfs"),
            initrd=data.get("initrd"),
            cmdline=data.get("cmdline", ""),
            vcpus=data["vcpus"],
            memory_mib=data["memory_mib"],
            created_at_ms=data.get("created_at_ms", 0),
            image=data.get("image"),
            boot_snapshot=data.get("boot_snapshot"),
            start_cmd=data.get("start_cmd"),
            ready_cmd=data.get("ready_cmd"),
            ready_timeout_s=data.get("ready_timeout_s"),
            volumes=_volumes(data.get("volumes")),
            docker=bool(data.get("docker", False)),
            base_rootfs=data.get("base_rootfs"),
            raw=data,
        )


@dataclass
class ExposedPort:
    """A guest port exposed on the host: connect to ``host_address:host_port``."""

    port: int
    host_address: str
    host_port: int


@dataclass
class Network:
    """A sandbox's network: ``eth0`` at ``address`` on a host tap, NAT through the host."""

    egress: str
    """none, all, or the allow-list (CIDR|HOST[:PORT[-PORT]],...)."""
    address: str
    gateway: str
    prefix_len: int
    mac: str
    tap: str
    dns: Optional[str] = None
    ports: List[ExposedPort] = field(default_factory=list)
    """Its exposed ports."""

    def host(self, port: int) -> Tuple[str, int]:
        """``(host_address, host_port)`` where guest TCP ``port`` is exposed."""
        for p in self.ports:
            if p.port == port:
                return (p.host_address, p.host_port)
        raise KeyError(f"port {port} is not exposed (exposed: {[p.port for p in self.ports]})")

    @classmethod
    def from_json(cls, data: Optional[Dict[str, Any]]) -> Optional["Network"]:
        if not data:
            return None
        return cls(
            egress=data.get("egress", ""),
            address=data.get("address", ""),
            gateway=data.get("gateway", ""),
            prefix_len=data.get("prefix_len", 0),
            mac=data.get("mac", ""),
            tap=data.get("tap", ""),
            dns=data.get("dns"),
            ports=[
                ExposedPort(p["port"], p["host_address"], p["host_port"])
                for p in data.get("ports") or []
            ],
        )


@dataclass
class Sandbox:
    """A sandbox (one microVM) as the daemon shows it."""

    id: str
    template: str
    state: str
    """creating, running, paused, exited, failed, deleted or expired."""
    vcpus: int
    memory_mib: int
    labels: Dict[str, str]
    metadata: Dict[str, str]
    idempotency_key: Optional[str]
    created_at_ms: int
    expires_at_ms: int
    idle_ttl_s: Optional[int]
    last_active_at_ms: int
    pid: Optional[int]
    pid_start_time: Optional[int]
    dir: str
    ended_at_ms: Optional[int]
    end_reason: Optional[str]
    env: Dict[str, str]
    cpu_limit: Optional[float]
    deterministic: bool = False
    """No RDRAND/RDSEED; restores (create, reset) put back the snapshot's time exactly."""
    volumes: List[Volume] = field(default_factory=list)
    """The volumes it mounts (forks, resets and restores keep them)."""
    gpus: List[str] = field(default_factory=list)
    """The PCI addresses of the GPUs it holds."""
    network: Optional[Network] = None
    """Its network, if it has one."""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_live(self) -> bool:
        """Whether it may still run (creating, running or paused)."""
        return self.state in ("creating", "running", "paused")

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Sandbox":
        return cls(
            id=data["id"],
            template=data.get("template", ""),
            state=data["state"],
            vcpus=data.get("vcpus", 0),
            memory_mib=data.get("memory_mib", 0),
            labels=_str_map(data.get("labels")),
            metadata=_str_map(data.get("metadata")),
            idempotency_key=data.get("idempotency_key"),
            created_at_ms=data.get("created_at_ms", 0),
            expires_at_ms=data.get("expires_at_ms", 0),
            idle_ttl_s=data.get("idle_ttl_s"),
            last_active_at_ms=data.get("last_active_at_ms", 0),
            pid=data.get("pid"),
            pid_start_time=data.get("pid_start_time"),
            dir=data.get("dir", ""),
            ended_at_ms=data.get("ended_at_ms"),
            end_reason=data.get("end_reason"),
            env=_str_map(data.get("env")),
            cpu_limit=data.get("cpu_limit"),
            deterministic=bool(data.get("deterministic", False)),
            volumes=_volumes(data.get("volumes")),
            gpus=list(data.get("gpus") or []),
            network=Network.from_json(data.get("network")),
            raw=data,
        )


@dataclass
class Usage:
    """What a sandbox used: running seconds (paused time not counted), rounded up."""

    sandbox: str
    template: str
    state: str
    vcpus: int
    memory_mib: int
    running_s: int
    vcpu_seconds: int
    memory_mib_seconds: int
    cpu_seconds: float
    ended_at_ms: Optional[int]
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Usage":
        return cls(
            sandbox=data["sandbox"],
            template=data.get("template", ""),
            state=data.get("state", ""),
            vcpus=data.get("vcpus", 0),
            memory_mib=data.get("memory_mib", 0),
            running_s=data.get("running_s", 0),
            vcpu_seconds=data.get("vcpu_seconds", 0),
            memory_mib_seconds=data.get("memory_mib_seconds", 0),
            cpu_seconds=float(data.get("cpu_seconds", 0.0)),
            ended_at_ms=data.get("ended_at_ms"),
            raw=data,
        )


@dataclass
class NodeInfo:
    """GET /node: the daemon as one node of a fleet. ``slots`` has ``total`` (None: no
    ``--max-sandboxes``), ``used`` and ``pending``; ``memory_mib`` has ``budget``,
    ``committed`` and ``host_available``; ``cpu`` has ``vendor``, ``family``, ``model``,
    ``stepping`` and ``id`` (snapshots move between nodes of equal id)."""

    node_id: str
    version: str
    status: str
    drain_deadline_ms: Optional[int]
    slots: Dict[str, Any]
    memory_mib: Dict[str, Any]
    cpu: Dict[str, Any]
    templates: List[Dict[str, Any]]
    snapshots: List[str]
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "NodeInfo":
        return cls(
            node_id=data["node_id"],
            version=data.get("version", ""),
            status=data.get("status", ""),
            drain_deadline_ms=data.get("drain_deadline_ms"),
            slots=dict(data.get("slots") or {}),
            memory_mib=dict(data.get("memory_mib") or {}),
            cpu=dict(data.get("cpu") or {}),
            templates=list(data.get("templates") or []),
            snapshots=list(data.get("snapshots") or []),
            raw=data,
        )


@dataclass
class Snapshot:
    """A memory snapshot of a sandbox (Full: it needs nothing of its parent)."""

    id: str
    sandbox: str
    parent: Optional[str]
    template: str
    vcpus: int
    memory_mib: int
    dir: str
    created_at_ms: int
    expires_at_ms: Optional[int]
    deterministic: bool = False
    """Taken of a deterministic sandbox (deterministic sandboxes restore only these)."""
    volumes: List[Volume] = field(default_factory=list)
    """Its sandbox's volumes, which a create from it mounts."""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Snapshot":
        return cls(
            id=data["id"],
            sandbox=data.get("sandbox", ""),
            parent=data.get("parent"),
            template=data.get("template", ""),
            vcpus=data.get("vcpus", 0),
            memory_mib=data.get("memory_mib", 0),
            dir=data.get("dir", ""),
            created_at_ms=data.get("created_at_ms", 0),
            expires_at_ms=data.get("expires_at_ms"),
            deterministic=bool(data.get("deterministic", False)),
            volumes=_volumes(data.get("volumes")),
            raw=data,
        )


@dataclass
class FileInfo:
    """A file in a sandbox or a volume (``kind``: file, dir, symlink or other)."""

    name: str
    path: str
    kind: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    link_target: Optional[str]
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_dir(self) -> bool:
        return self.kind == "dir"

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "FileInfo":
        return cls(
            name=data.get("name", ""),
            path=data.get("path", ""),
            kind=data.get("kind", "other"),
            size=data.get("size", 0),
            mode=data.get("mode", 0),
            uid=data.get("uid", 0),
            gid=data.get("gid", 0),
            mtime_ns=data.get("mtime_ns", 0),
            link_target=data.get("link_target"),
            raw=data,
        )


@dataclass
class ExitInfo:
    """How a process ended."""

    exit_code: Optional[int]
    signal: Optional[int]
    timed_out: bool
    oom: bool
    truncated: bool
    """Output over max_output_bytes was dropped."""
    duration_ms: int

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "ExitInfo":
        return cls(
            exit_code=data.get("exit_code"),
            signal=data.get("signal"),
            timed_out=bool(data.get("timed_out", False)),
            oom=bool(data.get("oom", False)),
            truncated=bool(data.get("truncated", False)),
            duration_ms=data.get("duration_ms", 0),
        )


@dataclass
class ExecResult(ExitInfo):
    """A finished exec: how it ended and its output (``stdout``/``stderr`` as text)."""

    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        """Exit code 0 (not signalled, not timed out)."""
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "ExecResult":
        info = ExitInfo.from_json(data)
        return cls(
            exit_code=info.exit_code,
            signal=info.signal,
            timed_out=info.timed_out,
            oom=info.oom,
            truncated=info.truncated,
            duration_ms=info.duration_ms,
            stdout_bytes=decode_data(data.get("stdout"), data.get("stdout_encoding")),
            stderr_bytes=decode_data(data.get("stderr"), data.get("stderr_encoding")),
            raw=data,
        )


@dataclass
class ExecEvent:
    """One line of a streaming exec.

    ``type`` is ``started`` (``pid`` set), ``stdout``/``stderr`` (``data``), ``exit``
    (``exit`` set) or ``error`` (``message``). ``seq`` counts from 0.
    """

    seq: int
    type: str
    pid: Optional[int] = None
    data: bytes = b""
    message: Optional[str] = None
    exit: Optional[ExitInfo] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "ExecEvent":
        kind = data["type"]
        return cls(
            seq=data["seq"],
            type=kind,
            pid=data.get("pid"),
            data=decode_data(data.get("data"), data.get("encoding")),
            message=data.get("message"),
            exit=ExitInfo.from_json(data) if kind == "exit" else None,
            raw=data,
        )


@dataclass
class ItemResult:
    """One item of a batch create or a fork: a sandbox, or why that one failed."""

    sandbox: Optional[Sandbox]
    error: Optional[str]

    @property
    def ok(self) -> bool:
        return self.sandbox is not None

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "ItemResult":
        sandbox = data.get("sandbox")
        return cls(
            sandbox=Sandbox.from_json(sandbox) if sandbox else None,
            error=data.get("error"),
        )


@dataclass
class Written:
    """An upload's answer: where it went and how many bytes the daemon received."""

    path: str
    bytes: int


def items(data: Dict[str, Any]) -> List[ItemResult]:
    return [ItemResult.from_json(item) for item in data.get("results", [])]
