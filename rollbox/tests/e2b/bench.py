"""Figures, not asserts: the stock `e2b` SDK against rollbox's E2B listener, and the same
operations through rollbox's native API in the same run, at several concurrencies.
Run by the ignored test `e2b_benchmark_figures` in rollbox/tests/e2b.rs (docs/benchmarks.md).

Environment: E2B_API_URL, E2B_API_KEY, E2B_DOMAIN, E2B_SANDBOX_URL, ROLLBOX_E2B_TEMPLATE and
ROLLBOX_E2B_SCRATCH as test_sdk.py, plus ROLLBOX_NATIVE_SOCKET (the daemon's Unix socket) and
ROLLBOX_E2B_BENCH_CONCURRENCY (default "1,16,64").
Operations: create to first command output (`echo first`; the kill is not timed),
`commands.run("true")` round trip, a 1 MiB file write, and its read back.
"""

import http.client
import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from e2b import Sandbox

TEMPLATE = os.environ["ROLLBOX_E2B_TEMPLATE"]
SCRATCH = os.environ["ROLLBOX_E2B_SCRATCH"]
SOCKET = os.environ["ROLLBOX_NATIVE_SOCKET"]
KEY = os.environ["E2B_API_KEY"]
DATA = os.urandom(1 << 20)
TTL_S = 600

# Timed calls per worker, by operation and concurrency (fewer when more run at once).
PER_WORKER = {
    "create": {1: 10, 16: 2, 64: 1},
    "run": {1: 50, 16: 10, 64: 4},
    "file": {1: 10, 16: 3, 64: 2},
}


def per_worker(op, concurrency):
    table = PER_WORKER[op]
    return table.get(concurrency) or max(1, table[1] // concurrency)


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=120)
        self.unix_path = path

    def connect(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(120)
        sock.connect(self.unix_path)
        self.sock = sock


_local = threading.local()


def native(method, path, body=None, expect=(200, 201, 204)):
    """One native API call on this thread's keep-alive connection; 429s are retried."""
    for attempt in range(200):
        connection = getattr(_local, "connection", None)
        if connection is None:
            connection = _local.connection = UnixConnection(SOCKET)
        headers = {"Authorization": f"Bearer {KEY}"}
        if isinstance(body, dict):
            body = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException):
            connection.close()
            _local.connection = None
            if attempt < 3:
                continue
            raise
        if response.status == 429:
            time.sleep(0.05)
            continue
        if response.status not in expect:
            raise RuntimeError(f"{method} {path}: {response.status} {data[:300]!r}")
        return data
    raise RuntimeError(f"{method} {path}: still 429 after 200 tries")


class E2bSdk:
    name = "e2b SDK"

    def create(self):
        return Sandbox.create(TEMPLATE, timeout=TTL_S)

    def first_output(self, sbx):
        return sbx.commands.run("echo first").stdout == "first\n"

    def run_true(self, sbx):
        sbx.commands.run("true")

    def write(self, sbx, path):
        sbx.files.write(path, DATA)

    def read(self, sbx, path):
        assert len(sbx.files.read(path, format="bytes")) == len(DATA)

    def kill(self, sbx):
        sbx.kill()

    def sandbox_id(self, sbx):
        return sbx.sandbox_id


class Native:
    name = "native"

    def create(self):
        sandbox = json.loads(native("POST", "/sandboxes", {"template": TEMPLATE, "ttl_s": TTL_S}))
        return sandbox["id"]

    def exec(self, sid, cmd):
        return json.loads(native("POST", f"/sandboxes/{sid}/exec", {"cmd": cmd}))

    def first_output(self, sid):
        return self.exec(sid, "echo first")["stdout"] == "first\n"

    def run_true(self, sid):
        self.exec(sid, "true")

    def write(self, sid, path):
        native("PUT", f"/sandboxes/{sid}/files?path={path}&parents=true", DATA)

    def read(self, sid, path):
        assert len(native("GET", f"/sandboxes/{sid}/files?path={path}")) == len(DATA)

    def kill(self, sid):
        native("DELETE", f"/sandboxes/{sid}")

    def sandbox_id(self, sid):
        return sid


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(api, op, concurrency, samples, wall_s, wrong=0):
    print(
        f"figure: {api.name:8} {op:28} c={concurrency:<3} n={len(samples):<4} "
        f"p50 {percentile(samples, 0.5):8.1f} ms  p99 {percentile(samples, 0.99):8.1f} ms  "
        f"{len(samples) / wall_s:7.1f}/s" + (f"  WRONG OUTPUT {wrong}/{len(samples)}" if wrong else ""),
        flush=True,
    )


def concurrently(concurrency, work):
    """Runs work(i) for i in 0..concurrency at once; returns their results and the wall time."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(work, range(concurrency)))
    return results, time.perf_counter() - started


def timed(call):
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def bench(api, concurrency):
    def creates(_i):
        samples, wrong = [], 0
        for _ in range(per_worker("create", concurrency)):
            box, right = None, False

            def create_and_run():
                nonlocal box, right
                box = api.create()
                right = api.first_output(box)

            samples.append(timed(create_and_run))
            wrong += not right  # counted, not fatal: a figure run reports what it saw
            api.kill(box)
        return samples, wrong

    results, wall = concurrently(concurrency, creates)
    samples = sum((s for s, _ in results), [])
    wrong = sum(w for _, w in results)
    report(api, "create to first output", concurrency, samples, wall, wrong)

    boxes, _ = concurrently(concurrency, lambda _i: api.create())
    try:
        def runs(i):
            return [timed(lambda: api.run_true(boxes[i])) for _ in range(per_worker("run", concurrency))]

        results, wall = concurrently(concurrency, runs)
        report(api, 'commands.run("true")', concurrency, sum(results, []), wall)

        def files(i):
            path = f"{SCRATCH}/{api.sandbox_id(boxes[i])}-1mib.bin"
            writes, reads = [], []
            for _ in range(per_worker("file", concurrency)):
                writes.append(timed(lambda: api.write(boxes[i], path)))
                reads.append(timed(lambda: api.read(boxes[i], path)))
            os.remove(path)  # the host agent writes on this host
            return writes, reads

        results, wall = concurrently(concurrency, files)
        report(api, "1 MiB write", concurrency, sum((w for w, _ in results), []), wall)
        report(api, "1 MiB read", concurrency, sum((r for _, r in results), []), wall)
    finally:
        concurrently(concurrency, lambda i: api.kill(boxes[i]))


def main():
    levels = [int(c) for c in os.environ.get("ROLLBOX_E2B_BENCH_CONCURRENCY", "1,16,64").split(",")]
    print(f"template {TEMPLATE}; concurrency {levels}; wall-clock per operation as the client sees it", flush=True)
    for concurrency in levels:
        for api in (E2bSdk(), Native()):
            bench(api, concurrency)


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        sys.exit(1)
    print("bench done", flush=True)
