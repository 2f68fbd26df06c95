"""The E2B data plane as a security boundary, with the stock SDK (issue 25): a sandbox made
with `network={"allow_public_traffic": False}` has a `traffic_access_token` and its other
ports answer 403 without it; a public one answers anyone; the host's key and cookies do not
reach the guest and the guest's Set-Cookie does not come back; uploads (multipart, gzip)
stream; `files.list` past its entry cap raises InvalidArgument naming the cap. Sync and async.
Called from test_sdk.py (`run_checks()`).
"""

import asyncio
import http.server
import json
import os
import shutil
import threading
import urllib.error
import urllib.request

from e2b import AsyncSandbox, Sandbox

from checks import expect_error, expect_error_async, ok

TEMPLATE = os.environ["ROLLBOX_E2B_TEMPLATE"]
SCRATCH = os.environ["ROLLBOX_E2B_SCRATCH"]
SANDBOX_URL = os.environ["E2B_SANDBOX_URL"]
KEY = os.environ["E2B_API_KEY"]
# ListDir's entry cap (rollbox/src/daemon/frontend/e2b/filesystem.rs MAX_LIST_ENTRIES).
LIST_CAP = 50_000


class HeaderEcho(http.server.BaseHTTPRequestHandler):
    """Answers its request headers as JSON, and sets a cookie for the whole domain."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        body = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()
        self.send_response(200)
        self.send_header("Set-Cookie", "guest=1; Domain=e2b.test; Path=/")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def guest_get(sandbox_id, port, headers):
    """GET / of a sandbox port through the data plane: (status, body, answer headers)."""
    request = urllib.request.Request(SANDBOX_URL + "/", method="GET")
    request.add_header("E2b-Sandbox-Id", sandbox_id)
    request.add_header("E2b-Sandbox-Port", str(port))
    for name, value in headers.items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, response.read(), response.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


def port_checks(private_id, token, public_id, port):
    status, body, _ = guest_get(private_id, port, {})
    assert status == 403 and b"e2b-traffic-access-token" in body, (status, body)
    status, body, _ = guest_get(private_id, port, {"e2b-traffic-access-token": "wrong"})
    assert status == 403, (status, body)
    status, body, headers = guest_get(private_id, port, {
        "e2b-traffic-access-token": token,
        "X-API-KEY": KEY,
        "Cookie": "session=host",
        "X-Custom": "kept",
    })
    assert status == 200, (status, body)
    seen = json.loads(body)
    assert seen.get("x-custom") == "kept", seen
    for name in ("x-api-key", "cookie", "e2b-traffic-access-token", "x-access-token"):
        assert name not in seen, (name, seen)
    assert KEY not in body.decode() and token not in body.decode(), seen
    assert headers.get("Set-Cookie") is None, dict(headers)
    status, body, _ = guest_get(public_id, port, {})
    assert status == 200, (status, body)


def big_directory():
    """A directory (on this host: the host agent's files are ours) whose depth-2 listing is
    over the entry cap, and whose depth-1 listing is two entries."""
    # On tmpfs where there is one: 50,000 files on a disk take seconds to make.
    base = "/dev/shm" if os.path.isdir("/dev/shm") else SCRATCH
    top = os.path.join(base, f"rollbox-list-cap-{os.getpid()}")
    if not os.path.isdir(top):
        for sub, count in (("a", LIST_CAP // 2 + 1), ("b", LIST_CAP // 2 + 1)):
            os.makedirs(os.path.join(top, sub))
            for i in range(count):
                open(os.path.join(top, sub, str(i)), "wb").close()
    return top


def run_checks():
    service = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HeaderEcho)
    threading.Thread(target=service.serve_forever, daemon=True).start()
    port = service.server_address[1]
    top = None
    private = Sandbox.create(TEMPLATE, timeout=120, network={"allow_public_traffic": False})
    public = Sandbox.create(TEMPLATE, timeout=120)
    try:
        token = private.traffic_access_token
        assert isinstance(token, str) and len(token) == 32, token
        assert public.traffic_access_token is None, public.traffic_access_token
        ok("allow_public_traffic=False gives a traffic_access_token")
        port_checks(private.sandbox_id, token, public.sandbox_id, port)
        ok("other ports: 403 without the traffic token, 200 with it or when public; no key, cookie or Set-Cookie across")

        base = f"{SCRATCH}/{private.sandbox_id}"
        data = bytes(range(256)) * (32 << 10)  # 8 MiB
        private.files.write(f"{base}/big.bin", data)
        assert private.files.read(f"{base}/big.bin", format="bytes") == data
        ok("an 8 MiB multipart upload streams whole")
        private.files.write(f"{base}/big-gz.bin", data, gzip=True)
        assert private.files.read(f"{base}/big-gz.bin", format="bytes") == data
        ok("an 8 MiB gzip upload (octet-stream) decodes whole")
        top = big_directory()
        assert sorted(e.name for e in private.files.list(top)) == ["a", "b"]
        expect_error("files.list past the entry cap", lambda: private.files.list(top, depth=2),
                     "InvalidArgument", f"{LIST_CAP} entries", "depth")
        asyncio.run(async_checks(private.sandbox_id, port, public.sandbox_id, top))
    finally:
        private.kill()
        public.kill()
        service.shutdown()
        service.server_close()
        if top:
            shutil.rmtree(top, ignore_errors=True)


async def async_checks(private_id, port, public_id, top):
    sbx = await AsyncSandbox.create(TEMPLATE, timeout=60, network={"allow_public_traffic": False})
    try:
        token = sbx.traffic_access_token
        assert isinstance(token, str) and len(token) == 32, token
        status, _, _ = await asyncio.to_thread(guest_get, sbx.sandbox_id, port, {})
        assert status == 403, status
        status, _, _ = await asyncio.to_thread(
            guest_get, sbx.sandbox_id, port, {"e2b-traffic-access-token": token})
        assert status == 200, status
        ok("allow_public_traffic=False (async): 403 without the traffic token, 200 with it")
        connected = await AsyncSandbox.connect(private_id)
        await expect_error_async("files.list past the entry cap (async)",
                                 lambda: connected.files.list(top, depth=2),
                                 "InvalidArgument", f"{LIST_CAP} entries")
    finally:
        await sbx.kill()
