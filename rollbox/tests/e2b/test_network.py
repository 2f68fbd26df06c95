"""The stock `e2b` SDK's network options against `rollbox serve --e2b-listen` with a real Linux
template that has a network: run by tests/tests/tier4_network.rs inside the nested lab, where
ROLLBOX_E2B_TARGET (HOST:PORT) is an HTTP server outside the sandbox (another network
namespace of L1, reached through the sandbox's tap, forwarded and masqueraded).

`allow_internet_access=True` reaches it; `allow_internet_access=False` cannot;
`update_network` opens it (`allow_out` with `deny_out: 0.0.0.0/0`), closes it again
(`deny_out` alone) and opens everything (an empty update clears the rules).
Environment as test_linux.py's. Prints `ok NAME` per check; any failure raises.
"""

import importlib.metadata
import os
import time

from e2b import Sandbox

from test_sdk import ok, run_main

TEMPLATE = os.environ["ROLLBOX_E2B_TEMPLATE"]
HOST, PORT = os.environ["ROLLBOX_E2B_TARGET"].split(":")
ANSWER = f"port-{PORT}-answers"


def attempt(sbx, want):
    """The guest's try at the server (bash's /dev/tcp): its output. An answer expected may take
    up to 60 s on a busy lab host; a dropped connection is given 10 s to prove it stays so."""
    wait_s = 60 if want else 10
    request = 'printf "GET / HTTP/1.0\\r\\n\\r\\n" >&3; cat <&3'
    result = sbx.commands.run(
        f"timeout {wait_s} bash -c 'exec 3<>/dev/tcp/{HOST}/{PORT}; {request}' 2>&1; echo exit=$?",
        timeout=wait_s + 90,
    )
    return result.stdout


def update(sbx, network, want):
    started = time.perf_counter()
    sbx.update_network(network)
    took = (time.perf_counter() - started) * 1000
    out = attempt(sbx, want)
    assert (ANSWER in out) == want, (network, want, out)
    print(f"figure: update_network({network}) took {took:.0f} ms (lab)", flush=True)


def main():
    print(f"e2b SDK {importlib.metadata.version('e2b')}, template {TEMPLATE}", flush=True)
    open_sbx = Sandbox.create(TEMPLATE, timeout=300, allow_internet_access=True)
    try:
        out = attempt(open_sbx, True)
        assert ANSWER in out, f"allow_internet_access=True did not reach the server: {out}"
        ok("allow_internet_access=True: reachable")
    finally:
        open_sbx.kill()
    sbx = Sandbox.create(TEMPLATE, timeout=300, allow_internet_access=False)
    try:
        out = attempt(sbx, False)
        assert ANSWER not in out, f"allow_internet_access=False reached the server: {out}"
        ok("allow_internet_access=False: the server outside is not reachable")
        update(sbx, {"allow_out": [HOST], "deny_out": ["0.0.0.0/0"]}, True)
        ok("update_network allow_out [HOST] with deny_out 0.0.0.0/0: reachable")
        update(sbx, {"deny_out": ["0.0.0.0/0"]}, False)
        ok("update_network deny_out 0.0.0.0/0: not reachable again")
        update(sbx, {}, True)
        ok("update_network with no rules: reachable")
    finally:
        sbx.kill()


if __name__ == "__main__":
    run_main(main)
