"""rollbox on Ray: sandboxes placed over every node of a Ray cluster that runs a daemon.

A Ray node with a ``rollbox serve`` advertises the custom resource ``rollbox_slots``
(``ray start --resources='{"rollbox_slots": 64}'``) and tells its workers where the daemon is
through its environment (``ROLLBOX_SOCKET`` or ``ROLLBOX_URL``, and ``ROLLBOX_API_KEY``). Or, in
the managed mode, ``ROLLBOX_MANAGED=1`` instead: the node's actor starts the daemon itself
(:class:`rollbox_sdk.managed.ManagedDaemon`: ``ROLLBOX_BIN``, ``ROLLBOX_SERVE_ARGS``, and
``--max-sandboxes`` from the node's ``rollbox_slots``), and the daemon ends with the actor.

* :class:`RollboxNode`: one actor per such node, holding that node's daemon client; it serves
  the control calls (info, create, fork, snapshot export and import, delete by labels, drain).
* :class:`SandboxPool`: one named, detached actor that every rollout worker shares
  (:func:`pool`). It places each create on the caller's own node when that node has the
  template or snapshot and a free slot, else Best-of-K among the nodes that hold it, else on
  a CPU-compatible node after copying the snapshot there; and it forks a group of ``n`` from
  one state over several nodes (one snapshot, imported once per node, restored there so
  copy-on-write sharing holds per node).
* :class:`Lease`: what a create returns, picklable. A caller on the sandbox's node talks to its
  daemon directly; any other goes through the node's actor. A lease whose node is gone raises
  :class:`SandboxLost`, never hangs.

Every sandbox is labelled with its pool and run (``rollbox.pool``, ``rollbox.run``):
``close()`` deletes them on every node, and the daemon's hard TTL covers a killed driver.
Needs ``ray`` (``pip install rollbox-sdk[ray]``).
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .client import Client
from .errors import Conflict, Overloaded, RollboxError, Unavailable
from .managed import ManagedDaemon
from .types import ExecResult, ItemResult, NodeInfo, Sandbox, Snapshot

SLOTS = "rollbox_slots"
"""The custom resource a Ray node with a rollbox daemon advertises (its slot count)."""

NAMESPACE = "rollbox"
"""The Ray namespace of the pools: any driver of the cluster finds a pool by name there."""

# The resource Ray gives its head node only.
HEAD_RESOURCE = "node:__internal_head__"

POOL_LABEL = "rollbox.pool"
RUN_LABEL = "rollbox.run"

# The errors by which Ray says an actor or its node is gone.
_GONE = (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError)


class SandboxLost(RollboxError):
    """The node a sandbox ran on is gone (its Ray node died or left the cluster)."""


class NoPlacement(RollboxError):
    """No live node has the template (or snapshot) and a free slot."""


def _here() -> str:
    return ray.get_runtime_context().get_node_id()


def _call(node: "NodeState", method: str, *args: Any, **kwargs: Any) -> Any:
    """One call to a node's actor; a dead node becomes :class:`SandboxLost`."""
    try:
        return ray.get(getattr(node.actor, method).remote(*args, **kwargs))
    except _GONE as e:
        node.alive = False
        raise SandboxLost(f"rollbox node {node.node_id} (Ray node {node.ray_node[:12]}) is gone: {e}") from e


