"""The stock `e2b` SDK through `rollbox lease` (an agent-sandbox pod's container, run here as a
plain process): run by rollbox/tests/e2b/lease.rs with E2B_API_URL and E2B_SANDBOX_URL both
the lease's address, as a client inside the cluster would set them. The lease holds one
sandbox (ROLLBOX_LEASE_SANDBOX); ROLLBOX_E2B_SCRATCH is a directory the agent may write.
Prints `ok NAME` per check; any failure raises and exits non-zero.
"""

import json
import os
import urllib.error
import urllib.request

from e2b import Sandbox

from checks import expect_error, ok

LEASE = os.environ["E2B_SANDBOX_URL"]
HELD = os.environ["ROLLBOX_LEASE_SANDBOX"]
SCRATCH = os.environ["ROLLBOX_E2B_SCRATCH"]


def plain(method, path, body=None):
    """A request with no SDK, no sandbox id and no token, as agent-sandbox's envd client sends."""
    request = urllib.request.Request(LEASE + path, method=method, data=body)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def main():
    # By the alias, with no id to know: the lease's own sandbox.
    sbx = Sandbox.connect("lease")
    assert sbx.sandbox_id == HELD, (sbx.sandbox_id, HELD)
    ok("connect by alias")
    assert Sandbox.connect(HELD).sandbox_id == HELD
    ok("connect by id")

    result = sbx.commands.run("echo hello-through-the-lease")
    assert result.exit_code == 0 and result.stdout.strip() == "hello-through-the-lease", result
    ok("commands.run")

    lines = []
    sbx.commands.run("for i in 1 2 3; do echo line$i; sleep 0.1; done", on_stdout=lines.append)
    assert "".join(lines).split() == ["line1", "line2", "line3"], lines
    ok("a command streams its output")

    handle = sbx.commands.run("sleep 0.3; echo later", background=True)
    assert handle.wait().stdout == "later\n"
    ok("background + wait")

    path = os.path.join(SCRATCH, "through-lease.txt")
    sbx.files.write(path, "written through the lease\n")
    assert sbx.files.read(path) == "written through the lease\n"
    assert any(entry.name == "through-lease.txt" for entry in sbx.files.list(SCRATCH))
    ok("files write, read and list")

    info = sbx.get_info()
    assert info.sandbox_id == HELD, info
    ok("get_info")

    # Another sandbox's routes, and the list, are not this lease's to serve.
    expect_error("connect to another sandbox", lambda: Sandbox.connect("n0-someoneelse"), "403")
    status, body = plain("GET", "/sandboxes")
    assert status == 403 and b"lease of sandbox" in body, (status, body)
    ok("the sandbox list is refused")

    # envd's plain HTTP routes, as agent-sandbox's envd example calls them.
    status, _ = plain("GET", "/health")
    assert status == 204, status
    status, body = plain("GET", "/envs")
    assert status == 200 and isinstance(json.loads(body), dict), (status, body)
    status, body = plain("GET", "/lease")
    assert status == 200 and json.loads(body)["sandboxId"] == HELD, (status, body)
    ok("plain envd routes and /lease")

    print("all ok", flush=True)


if __name__ == "__main__":
    main()
