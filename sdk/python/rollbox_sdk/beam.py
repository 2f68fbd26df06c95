"""Beam's names over rollbox, so a Beam program runs with its import line changed to
``from rollbox_sdk.beam import function, Volume, Sandbox``::

    @function(gpu="H100", volumes=[Volume(name="trajectories", mount_path="./data")])
    def update_policy(): ...

    env = Sandbox(cpu=1, memory=1024).create()
    snapshot_id = env.snapshot_memory()
    env2 = Sandbox().create_from_memory_snapshot(snapshot_id)

A ``Sandbox`` is a sandbox of a rollbox template (``template=``, else ``$ROLLBOX_TEMPLATE``,
else ``python``: Beam's images are rollbox templates, built with ``rollbox template build``).
``memory`` is in MiB, ``cpu`` in cores (a CPU-time limit), ``keep_warm_seconds`` its TTL.
Only these names are Beam's; the rest of rollbox is :mod:`rollbox_sdk`'s.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

from .client import Client
from .function import default_template, function
from .types import ExecResult, Volume

__all__ = ["Sandbox", "SandboxInstance", "SandboxProcess", "Volume", "function"]

#: A Beam sandbox's TTL when ``keep_warm_seconds`` is not given.
DEFAULT_TTL_S = 600


class SandboxProcess:
    """A command that ran in a sandbox: its exit code and output."""

    def __init__(self, result: ExecResult) -> None:
        self.result = result
        self.exit_code = result.exit_code

    def wait(self) -> int:
        """The exit code (-1 when a signal ended it)."""
        return self.exit_code if self.exit_code is not None else -1

    @property
    def stdout(self) -> str:
        return self.result.stdout

    @property
    def stderr(self) -> str:
        return self.result.stderr


class _Process:
    def __init__(self, instance: "SandboxInstance") -> None:
        self._instance = instance

    def exec(
        self,
        *args: str,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
    ) -> SandboxProcess:
        """Runs ``args`` (an argv) to its end."""
        instance = self._instance
        return SandboxProcess(
            instance.client.run(instance.sandbox_id, list(args), cwd=cwd, env=env)
        )


class SandboxInstance:
    """A running sandbox (Beam's ``SandboxInstance``)."""

    def __init__(self, client: Client, sandbox_id: str) -> None:
        self.client = client
        self.sandbox_id = sandbox_id
        self.process = _Process(self)

    def snapshot_memory(self) -> str:
        """A memory snapshot of the running sandbox (it keeps running): its id."""
        return self.client.snapshot(self.sandbox_id).id

    def terminate(self) -> bool:
        """Ends the sandbox."""
        self.client.delete_sandbox(self.sandbox_id)
        return True

    def __repr__(self) -> str:
        return f"SandboxInstance({self.sandbox_id!r})"


class Sandbox:
    """What a sandbox is made of (Beam's ``Sandbox``); :meth:`create` makes one."""

    def __init__(
        self,
        *,
        template: Optional[str] = None,
        cpu: Optional[float] = None,
        memory: Optional[int] = None,
        gpu: Optional[str] = None,
        gpu_count: Optional[int] = None,
        volumes: Sequence[Volume] = (),
        env: Optional[Dict[str, str]] = None,
        keep_warm_seconds: Optional[int] = None,
        client: Optional[Client] = None,
    ) -> None:
        self.template = template or default_template()
        self.cpu = cpu
        self.memory = memory
        self.gpu = gpu
        self.gpu_count = gpu_count
        self.volumes = list(volumes)
        self.env = dict(env or {})
        self.ttl_s = keep_warm_seconds or DEFAULT_TTL_S
        self._client = client

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client()
        return self._client

    def create(self) -> SandboxInstance:
        """Boots (or restores, with a template's boot snapshot) a sandbox."""
        sandbox = self.client.create_sandbox(
            self.template,
            memory_mib=self.memory,
            cpu_limit=self.cpu,
            gpu=self.gpu,
            gpu_count=self.gpu_count,
            volumes=self.volumes or None,
            env=self.env or None,
            ttl_s=self.ttl_s,
        )
        return SandboxInstance(self.client, sandbox.id)

    def create_from_memory_snapshot(self, snapshot_id: str) -> SandboxInstance:
        """A new sandbox restored from ``snapshot_id`` (of :meth:`SandboxInstance.snapshot_memory`):
        the memory, processes and files of the sandbox when it was taken."""
        sandbox = self.client.create_sandbox(
            snapshot=snapshot_id, ttl_s=self.ttl_s, env=self.env or None
        )
        return SandboxInstance(self.client, sandbox.id)

    def __repr__(self) -> str:
        fields: Dict[str, Any] = {"template": self.template, "memory": self.memory}
        return f"Sandbox({fields})"
