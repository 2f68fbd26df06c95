#!/usr/bin/env python3
"""Benchmark: rollbox_sdk.ray's pool on a Ray cluster of this host (a head and one worker node
per daemon, ``ray.cluster_utils``), each worker with its own ``rollbox serve``. Prints
figures, never a verdict.

    ROLLBOX_RAY_SOCKETS=a.sock:b.sock:c.sock ROLLBOX_API_KEY=... \\
        python ray_pool.py --kernel test-guest --cmdline "..." --slots 16

Rows:

- a create placed by the pool (from the driver, through the pool actor and a node actor),
  against a create straight to one daemon's socket (the baseline); creates only, each
  sandbox deleted untimed;
- a fork group of 12 that one node holds (the pool makes it one local fork), against one that
  spans nodes: the parent's node has 7 free slots (8 others hold the rest), so the pool
  snapshots once, restores 7 there, exports the snapshot and imports it on another node,
  and restores 5 there.

rollbox/tests/python_sdk.rs runs it (ignored by default: ``--ignored
python_sdk_ray_pool_figures``) with three daemons of the test guest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Dict, List

import ray
from ray.cluster_utils import Cluster

from rollbox_sdk import Client
from rollbox_sdk.ray import SLOTS, pool


def pct(samples: List[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]


def row(name: str, samples: List[float]) -> str:
    ms = [s * 1000 for s in samples]
    return f"| {name} | {statistics.median(ms):.1f} | {pct(ms, 99):.1f} | {min(ms):.1f} | {len(ms)} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", required=True)
    parser.add_argument("--cmdline", default="")
    parser.add_argument("--slots", type=int, default=16, help="each daemon's --max-sandboxes")
    parser.add_argument("--creates", type=int, default=100)
    parser.add_argument("--groups", type=int, default=5)
    args = parser.parse_args()
    sockets = [s for s in os.environ["ROLLBOX_RAY_SOCKETS"].split(":") if s]
    key = os.environ["ROLLBOX_API_KEY"]
    for socket in sockets:
        with Client(socket=socket, api_key=key) as client:
            client.add_template("guest", args.kernel, cmdline=args.cmdline, memory_mib=32)
    head = {"num_cpus": 1, "object_store_memory": 80 << 20, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for socket in sockets:
        cluster.add_node(
            num_cpus=2,
            resources={SLOTS: args.slots},
            object_store_memory=80 << 20,
            env_vars={"ROLLBOX_SOCKET": socket, "ROLLBOX_API_KEY": key},
        )
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    cluster.wait_for_nodes()
    p = pool("bench")
    try:
        nodes: Dict[str, str] = {n["node_id"]: n["ray_node"] for n in ray.get(p.refresh.remote())}
        a, b = sorted(nodes)[:2]

        pool_samples = []
        for _ in range(args.creates):
            started = time.perf_counter()
            lease = ray.get(p.create.remote("guest"))
            pool_samples.append(time.perf_counter() - started)
            ray.get(p.release.remote(lease))
        with Client(socket=sockets[0], api_key=key) as client:
            direct_samples = []
            for _ in range(args.creates):
                started = time.perf_counter()
                sandbox = client.create_sandbox("guest", ttl_s=600)
                direct_samples.append(time.perf_counter() - started)
                client.delete_sandbox(sandbox)

        local_groups, spanning_groups = [], []
        for _ in range(args.groups):
            parent = ray.get(p.create.remote("guest", near=nodes[b]))
            started = time.perf_counter()
            group = ray.get(p.fork_group.remote(parent, 12))
            local_groups.append(time.perf_counter() - started)
            assert {lease.node_id for lease in group} == {b}, group
            ray.get(p.close.remote())

            parent = ray.get(p.create.remote("guest", near=nodes[a]))
            fillers = args.slots - 1 - 7
            for _ in range(fillers):
                ray.get(p.create.remote("guest", near=nodes[a]))
            started = time.perf_counter()
            group = ray.get(p.fork_group.remote(parent, 12))
            spanning_groups.append(time.perf_counter() - started)
            assert len({lease.node_id for lease in group}) > 1, group
            ray.get(p.close.remote())

        print(f"rollbox_sdk.ray on {len(sockets)} daemons of {args.slots} slots (test guest, 32 MiB)\n")
        print("| what | p50 ms | p99 ms | min ms | n |\n| --- | --- | --- | --- | --- |")
        print(row("create placed by the pool (driver -> pool -> node actor)", pool_samples))
        print(row("baseline: create on the daemon's socket", direct_samples))
        print(row("fork group of 12 on one node (one fork)", local_groups))
        print(row("fork group of 12 over two nodes (7 + 5 via export/import)", spanning_groups))
    finally:
        ray.get(p.close.remote())
        ray.kill(p)
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
