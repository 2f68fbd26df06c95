#!/usr/bin/env python3
"""Benchmark: the round trip of ``f.remote()`` (``@function``) for a trivial function, cold
(its sandbox boots) and from a snapshot (its sandbox restores a boot snapshot), beside a plain
create + exec + delete from the same boot snapshot. Prints figures, never a verdict.

    ROLLBOX_SOCKET=... ROLLBOX_API_KEY=... python function_round_trip.py --template python

``--template`` must have a boot snapshot and ``python3`` of this interpreter's major.minor
(the function travels as cloudpickle bytecode). The rows:

- cold: the call mounts a volume, which the boot snapshot lacks, so its create boots Linux
  (and waits for the agent, as a create of a template with a boot snapshot does);
- from a snapshot: the same template without a volume (a restore);
- from a snapshot, with the volume: a template whose boot snapshot has the volume (what
  ``examples/rl_loop.py`` does; a restore and a virtiofsd);
- baseline: create, exec ``true`` and delete from the template's boot snapshot, no function.

Each round trip is the caller's wall time: create, upload (the call and cloudpickle), exec of
the guest's python, download of the result, delete.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, List

from rollbox_sdk import Client, Conflict, NotFound, Volume, function
from rollbox_sdk.function import WORKDIR


def add(a: int, b: int) -> int:
    return a + b


def timed(reps: int, call: Callable[[], None]) -> List[float]:
    """Seconds of each of ``reps`` calls."""
    samples = []
    for _ in range(reps):
        started = time.monotonic()
        call()
        samples.append(time.monotonic() - started)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", default="python")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--volume", default="function-bench")
    parser.add_argument("--timeout", type=int, default=600, help="seconds for each call")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps: at least 1")

    rows = []
    with Client() as rb:
        try:
            rb.create_volume(args.volume)
        except Conflict:
            pass
        volumes = [Volume(args.volume, "./data")]

        def check(f: Callable[[int, int], int]) -> Callable[[], None]:
            def call() -> None:
                got = f(2, 3)
                if got != 5:
                    raise RuntimeError(f"add(2, 3) came back as {got!r}")

            return call

        def baseline() -> None:
            sandbox = rb.create_sandbox(args.template, ttl_s=args.timeout)
            try:
                result = rb.run(sandbox, ["true"], timeout_s=args.timeout)
                if not result.ok:
                    raise RuntimeError(f"true exited {result.exit_code}")
            finally:
                rb.delete_sandbox(sandbox)

        print(
            f"function bench: {args.reps} reps each, template {args.template}", file=sys.stderr
        )
        rows.append(
            ("baseline: create + exec `true` + delete (restore)", timed(args.reps, baseline))
        )
        plain = function(template=args.template, timeout_s=args.timeout, client=rb)(add)
        rows.append(
            ("`f.remote()` from a snapshot (restore)", timed(args.reps, check(plain.remote)))
        )

        base = rb.get_template(args.template)
        warm_name = f"{args.template}-fn-bench"
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
            volumes=[Volume(args.volume, f"{WORKDIR}/data")],
        )
        try:
            warm = function(
                template=warm_name, volumes=volumes, timeout_s=args.timeout, client=rb
            )(add)
            rows.append(
                (
                    "`f.remote()` from a snapshot with a volume (restore)",
                    timed(args.reps, check(warm.remote)),
                )
            )
        finally:
            rb.delete_template(warm_name)

        cold = function(
            template=args.template, volumes=volumes, timeout_s=args.timeout, client=rb
        )(add)
        rows.append(
            ("`f.remote()` cold with a volume (boot)", timed(args.reps, check(cold.remote)))
        )
        rb.delete_volume(args.volume)

    base_p50 = statistics.median(rows[0][1])
    print(f"| round trip ({args.reps} reps) | p50 s | min s | max s | p50 / baseline |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, samples in rows:
        p50 = statistics.median(samples)
        print(
            f"| {name} | {p50:.2f} | {min(samples):.2f} | {max(samples):.2f} | "
            f"{p50 / base_p50:.1f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