class RollboxNode:
    """The daemon of one Ray node (an actor pinned to it; :class:`SandboxPool` starts them)."""

    def __init__(self) -> None:
        self._managed: Optional[ManagedDaemon] = None
        if os.environ.get("ROLLBOX_MANAGED") == "1" and not (
            os.environ.get("ROLLBOX_SOCKET") or os.environ.get("ROLLBOX_URL")
        ):
            here = _here()
            slots = next(
                (n["Resources"].get(SLOTS) for n in ray.nodes() if n["NodeID"] == here), None
            )
            self._managed = ManagedDaemon.from_env(slots=int(slots) if slots else None)
            self._client = self._managed.client()
        else:
            self._client = Client()

    def info(self) -> Dict[str, Any]:
        node = self._client.node()
        info: Dict[str, Any] = {"ray_node": _here(), "node": node.raw}
        if self._managed is not None:
            info["managed"] = {"socket": self._managed.socket, "pid": self._managed.pid}
        return info

    def add_template(self, name: str, kernel: str, kwargs: Dict[str, Any]) -> bool:
        """Registers the template here: whether it did (False: this node has one of that name)."""
        try:
            self._client.add_template(name, kernel, **kwargs)
        except Conflict:
            return False
        return True

    def shutdown(self) -> None:
        """Stops the daemon this actor started (managed mode); nothing otherwise."""
        if self._managed is not None:
            self._managed.stop()

    def create(self, template: Optional[str], snapshot: Optional[str], count: int, kwargs: Dict[str, Any]) -> List[Sandbox]:
        if count == 1:
            return [self._client.create_sandbox(template, snapshot=snapshot, **kwargs)]
        results = self._client.create_batch(count, template, snapshot=snapshot, **kwargs)
        return self._all_or_none(results, f"batch of {count}")

    def fork(self, sandbox: str, count: int, labels: Dict[str, str]) -> List[Sandbox]:
        return self._all_or_none(self._client.fork(sandbox, count, labels=labels), f"fork of {sandbox}")

    def _all_or_none(self, results: List[ItemResult], what: str) -> List[Sandbox]:
        """Every sandbox of a batch or fork, or none: the made ones go when one failed."""
        made = [r.sandbox for r in results if r.sandbox is not None]
        failed = [r.error for r in results if r.sandbox is None]
        if failed:
            if made:
                self._client.delete_sandboxes(ids=[s.id for s in made])
            raise RollboxError(f"{what}: {failed[0]}")
        return made

    def snapshot(self, sandbox: str) -> Snapshot:
        return self._client.snapshot(sandbox)

    def get_snapshot(self, snapshot: str) -> Snapshot:
        return self._client.get_snapshot(snapshot)

    def export(self, snapshot: str) -> bytes:
        with tempfile.TemporaryDirectory() as scratch:
            path = os.path.join(scratch, "snapshot.tar")
            self._client.export_snapshot(snapshot, path)
            with open(path, "rb") as archive:
                return archive.read()

    def import_(self, archive: bytes) -> Snapshot:
        with tempfile.TemporaryDirectory() as scratch:
            path = os.path.join(scratch, "snapshot.tar")
            with open(path, "wb") as out:
                out.write(archive)
            return self._client.import_snapshot(path)

    def import_and_create(
        self, archive: bytes, snapshot: str, count: int, kwargs: Dict[str, Any]
    ) -> List[Sandbox]:
        self.import_(archive)
        return self.create(None, snapshot, count, kwargs)

    def run(self, sandbox: str, cmd: Any, kwargs: Dict[str, Any]) -> ExecResult:
        return self._client.run(sandbox, cmd, **kwargs)

    def reset(self, sandbox: str, snapshot: Optional[str]) -> Sandbox:
        return self._client.reset(sandbox, snapshot=snapshot)

    def delete(self, sandbox: str) -> None:
        self._client.delete_sandbox(sandbox)

    def delete_labels(self, labels: Dict[str, str]) -> List[str]:
        return self._client.delete_sandboxes(labels=labels)

    def drain(self, deadline_s: Optional[int]) -> NodeInfo:
        return self._client.drain(deadline_s)

    def undrain(self) -> NodeInfo:
        return self._client.undrain()


# RollboxNode as an actor class, wrapped once (each actor is pinned by options()).
_NODE_ACTOR = ray.remote(num_cpus=0, max_concurrency=32)(RollboxNode)


@dataclass
class NodeState:
    """What the pool knows of one node: its actor, and its daemon's last `GET /node`."""

    ray_node: str
    actor: Any
    info: Dict[str, Any]
    alive: bool = True

    @property
    def node_id(self) -> str:
        return self.info.get("node_id", "?")

    def ready(self) -> bool:
        return self.alive and self.info.get("status") == "ready"

    def free(self) -> int:
        slots = self.info.get("slots") or {}
        total = slots.get("total")
        if total is None:
            return 1 << 30
        return int(total) - int(slots.get("used", 0)) - int(slots.get("pending", 0))

    def count(self, delta: int) -> None:
        """Counts sandboxes placed here (or ended) since the last GET /node."""
        slots = self.info.setdefault("slots", {})
        slots["used"] = max(0, int(slots.get("used", 0)) + delta)

    def load(self) -> float:
        slots = self.info.get("slots") or {}
        total = slots.get("total") or 0
        return (slots.get("used", 0) + slots.get("pending", 0)) / total if total else 0.0

    def has_template(self, name: str) -> bool:
        return any(t.get("name") == name for t in self.info.get("templates", []))

    def has_snapshot(self, snapshot: str) -> bool:
        return snapshot in self.info.get("snapshots", [])


