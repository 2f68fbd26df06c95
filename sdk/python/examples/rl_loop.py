#!/usr/bin/env python3
"""The RL loop on rollbox: fan out sandboxes that write trajectories to one shared volume,
train on them in a ``@function`` that mounts the same volume, and read the checkpoint it
writes back, from the host.

    ROLLBOX_SOCKET=/run/rollbox/rollbox.sock ROLLBOX_API_KEY=... \\
        python rl_loop.py --template python --workers 16

``--template`` must have ``python3`` (the same major.minor as this interpreter: the
function travels as cloudpickle bytecode). One sandbox boots with the volume mounted at
``/data``; a fork makes the other workers (each keeps the mount, with a virtiofsd of its
own); each writes ``/data/<its id>.json``. ``update_policy`` then runs in a sandbox of its
own with the volume at ``./data`` under its working directory, reads every trajectory and
writes ``data/policy-v1.json``, which this script reads through the daemon's volume API. It
runs twice: cold (its sandbox boots), then from a snapshot (a template with the volume and a
boot snapshot, so its sandbox is a restore).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from rollbox_sdk import Client, Conflict, NotFound, Volume, function
from rollbox_sdk.function import WORKDIR

MAX_FORK = 64
"""The most sandboxes one fork call makes."""

WRITE_TRAJECTORY = r"""
import json, os, random, socket
rng = random.Random(os.environ["SEED"])
steps = [{"obs": rng.random(), "reward": rng.random()} for _ in range(32)]
with open(f"/data/{os.environ['WORKER']}.json", "w") as f:
    json.dump({"worker": os.environ["WORKER"], "steps": steps}, f)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", default="python")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--volume", default="trajectories")
    parser.add_argument("--timeout", type=int, default=600, help="seconds for each step")
    args = parser.parse_args()
    if not 1 <= args.workers <= MAX_FORK + 1:
        parser.error(f"--workers: 1 to {MAX_FORK + 1}")

    with Client() as rb:
        try:
            rb.create_volume(args.volume)
        except Conflict:
            pass
        started = time.monotonic()
        first = rb.create_sandbox(
            args.template,
            ttl_s=args.timeout,
            volumes=[Volume(args.volume, "/data")],
            labels={"example": "rl_loop"},
        )
        workers = [first]
        try:
            if args.workers > 1:
                forked = rb.fork(first, count=args.workers - 1, ttl_s=args.timeout)
                for item in forked:
                    if item.sandbox is None:
                        raise RuntimeError(f"fork: {item.error}")
                    workers.append(item.sandbox)
            print(f"{len(workers)} workers with the volume in {time.monotonic() - started:.1f} s")
            for index, worker in enumerate(workers):
                result = rb.run(
                    worker,
                    ["python3", "-c", WRITE_TRAJECTORY],
                    env={"WORKER": worker.id, "SEED": str(index)},
                    timeout_s=args.timeout,
                )
                if not result.ok:
                    raise RuntimeError(f"{worker.id}: {result.exit_code} {result.stderr}")
        finally:
            for worker in workers:
                rb.delete_sandbox(worker)
        print(f"trajectories written in {time.monotonic() - started:.1f} s")

        def train(version: int) -> dict:
            import glob

            episodes = []
            for path in sorted(glob.glob("data/sb-*.json")):
                with open(path) as f:
                    episodes.append(json.load(f))
            rewards = [s["reward"] for e in episodes for s in e["steps"]]
            policy = {
                "version": version,
                "episodes": len(episodes),
                "mean_reward": sum(rewards) / len(rewards),
            }
            with open(f"data/policy-v{version}.json", "w") as f:
                json.dump(policy, f)
            print(f"trained on {len(episodes)} episodes")
            return policy

        volumes = [Volume(args.volume, "./data")]
        update_policy = function(
            template=args.template, volumes=volumes, timeout_s=args.timeout, client=rb
        )(train)
        started = time.monotonic()
        policy = update_policy.remote(1)
        print(f"update_policy.remote (cold: a boot): {policy} in {time.monotonic() - started:.1f} s")
        checkpoint = json.loads(rb.read_volume_file(args.volume, "policy-v1.json"))
        if checkpoint != policy or policy["episodes"] != len(workers):
            print(f"checkpoint {checkpoint} does not match {policy}", file=sys.stderr)
            return 1

        # From a snapshot: a template with the volume where the function sees it and a boot
        # snapshot, so each call restores instead of booting.
        base = rb.get_template(args.template)
        warm_name = f"{args.template}-fn"
        try:
            rb.delete_template(warm_name)
        except NotFound:
            pass
        rb.add_template(
            warm_name,
            base.kernel,
            rootfs=base.rootfs,
            initrd=base.initrd,
            cmdline=base.cmdline,
            vcpus=base.vcpus,
            memory_mib=base.memory_mib,
            boot_snapshot=True,
            volumes=[Volume(args.volume, os.path.join(WORKDIR, "data"))],
        )
        try:
            warm = function(
                template=warm_name, volumes=volumes, timeout_s=args.timeout, client=rb
            )(train)
            started = time.monotonic()
            again = warm.remote(2)
            print(f"update_policy.remote (from a snapshot): {again} in {time.monotonic() - started:.1f} s")
            if again["episodes"] != len(workers):
                print(f"the warm call saw {again}", file=sys.stderr)
                return 1
        finally:
            rb.delete_template(warm_name)
        print(f"checkpoint read from the host: {checkpoint}")
    print("rl loop: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
