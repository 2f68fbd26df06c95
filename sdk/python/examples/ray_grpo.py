#!/usr/bin/env python3
"""GRPO-shaped rollouts on a Ray cluster with rollbox_sdk.ray: agent-loop actors, one per
rollbox node, each running asyncio episodes. An episode takes a sandbox near its actor,
warms it up once, forks it into a group of ``--group`` (the group starts from one state, on
as many nodes as it needs), runs a step in every member, and gives the group back.

    python examples/ray_grpo.py --address HEAD:6379 --template python --groups 4 --group 8

Every node of the cluster that runs a daemon needs the resource ``rollbox_slots`` and
ROLLBOX_SOCKET (or ROLLBOX_URL) and ROLLBOX_API_KEY in its environment.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import List

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollbox_sdk.ray import pool


@ray.remote(num_cpus=0)
class AgentLoop:
    def __init__(self, pool_name: str, template: str, warmup: List[str], step: List[str]) -> None:
        self.pool = pool(pool_name)
        self.template, self.warmup, self.step = template, warmup, step

    async def group(self, size: int) -> List[str]:
        here = ray.get_runtime_context().get_node_id()
        parent = await self.pool.create.remote(self.template, near=here)
        try:
            await asyncio.to_thread(parent.run, self.warmup)
            members = await self.pool.fork_group.remote(parent, size)
            try:
                results = await asyncio.gather(*(asyncio.to_thread(m.run, self.step) for m in members))
                return [f"{m.node_id}: {r.stdout.strip()}" for m, r in zip(members, results)]
            finally:
                await asyncio.gather(*(self.pool.release.remote(m) for m in members))
        finally:
            await self.pool.release.remote(parent)

    async def groups(self, count: int, size: int) -> List[List[str]]:
        return list(await asyncio.gather(*(self.group(size) for _ in range(count))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="auto")
    parser.add_argument("--template", default="python")
    parser.add_argument("--pool", default="grpo")
    parser.add_argument("--groups", type=int, default=4, help="groups per agent loop")
    parser.add_argument("--group", type=int, default=8, help="sandboxes per group")
    parser.add_argument("--warmup", nargs="+", default=["sh", "-c", "echo warm"])
    parser.add_argument("--step", nargs="+", default=["sh", "-c", "echo step"])
    args = parser.parse_args()
    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    p = pool(args.pool)
    try:
        nodes = ray.get(p.refresh.remote())
        loops = [
            AgentLoop.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["ray_node"], soft=False)
            ).remote(args.pool, args.template, args.warmup, args.step)
            for n in nodes
            if n["alive"]
        ]
        done = ray.get([loop.groups.remote(args.groups, args.group) for loop in loops])
        steps = [line for per_loop in done for group in per_loop for line in group]
        print(f"{len(loops)} agent loops, {len(steps)} steps in groups of {args.group}")
        for line in sorted(set(steps)):
            print(f"  {line} x{steps.count(line)}")
    finally:
        ray.get(p.close.remote())
        ray.kill(p)


if __name__ == "__main__":
    main()
