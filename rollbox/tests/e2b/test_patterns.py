"""AReaL's and Harbor's E2B call patterns against rollbox (shared/docs/e2b-compat.md 3c),
replayed with the stock SDKs (e2b 2.63.0, e2b-code-interpreter 2.11.5): run by
rollbox/tests/e2b.rs beside test_code_interpreter.py. Prints `ok NAME`; failures exit non-zero.
"""

import asyncio
import os
import sys

from e2b import AsyncSandbox as PlainAsyncSandbox
from e2b import ConnectionConfig
from e2b.api import ApiClient
from e2b.api.client.api.sandboxes import post_sandboxes
from e2b.api.client.models import NewSandbox
from e2b_code_interpreter import AsyncSandbox

TEMPLATE = os.environ["ROLLBOX_E2B_TEMPLATE"]
SCRATCH = os.environ["ROLLBOX_E2B_SCRATCH"]
API = os.environ["E2B_API_URL"]
KEY = os.environ["E2B_API_KEY"]


def ok(name):
    print(f"ok {name}", flush=True)


async def areal():
    # areal/infra/sandbox/e2b_sandbox.py: explicit api_url/api_key, run_code, commands.run.
    sbx = await AsyncSandbox.create(api_url=API, api_key=KEY, template=TEMPLATE, timeout=60)
    try:
        execution = await sbx.run_code("sum(range(10))", timeout=30)
        assert execution.text == "45", execution
        result = await sbx.commands.run("echo areal", timeout=30)
        assert result.stdout == "areal\n", result
        # Its close() calls AsyncSandbox.close(), which does not exist: the TTL reaps it.
        assert not hasattr(sbx, "close")
    finally:
        await sbx.kill()
    ok("AReaL: AsyncSandbox.create(api_url, api_key), run_code, commands.run")

    # areal/infra/sandbox/cube_sandbox.py: the generated v1 client, NewSandbox(secure=True, ...).
    client = ApiClient(ConnectionConfig(api_url=API, api_key=KEY))
    response = post_sandboxes.sync_detailed(
        client=client,
        body=NewSandbox(template_id=TEMPLATE, timeout=60, secure=True, auto_pause=False, allow_internet_access=True),
    )
    assert response.status_code == 201, (response.status_code, response.content)
    sandbox_id = response.parsed.sandbox_id
    assert response.parsed.domain and response.parsed.envd_version
    await PlainAsyncSandbox.kill(sandbox_id)
    ok("AReaL cube: low-level POST /sandboxes with secure/auto_pause/allow_internet_access")


async def harbor():
    # harbor/environments/e2b.py with prebuilt_template_id: the template is a rollbox template.
    sbx = await PlainAsyncSandbox.create(
        template=TEMPLATE,
        metadata={"harbor": "trial-1"},
        envs={"TASK": "t1"},
        timeout=3600,
        allow_internet_access=False,
    )
    try:
        await sbx.set_timeout(3600)  # its renewal loop
        handle = await sbx.commands.run(
            'sleep 0.5; echo "$TASK" "$STEP"; pwd', background=True, cwd="/tmp", envs={"STEP": "s1"},
            timeout=0, user="root",
        )
        pid = handle.pid
        await handle.disconnect()  # a dropped stream: Harbor reconnects by pid
        again = await sbx.commands.connect(pid)
        result = await again.wait()
        assert result.stdout == "t1 s1\n/tmp\n", result
        ok("Harbor: background run (cwd, envs, timeout=0, user root), drop, connect(pid), wait")
        base = f"{SCRATCH}/{sbx.sandbox_id}"
        await sbx.files.write(f"{base}/in.bin", b"\x00bytes", user="root")
        assert await sbx.files.read(f"{base}/in.bin", format="bytes", user="root") == bytearray(b"\x00bytes")
        assert await sbx.files.read(f"{base}/in.bin", format="text", user="root") == "\x00bytes"
        chunks = b"".join([c async for c in await sbx.files.read(f"{base}/in.bin", format="stream", user="root")])
        assert chunks == b"\x00bytes", chunks
        info = await sbx.files.get_info(f"{base}/in.bin")
        assert info.size == 6, info
        ok("Harbor: files write (bytes, root), read bytes/text/stream, get_info")
        try:
            await sbx.update_network({"allow_out": ["1.1.1.1"]})
            raise AssertionError("update_network succeeded")
        except Exception as e:  # noqa: BLE001 - the SDK's exception type
            assert "has no network" in str(e), e
        ok("Harbor: update_network of a sandbox whose template has no network is refused naming it")
    finally:
        await sbx.kill()


async def main():
    await areal()
    await harbor()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except Exception:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        sys.exit(1)
    print("all ok", flush=True)
    # Every check passed. Leave without interpreter finalisation: a native extension among
    # the SDK's dependencies sometimes aborts there, after the run is over ("Fatal Python
    # error: Aborted" with no Python frame; about 1 run in 10 of test_patterns.py).
    sys.stderr.flush()
    os._exit(0)
