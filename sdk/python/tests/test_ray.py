"""rollbox_sdk.ray on a Ray cluster of this host: a head and three worker nodes
(ray.cluster_utils.Cluster), each worker with ``rollbox_slots: 8`` and its own daemon
(rollbox/tests/python_sdk.rs starts three, each with ``--max-sandboxes 8``; their sockets are
ROLLBOX_RAY_SOCKETS). Never `ray stop` here: it would stop every Ray node of the host.
Collected only where ``ray`` imports (scripts/ray-venv.sh; conftest.py leaves it out else)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Dict, Iterator, List

import pytest

import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollbox_sdk import Client, Overloaded
from rollbox_sdk.ray import POOL_LABEL, SLOTS, SandboxLost, pool

pytestmark = pytest.mark.ray

SOCKETS = [s for s in os.environ.get("ROLLBOX_RAY_SOCKETS", "").split(":") if s]
OBJECT_STORE = 80 << 20


@pytest.fixture(scope="module")
def cluster() -> Iterator[Dict[str, str]]:
    """The cluster; maps each daemon's node id to its Ray node id."""
    if len(SOCKETS) != 3:
        pytest.skip("no daemons: run it through rollbox/tests/python_sdk.rs")
    key = os.environ["ROLLBOX_API_KEY"]
    for socket in SOCKETS:
        with Client(socket=socket, api_key=key) as client:
            client.add_template(
                "guest",
                os.environ["ROLLBOX_SDK_KERNEL"],
                cmdline=os.environ.get("ROLLBOX_SDK_CMDLINE", ""),
                memory_mib=32,
            )
    head = {"num_cpus": 1, "object_store_memory": OBJECT_STORE, "include_dashboard": False}
    made = Cluster(initialize_head=True, head_node_args=head)
    handles = []
    for socket in SOCKETS:
        handles.append(
            made.add_node(
                num_cpus=2,
                resources={SLOTS: 8},
                object_store_memory=OBJECT_STORE,
                env_vars={"ROLLBOX_SOCKET": socket, "ROLLBOX_API_KEY": key},
            )
        )
    ray.init(address=made.address, logging_level="ERROR", log_to_driver=False)
    made.wait_for_nodes()
    by_socket = {}
    for socket in SOCKETS:
        with Client(socket=socket, api_key=key) as client:
            by_socket[socket] = client.node().node_id
    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"] and n["Resources"].get(SLOTS)}
    global HANDLES
    HANDLES = dict(zip([by_socket[s] for s in SOCKETS], handles))
    try:
        yield {"nodes": nodes, "by_socket": by_socket, "cluster": made}  # type: ignore[misc]
    finally:
        ray.shutdown()
        made.shutdown()


HANDLES: Dict[str, object] = {}


def live(socket: str, label: str) -> List[str]:
    with Client(socket=socket) as client:
        return [s.id for s in client.list_sandboxes(labels={POOL_LABEL: label})]


@ray.remote(num_cpus=0)
def near_create(p, template: str):
    """On a pinned node: a create near it, then an exec through its local daemon."""
    here = ray.get_runtime_context().get_node_id()
    lease = ray.get(p.create.remote(template, near=here))
    result = lease.run(["echo", "local"])
    return lease, here, lease.local(), result.stdout


def test_discovery_spread_backpressure_locality_and_close(cluster) -> None:
    p = pool("spread")
    try:
        nodes = ray.get(p.refresh.remote())
        assert sorted(n["node_id"] for n in nodes) == ["node-a", "node-b", "node-c"]
        ray_nodes = {n["node_id"]: n["ray_node"] for n in nodes}
        # Each node actor sits on its own Ray node and holds that node's daemon.
        for socket, node_id in cluster["by_socket"].items():
            env = cluster["nodes"][ray_nodes[node_id]]
            assert env["Alive"]

        leases = [ray.get(p.create.remote("guest")) for _ in range(24)]
        per_node: Dict[str, int] = {}
        for lease in leases:
            per_node[lease.node_id] = per_node.get(lease.node_id, 0) + 1
            assert lease.id.endswith("-" + lease.node_id)
        assert per_node == {"node-a": 8, "node-b": 8, "node-c": 8}
        with pytest.raises(Overloaded):
            ray.get(p.create.remote("guest"))
        # An exec through a node actor from the driver (not on a rollbox node).
        assert leases[0].run(["echo", "hi"]).stdout == "hi\n"
        ended = ray.get(p.close.remote())
        assert sorted(ended) == sorted(lease.id for lease in leases)
        for socket in SOCKETS:
            assert live(socket, "spread") == []

        # A task pinned to node b gets its sandbox on b and reaches it through b's daemon.
        b = ray_nodes["node-b"]
        task = near_create.options(scheduling_strategy=NodeAffinitySchedulingStrategy(b, soft=False))
        lease, here, local, stdout = ray.get(task.remote(p, "guest"))
        assert (here, lease.ray_node, lease.node_id, local, stdout) == (b, b, "node-b", True, "local\n")

        # A drained node gets no placement; undrained, it does again.
        ray.get(p.drain.remote(b))
        placed = {ray.get(p.create.remote("guest", near=b)).node_id for _ in range(4)}
        assert "node-b" not in placed
        ray.get(p.undrain.remote(b))
        assert ray.get(p.create.remote("guest", near=b)).node_id == "node-b"
    finally:
        ray.get(p.close.remote())
        ray.kill(p)


