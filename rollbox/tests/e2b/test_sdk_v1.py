"""The stock `e2b` SDK 1.11.1 against rollbox: run by rollbox/tests/e2b.rs.

SDK 1.x ignores E2B_API_URL and E2B_SANDBOX_URL and sends no E2b-Sandbox-* headers: it calls
`https://api.{domain}` and `https://{port}-{id}.{domain}`, so it needs wildcard DNS for the
domain and TLS on port 443. This machine has no wildcard DNS, so the test stands in for it:
names under E2B_DOMAIN resolve to 127.0.0.1 at ROLLBOX_E2B_PORT (a getaddrinfo wrapper
installed before the SDK is imported; the SDK itself is unchanged). TLS is real (SSL_CERT_FILE).
SDK 1.x always names a user, "user" by default; the host agent's machine has none, so the
calls here name root. Environment as test_sdk.py plus ROLLBOX_E2B_PORT. Prints `ok NAME`.
"""

import importlib.metadata
import os
import socket
import sys
import time

DOMAIN = os.environ["E2B_DOMAIN"]
PORT = int(os.environ["ROLLBOX_E2B_PORT"])
_getaddrinfo = socket.getaddrinfo


def wildcard_dns(host, port, *args, **kwargs):
    if isinstance(host, str) and (host == DOMAIN or host.endswith("." + DOMAIN)):
        return _getaddrinfo("127.0.0.1", PORT, *args, **kwargs)
    return _getaddrinfo(host, port, *args, **kwargs)


socket.getaddrinfo = wildcard_dns

from e2b import CommandExitException, Sandbox  # noqa: E402 - after the DNS stand-in

TEMPLATE = os.environ["ROLLBOX_E2B_TEMPLATE"]
SCRATCH = os.environ["ROLLBOX_E2B_SCRATCH"]
ROOT = "root"


def ok(name):
    print(f"ok {name}", flush=True)


def main():
    print(f"e2b SDK {importlib.metadata.version('e2b')}", flush=True)
    sbx = Sandbox(template=TEMPLATE, timeout=120, metadata={"suite": "v1"}, envs={"GREETING": "hi"})
    ok(f"create {sbx.sandbox_id} (POST /sandboxes, host-routed data plane)")
    try:
        seen = []
        result = sbx.commands.run('echo "$GREETING"', on_stdout=seen.append, user=ROOT)
        assert result.stdout == "hi\n" and "".join(seen) == "hi\n", (result, seen)
        ok("run foreground with on_stdout and envVars")
        try:
            sbx.commands.run("exit 3", user=ROOT)
            raise AssertionError("exit 3 did not raise")
        except CommandExitException as e:
            assert e.exit_code == 3, e
        ok("non-zero exit raises")
        handle = sbx.commands.run("sleep 0.3; echo bg", background=True, user=ROOT)
        assert handle.wait().stdout == "bg\n"
        ok("background + wait")
        path = f"{SCRATCH}/{sbx.sandbox_id}/v1.txt"
        sbx.files.write(path, "one", ROOT)  # 1.x takes the user positionally here
        assert sbx.files.read(path, user=ROOT) == "one"
        assert [e.name for e in sbx.files.list(os.path.dirname(path), user=ROOT)] == ["v1.txt"]
        ok("files write/read/list")
        sbx.set_timeout(200)
        left = sbx.get_info().end_at.timestamp() - time.time()
        assert 150 < left <= 201, left
        ok("set_timeout and get_info")
        listed = [s.sandbox_id for s in Sandbox.list()]
        assert sbx.sandbox_id in listed, listed
        ok("list (GET /sandboxes)")
        same = Sandbox.connect(sbx.sandbox_id)
        assert same.commands.run("echo again", user=ROOT).stdout == "again\n"
        ok("connect (GET /sandboxes/{id})")
    finally:
        sbx.kill()
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list()]
    ok("kill")


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        sys.exit(1)
    print("all ok", flush=True)
