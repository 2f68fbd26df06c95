#!/usr/bin/env python3
"""An RL rollout loop on rollbox: warm one sandbox, fork it into N, run an episode in each,
reset each to the warm state between episodes, and end them all.

    ROLLBOX_SOCKET=/run/rollbox/rollbox.sock ROLLBOX_API_KEY=... \\
        python rl_rollout.py --template python --count 64 --episodes 10

Forking copies the warm sandbox's memory (a snapshot restored N times), so each worker starts
from exactly the state the warm-up left, and ``reset`` returns it there in one call: no boot,
no re-install, no leftovers from the previous episode. The "environment" here is a toy (a
shell command per step whose output is the reward); put a real one behind ``rb.run``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import uuid
from typing import List

from rollbox_sdk import AsyncClient, RollboxError, Sandbox

MAX_FORK = 64
"""The most sandboxes one fork call makes."""


async def episode(rb: AsyncClient, worker: Sandbox, number: int, steps: int, seed: int) -> float:
    """One episode: `steps` actions, each an exec whose stdout is the step's reward."""
    policy = random.Random(seed)
    total = 0.0
    for step in range(steps):
        action = policy.randint(0, 9)
        result = await rb.run(
            worker,
            ["sh", "-c", 'echo $(( (ACTION * 7 + STEP) % 10 ))'],
            env={"ACTION": str(action), "STEP": str(step), "EPISODE": str(number)},
            timeout_s=30,
        )
        if not result.ok or not result.stdout.strip().isdigit():
            raise RuntimeError(
                f"{worker.id}: step {step} gave exit {result.exit_code}, "
                f"stdout {result.stdout!r}, stderr {result.stderr!r}"
            )
        total += float(result.stdout.strip()) / 10
    return total


async def main(args: argparse.Namespace) -> int:
    run = uuid.uuid4().hex[:8]
    labels = {"rollout": run}
    async with AsyncClient() as rb:
        try:
            started = time.monotonic()
            warm = await rb.create_sandbox(args.template, ttl_s=args.ttl, labels=labels)
            # Warm-up: whatever every episode needs (imports, data, a started server).
            setup = await rb.run(warm, args.warmup, timeout_s=300)
            if not setup.ok:
                print(f"warm-up failed: {setup.stderr}", file=sys.stderr)
                return 1
            print(f"warm sandbox {warm.id} ready in {time.monotonic() - started:.2f} s")

            started = time.monotonic()
            workers: List[Sandbox] = []
            while len(workers) < args.count:
                want = min(MAX_FORK, args.count - len(workers))
                for item in await rb.fork(warm, want, labels={**labels, "role": "worker"}):
                    if item.sandbox is None:
                        print(f"a fork failed: {item.error}", file=sys.stderr)
                        return 1
                    workers.append(item.sandbox)
            print(f"forked {len(workers)} workers in {time.monotonic() - started:.2f} s")

            for number in range(args.episodes):
                started = time.monotonic()
                returns = await asyncio.gather(
                    *(
                        episode(rb, worker, number, args.steps, seed=number * 100003 + i)
                        for i, worker in enumerate(workers)
                    )
                )
                ran = time.monotonic() - started
                started = time.monotonic()
                # Back to the warm state: each worker restores the snapshot it was forked from.
                await asyncio.gather(*(rb.reset(worker) for worker in workers))
                print(
                    f"episode {number}: mean return {statistics.mean(returns):.3f} over "
                    f"{len(returns)} sandboxes; ran in {ran:.2f} s, reset in "
                    f"{time.monotonic() - started:.2f} s"
                )
            print(f"rollout done: {len(workers)} sandboxes x {args.episodes} episodes")
            return 0
        finally:
            ended = await rb.delete_sandboxes(labels=labels)
            print(f"ended {len(ended)} sandboxes")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--template", required=True, help="the template to boot")
    parser.add_argument("--count", type=int, default=64, help="workers to fork (default 64)")
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="actions per episode")
    parser.add_argument("--ttl", type=int, default=1800, help="hard TTL of every sandbox, s")
    parser.add_argument("--warmup", default="true", help="the warm-up command (sh -c)")
    args = parser.parse_args()
    if args.count < 1:
        parser.error("--count: at least 1")
    return args


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main(parse_args())))
    except RollboxError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