def test_a_fork_group_spans_nodes_through_one_snapshot(cluster) -> None:
    p = pool("forks")
    try:
        nodes = ray.get(p.refresh.remote())
        a = next(n["ray_node"] for n in nodes if n["node_id"] == "node-a")
        parent = ray.get(p.create.remote("guest", near=a))
        assert parent.node_id == "node-a"
        group = ray.get(p.fork_group.remote(parent, 12))
        assert len(group) == 12 and len({lease.id for lease in group}) == 12
        counts: Dict[str, int] = {}
        for lease in group:
            counts[lease.node_id] = counts.get(lease.node_id, 0) + 1
        # The parent's node is filled first (7 of its 8 slots), the rest restored elsewhere.
        assert counts["node-a"] == 7 and sum(counts.values()) == 12, counts
        assert all(lease.run(["echo", "ok"]).stdout == "ok\n" for lease in group)
        # A small group stays on the parent's node as one fork.
        ray.get(p.close.remote())
        parent = ray.get(p.create.remote("guest", near=a))
        small = ray.get(p.fork_group.remote(parent, 4))
        assert {lease.node_id for lease in small} == {"node-a"}
    finally:
        ray.get(p.close.remote())
        ray.kill(p)


@ray.remote(num_cpus=0)
class AgentLoop:
    """A verl-shaped agent loop: asyncio episodes of create -> run -> reset -> delete, each
    placed on this actor's node when it can be, retried while the cluster is full."""

    def __init__(self, p) -> None:
        self.p = p

    async def episodes(self, n: int) -> Dict[str, int]:
        here = ray.get_runtime_context().get_node_id()

        async def episode(i: int) -> str:
            while True:
                try:
                    lease = await self.p.create.remote("guest", near=here)
                    break
                except Overloaded:
                    await asyncio.sleep(0.2)
            result = await asyncio.to_thread(lease.run, ["echo", f"episode {i}"])
            assert result.stdout == f"episode {i}\n", result
            await asyncio.to_thread(lease.reset)
            await self.p.release.remote(lease)
            return lease.node_id

        counts: Dict[str, int] = {}
        for node in await asyncio.gather(*(episode(i) for i in range(n))):
            counts[node] = counts.get(node, 0) + 1
        return counts