@dataclass(frozen=True)
class Lease:
    """A sandbox the pool placed: picklable, usable from any worker of the cluster."""

    sandbox: Sandbox
    node_id: str
    ray_node: str
    pool: str
    actor: Any

    @property
    def id(self) -> str:
        return self.sandbox.id

    def local(self) -> bool:
        """Whether this process runs on the sandbox's node (and so reaches its daemon)."""
        has_daemon = bool(os.environ.get("ROLLBOX_SOCKET") or os.environ.get("ROLLBOX_URL"))
        return has_daemon and _here() == self.ray_node

    def run(self, cmd: Any, **kwargs: Any) -> ExecResult:
        """Run a command in the sandbox: through the local daemon when co-located, else
        through its node's actor. A lost node raises :class:`SandboxLost`."""
        if self.local():
            with Client() as client:
                return client.run(self.id, cmd, **kwargs)
        return _call(self._node(), "run", self.id, cmd, kwargs)

    def reset(self, snapshot: Optional[str] = None) -> Sandbox:
        """Same sandbox, fresh state (the snapshot it came from, or ``snapshot``)."""
        if self.local():
            with Client() as client:
                return client.reset(self.id, snapshot=snapshot)
        return _call(self._node(), "reset", self.id, snapshot)

    def _node(self) -> "NodeState":
        return NodeState(self.ray_node, self.actor, {"node_id": self.node_id})


def _affinity(ray_node: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=ray_node, soft=False)