def test_agent_loops_run_episodes_and_a_killed_driver_is_cleaned_up(cluster) -> None:
    p = pool("verl")
    try:
        nodes = ray.get(p.refresh.remote())
        loops = [
            AgentLoop.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["ray_node"], soft=False)
            ).remote(p)
            for n in nodes
        ]
        done = ray.get([loop.episodes.remote(16) for loop in loops])
        assert sum(sum(c.values()) for c in done) == 48
        # Each loop placed episodes on its own node first (others only while it was full).
        for node, counts in zip(nodes, done):
            assert counts.get(node["node_id"], 0) >= 4, done
        for socket in SOCKETS:
            assert live(socket, "verl") == []
    finally:
        ray.get(p.close.remote())
        ray.kill(p)

    # A driver killed with its sandboxes live: a new driver closes its pool by name.
    driver = (
        "import os, sys, ray\n"
        "from rollbox_sdk.ray import pool\n"
        "ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)\n"
        "p = pool('crash')\n"
        "print(' '.join(ray.get(p.create.remote('guest')).id for _ in range(3)), flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    killed = subprocess.run(
        [sys.executable, "-c", driver, cluster["cluster"].address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr
    made = killed.stdout.split()
    assert len(made) == 3 and sum(len(live(s, "crash")) for s in SOCKETS) == 3
    crashed = pool("crash")
    assert sorted(ray.get(crashed.close.remote())) == sorted(made)
    ray.kill(crashed)
    for socket in SOCKETS:
        assert live(socket, "crash") == []


def test_the_verl_tool_and_the_grpo_example(cluster) -> None:
    from rollbox_sdk.verl import RollboxTool

    tool = RollboxTool({"template": "guest", "pool": "tool", "command": ["sh", "-c"]})

    async def trajectory():
        instance = await tool.create()
        answer = await tool.execute(instance, {"code": "echo 42"})
        assert await tool.calc_reward(instance) == 0.0
        await tool.release(instance)
        return answer

    text, reward, metrics = asyncio.run(trajectory())
    assert (text, reward, metrics["exit_code"]) == ("42\n", 0.0, 0)
    ray.kill(pool("tool"))

    example = os.path.join(os.path.dirname(__file__), "..", "examples", "ray_grpo.py")
    ran = subprocess.run(
        [sys.executable, example, "--address", cluster["cluster"].address, "--template", "guest"]
        + ["--groups", "1", "--group", "6"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    assert "3 agent loops, 18 steps in groups of 6" in ran.stdout, ran.stdout
    for socket in SOCKETS:
        assert live(socket, "tool") == [] and live(socket, "grpo") == []


def test_a_lost_node_raises_sandbox_lost_and_gets_no_placement(cluster) -> None:
    p = pool("loss")
    c_socket = next(s for s, n in cluster["by_socket"].items() if n == "node-c")
    try:
        nodes = ray.get(p.refresh.remote())
        c = next(n["ray_node"] for n in nodes if n["node_id"] == "node-c")
        lease = ray.get(p.create.remote("guest", near=c))
        assert lease.node_id == "node-c"
        cluster["cluster"].remove_node(HANDLES["node-c"])
        with pytest.raises(SandboxLost):
            lease.run(["echo", "gone"])
        placed = {ray.get(p.create.remote("guest", near=c)).node_id for _ in range(3)}
        assert "node-c" not in placed
        alive = {n["node_id"]: n["alive"] for n in ray.get(p.refresh.remote())}
        assert alive["node-c"] is False
    finally:
        ray.get(p.close.remote())
        ray.kill(p)
        # node-c's daemon outlived its Ray node: its sandboxes end by label (or their TTL).
        with Client(socket=c_socket) as client:
            client.delete_sandboxes(labels={POOL_LABEL: "loss"})


MANAGED_BIN = os.environ.get("ROLLBOX_RAY_MANAGED_BIN", "")
MANAGED_ARGS = os.environ.get("ROLLBOX_RAY_MANAGED_ARGS", "")


def processes_under(path: str) -> List[int]:
    """The pids whose command line names `path` (a managed daemon's scratch directory)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if path.encode() in f.read():
                    found.append(int(pid))
        except (OSError, ValueError):
            pass
    return found


def test_a_managed_node_starts_its_own_daemon_which_ends_with_the_node(cluster) -> None:
    """ROLLBOX_MANAGED=1: the node's actor starts `rollbox serve` itself (its slots from the
    node's rollbox_slots), the pool adds the template there, and when the Ray node goes the
    daemon and its sandboxes go with it."""
    assert MANAGED_BIN, "run it through rollbox/tests/python_sdk.rs (ROLLBOX_RAY_MANAGED_BIN)"
    import time

    made = cluster["cluster"]
    handle = made.add_node(
        num_cpus=2,
        resources={SLOTS: 4},
        object_store_memory=OBJECT_STORE,
        env_vars={"ROLLBOX_MANAGED": "1", "ROLLBOX_BIN": MANAGED_BIN, "ROLLBOX_SERVE_ARGS": MANAGED_ARGS},
    )
    made.wait_for_nodes()
    p = pool("managed")
    try:
        nodes = {n["node_id"]: n for n in ray.get(p.refresh.remote()) if n["alive"]}
        m = nodes["node-m"]
        assert m["info"]["slots"]["total"] == 4, m
        added = ray.get(
            p.add_template.remote(
                "guest",
                os.environ["ROLLBOX_SDK_KERNEL"],
                cmdline=os.environ.get("ROLLBOX_SDK_CMDLINE", ""),
                memory_mib=32,
            )
        )
        assert added == ["node-m"], added
        lease = ray.get(p.create.remote("guest", near=m["ray_node"]))
        assert lease.node_id == "node-m"
        assert lease.run(["echo", "managed"]).stdout == "managed\n"
        actor = ray.get_actor(f"rollbox-node-{m['ray_node']}", namespace="rollbox")
        managed = ray.get(actor.info.remote())["managed"]
        scratch = os.path.dirname(managed["socket"])
        assert processes_under(scratch), "the managed daemon is not running"

        made.remove_node(handle)
        deadline = time.monotonic() + 60
        while processes_under(scratch) and time.monotonic() < deadline:
            time.sleep(0.5)
        # The daemon, its VMMs and its jails are gone with the node.
        assert processes_under(scratch) == [], processes_under(scratch)
        with pytest.raises(SandboxLost):
            lease.run(["echo", "gone"])
    finally:
        ray.get(p.close.remote())
        ray.kill(p)