class SandboxPool:
    """Places sandboxes over the cluster's rollbox nodes (use it through :func:`pool`)."""

    def __init__(
        self,
        name: str,
        run: Optional[str] = None,
        best_of: int = 2,
        ttl_s: int = 3600,
        refresh_s: float = 1.0,
    ) -> None:
        self._name = name
        self._run = run or uuid.uuid4().hex[:12]
        self._best_of = best_of
        self._ttl_s = ttl_s
        # How old the nodes' GET /node may be when a create places (the pool counts its own
        # creates and 429s in between).
        self._refresh_s = refresh_s
        self._refreshed = 0.0
        self._nodes: Dict[str, NodeState] = {}
        self._lock = threading.Lock()
        self.refresh()

    # --- nodes ----------------------------------------------------------------------------

    def refresh(self) -> List[Dict[str, Any]]:
        """Finds nodes with ``rollbox_slots`` (an actor on each new one), forgets dead ones,
        and reads every live node's ``GET /node``."""
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(SLOTS)}
        with self._lock:
            for ray_node in alive - set(self._nodes):
                # One node actor per Ray node, whatever the pool: named, so every pool shares it
                # (a managed node's actor runs the node's one daemon).
                actor = _NODE_ACTOR.options(
                    name=f"rollbox-node-{ray_node}",
                    namespace=NAMESPACE,
                    lifetime="detached",
                    get_if_exists=True,
                    scheduling_strategy=_affinity(ray_node),
                ).remote()
                self._nodes[ray_node] = NodeState(ray_node, actor, {})
            for ray_node, node in self._nodes.items():
                if ray_node not in alive:
                    node.alive = False
            nodes = [n for n in self._nodes.values() if n.alive]
        refs = [(n, n.actor.info.remote()) for n in nodes]
        for node, ref in refs:
            try:
                node.info = ray.get(ref)["node"]
            except _GONE:
                node.alive = False
        self._refreshed = time.monotonic()
        return self.nodes()

    def _fresh(self) -> None:
        if time.monotonic() - self._refreshed > self._refresh_s:
            self.refresh()

    def nodes(self) -> List[Dict[str, Any]]:
        """Each node as the pool sees it: Ray node, rollbox node id, alive, its GET /node."""
        return [
            {"ray_node": n.ray_node, "node_id": n.node_id, "alive": n.alive, "info": n.info}
            for n in self._nodes.values()
        ]

    def _node(self, ray_node: str) -> NodeState:
        node = self._nodes.get(ray_node)
        if node is None or not node.alive:
            raise SandboxLost(f"Ray node {ray_node[:12]} has no live rollbox node in pool {self._name}")
        return node

    def _labels(self, labels: Optional[Mapping[str, str]]) -> Dict[str, str]:
        return {**(labels or {}), POOL_LABEL: self._name, RUN_LABEL: self._run}

    def _lease(self, node: NodeState, sandbox: Sandbox) -> Lease:
        return Lease(sandbox, node.node_id, node.ray_node, self._name, node.actor)

    # --- placement ------------------------------------------------------------------------

    def _order(self, holders: List[NodeState], near: Optional[str]) -> List[NodeState]:
        """The caller's node first when it holds it; then Best-of-K by load, then the rest."""
        free = [n for n in holders if n.ready() and n.free() > 0]
        first = [n for n in free if n.ray_node == near]
        rest = [n for n in free if n.ray_node != near]
        sample = random.sample(rest, min(self._best_of, len(rest)))
        sample.sort(key=NodeState.load)
        return first + sample + [n for n in rest if n not in sample]

    def create(
        self,
        template: Optional[str] = None,
        *,
        snapshot: Optional[str] = None,
        near: Optional[str] = None,
        labels: Optional[Mapping[str, str]] = None,
        **kwargs: Any,
    ) -> Lease:
        """A sandbox of ``template`` (a boot or its boot snapshot) or from ``snapshot``,
        placed near ``near`` (the caller's Ray node id) when it can be. A node that answers
        429 is skipped; when every node is full this raises :class:`Overloaded`."""
        kwargs = {"ttl_s": self._ttl_s, **kwargs, "labels": self._labels(labels)}
        self._fresh()
        live = [n for n in self._nodes.values() if n.alive]
        holders = [n for n in live if (n.has_snapshot(snapshot) if snapshot else n.has_template(template or ""))]
        candidates = self._order(holders, near)
        if not candidates and snapshot:
            candidates = self._copy_snapshot(snapshot, holders, live, near)
        if not candidates and any(n.ready() for n in holders):
            raise Overloaded(
                f"every node with {snapshot or template} is full; retry later", status=429, retry_after=1.0
            )
        if not candidates:
            raise NoPlacement(
                f"no live ready node has {'snapshot ' + snapshot if snapshot else 'template ' + str(template)} and a free slot"
            )
        last: Optional[Exception] = None
        for node in candidates:
            try:
                (sandbox,) = _call(node, "create", template, snapshot, 1, kwargs)
                node.count(1)
                return self._lease(node, sandbox)
            except (Overloaded, Unavailable, SandboxLost) as e:
                # Full, draining or gone: not a candidate again until the next refresh.
                node.count(node.free())
                last = e
        raise Overloaded(f"every node that could take it is full, draining or gone: {last}", status=429)

    def _copy_snapshot(
        self, snapshot: str, holders: List[NodeState], live: List[NodeState], near: Optional[str]
    ) -> List[NodeState]:
        """Copies the snapshot from a node that has it to the best CPU-compatible node that
        has its template: that node, or none."""
        source = next((n for n in holders if n.alive), None)
        if source is None:
            return []
        template = _call(source, "get_snapshot", snapshot).template
        cpu = source.info.get("cpu", {}).get("id")
        targets = [
            n
            for n in live
            if n is not source and n.info.get("cpu", {}).get("id") == cpu and n.has_template(template)
        ]
        ordered = self._order(targets, near)
        if not ordered:
            return []
        target = ordered[0]
        _call(target, "import_", _call(source, "export", snapshot))
        target.info.setdefault("snapshots", []).append(snapshot)
        return [target]

    def fork_group(self, parent: Lease, n: int, *, labels: Optional[Mapping[str, str]] = None) -> List[Lease]:
        """``n`` sandboxes from the parent's current state: one fork on its node when that
        node has ``n`` free slots; else one snapshot, the parent's node filled first, and the
        rest restored on other nodes after one import each, all nodes at once."""
        self.refresh()
        home = self._node(parent.ray_node)
        tagged = self._labels(labels)
        if home.free() >= n:
            made = _call(home, "fork", parent.id, n, tagged)
            home.count(len(made))
            return [self._lease(home, s) for s in made]
        cpu = home.info.get("cpu", {}).get("id")
        snap = _call(home, "snapshot", parent.id)
        kwargs = {"ttl_s": self._ttl_s, "labels": tagged}
        # (node, count) per node: the parent's first, then the freest compatible ones.
        shares = [(home, max(0, min(home.free(), n)))]
        others = sorted(
            (
                o
                for o in self._nodes.values()
                if o is not home and o.ready() and o.info.get("cpu", {}).get("id") == cpu and o.has_template(snap.template)
            ),
            key=lambda o: -o.free(),
        )
        for other in others:
            want = min(n - sum(c for _, c in shares), other.free())
            if want > 0:
                shares.append((other, want))
        if sum(c for _, c in shares) < n:
            raise Overloaded(f"fork group of {n}: fewer slots free in the cluster", status=429)
        # One export, handed by reference to every importing node; the restores run at once.
        archive = home.actor.export.remote(snap.id) if len(shares) > 1 else None
        pending = [
            (node, node.actor.create.remote(None, snap.id, count, kwargs))
            if node is home
            else (node, node.actor.import_and_create.remote(archive, snap.id, count, kwargs))
            for node, count in shares
            if count
        ]
        leases: List[Lease] = []
        failure: Optional[BaseException] = None
        for node, ref in pending:
            try:
                made = ray.get(ref)
                node.count(len(made))
                leases += [self._lease(node, s) for s in made]
            except _GONE as e:
                node.alive = False
                failure = failure or SandboxLost(f"rollbox node {node.node_id} is gone: {e}")
            except BaseException as e:  # noqa: BLE001 - every restore is awaited before raising
                failure = failure or e
        if failure is not None:
            for lease in leases:
                self.release(lease)
            raise failure
        return leases

    # --- ends -----------------------------------------------------------------------------

    def release(self, lease: Lease) -> None:
        """Deletes a lease's sandbox (one whose node is gone is gone with it)."""
        node = self._nodes.get(lease.ray_node)
        if node is not None and node.alive:
            try:
                _call(node, "delete", lease.id)
                node.count(-1)
            except SandboxLost:
                pass

    def add_template(self, name: str, kernel: str, **kwargs: Any) -> List[str]:
        """Registers a template on every live node that has none of that name (a managed
        node's daemon starts empty): the node ids it was added on."""
        self.refresh()
        added = []
        for node in [n for n in self._nodes.values() if n.alive and not n.has_template(name)]:
            if _call(node, "add_template", name, kernel, kwargs):
                added.append(node.node_id)
        self._refreshed = 0.0
        return added

    def drain(self, ray_node: str, deadline_s: Optional[int] = None) -> None:
        """Drains one node: it takes no new placements (nor creates from anyone)."""
        node = self._node(ray_node)
        node.info = _call(node, "drain", deadline_s).raw
        self._refreshed = 0.0

    def undrain(self, ray_node: str) -> None:
        node = self._node(ray_node)
        node.info = _call(node, "undrain").raw
        self._refreshed = 0.0

    def close(self) -> List[str]:
        """Deletes every sandbox of this pool on every live node; the ids it ended."""
        ended: List[str] = []
        for node in list(self._nodes.values()):
            if node.alive:
                try:
                    ended += _call(node, "delete_labels", {POOL_LABEL: self._name})
                except SandboxLost:
                    pass
        self._refreshed = 0.0
        return ended


# SandboxPool as an actor class, wrapped once.
_POOL_ACTOR = ray.remote(num_cpus=0, max_concurrency=64)(SandboxPool)


def pool(name: str = "default", *, run: Optional[str] = None, best_of: int = 2, ttl_s: int = 3600) -> Any:
    """The named, detached :class:`SandboxPool` actor ``rollbox-pool-NAME`` (namespace
    ``rollbox``, on the head node), made by the first caller and shared by every later one, other drivers
    included (``ray.get(pool().create.remote("guest", near=...))``). It outlives the driver
    that made it: a new driver closes a killed one's pool by name. ``ttl_s`` is every
    sandbox's hard TTL unless a create gives one."""
    return _POOL_ACTOR.options(
        name=f"rollbox-pool-{name}",
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        # On the head node: a worker node that leaves must not take the pool with it.
        resources={HEAD_RESOURCE: 0.001},
    ).remote(name, run, best_of, ttl_s)


__all__ = ["SLOTS", "Lease", "NoPlacement", "RollboxNode", "SandboxLost", "SandboxPool", "pool"]
