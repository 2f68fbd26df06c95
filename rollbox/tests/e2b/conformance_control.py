"""E2B control-plane conformance with the stock SDK 2.63 (issue 26), sync and async: the
lifecycle on timeout (pause, auto-resume), the list's filters, metadata keys that are not
label keys (a SQL injection attempt among them), and named snapshots.

test_sdk.py's main calls `run_checks(TEMPLATE)`. Each check prints `ok NAME` only once it
passed; any failure raises.
"""

import asyncio
import datetime
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request

from e2b import AsyncSandbox, Sandbox, SandboxQuery
from e2b.api.client.models.sandbox_state import SandboxState

from checks import expect_error, expect_error_async, ok

API = os.environ["E2B_API_URL"]
KEY = os.environ["E2B_API_KEY"]
# A label key that would be SQL if the store formatted it into its statement, and one that
# runs a recursive CTE without end.
INJECTION = "x\"') = 1 OR 1=1 --"
RECURSIVE = "a\"') IN (WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n+1 FROM r) SELECT n FROM r) --"


def raw(method, path, body=None):
    request = urllib.request.Request(API + path, method=method, data=body)
    request.add_header("X-API-KEY", KEY)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_until(what, check, seconds=60):
    """Polls `check` until it is true; the suite runs on loaded machines, so no fixed sleep."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {seconds} s")


def state_of(sandbox_id):
    return str(Sandbox.get_info(sandbox_id).state)


def run_checks(template):
    lifecycle_checks(template)
    asyncio.run(async_lifecycle(template))
    ok("the async SDK: on_timeout pause with auto_resume, lifecycle in get_info")
    list_filter_checks(template)
    metadata_key_checks(template)
    asyncio.run(async_metadata_keys(template))
    snapshot_name_checks(template)
    asyncio.run(async_snapshot_names(template))
    ok("the async SDK: create_snapshot(name), list_snapshots(name=), delete_snapshot(name)")


def lifecycle_checks(template):
    plain = Sandbox.create(template, timeout=60)
    try:
        assert plain.get_info().lifecycle == {"on_timeout": "kill", "auto_resume": False}, plain.get_info()
    finally:
        plain.kill()
    ok("get_info().lifecycle: kill and no auto_resume by default")

    sbx = Sandbox.create(template, timeout=3, lifecycle={"on_timeout": "pause", "auto_resume": False})
    try:
        assert sbx.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
        wait_until("the TTL pauses it", lambda: state_of(sbx.sandbox_id) == "paused")
        info = sbx.get_info()
        assert info.end_at.timestamp() - time.time() > 86_400, info.end_at
        assert not sbx.is_running(), "without auto_resume a paused sandbox's data plane is 502"
        listed = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert sbx.sandbox_id in [s.sandbox_id for s in listed], listed
        ok("lifecycle on_timeout=pause: the TTL pauses (kept paused, not killed); no auto_resume: 502")
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert state_of(sbx.sandbox_id) == "running"
        left = resumed.get_info().end_at.timestamp() - time.time()
        assert 30 < left <= 61, left
        assert resumed.commands.run("echo back").stdout == "back\n"
        ok("connect resumes a sandbox its TTL paused, with connect's timeout")
    finally:
        sbx.kill()

    woke = Sandbox.create(template, timeout=3, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        assert woke.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
        wait_until("the TTL pauses it", lambda: state_of(woke.sandbox_id) == "paused")
        # Served at all means resumed (its create TTL of 3 s pauses it again soon after).
        assert woke.commands.run("echo woke").stdout == "woke\n"
        ok("lifecycle auto_resume: a command on the paused sandbox resumes it and is served")
    finally:
        woke.kill()

    expect_error(
        "on_timeout pause with mode=filesystem is 400 saying why",
        lambda: Sandbox.create(template, timeout=30, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}}),
        "autoPauseMemory", "not served",
    )
    status, body = raw("POST", "/v2/sandboxes", json.dumps(
        {"templateID": template, "timeout": 30, "autoResume": {"enabled": True}}).encode())
    assert status == 400 and "autoResume" in json.loads(body)["message"], (status, body)
    ok("autoResume without autoPause is 400 naming autoResume")


async def async_lifecycle(template):
    sbx = await AsyncSandbox.create(template, timeout=3, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        info = await sbx.get_info()
        assert info.lifecycle == {"on_timeout": "pause", "auto_resume": True}, info
        deadline = time.monotonic() + 60
        while str((await sbx.get_info()).state) != "paused":
            assert time.monotonic() < deadline, "the TTL did not pause it (async)"
            await asyncio.sleep(0.25)
        assert (await sbx.commands.run("echo async-woke")).stdout == "async-woke\n"
    finally:
        await sbx.kill()


def list_filter_checks(template):
    suite = {"suite": "e2b-filter"}
    made = [Sandbox.create(template, timeout=60, metadata=suite)]
    try:
        time.sleep(0.05)
        middle = datetime.datetime.now(datetime.timezone.utc)
        time.sleep(0.05)
        made.append(Sandbox.create(template, timeout=60, metadata=suite))
        later = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata=suite, started_after=middle)).next_items()]
        assert later == [made[1].sandbox_id], later
        naive = middle.astimezone().replace(tzinfo=None)  # the SDK reads a naive time as local
        local = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata=suite, started_after=naive)).next_items()]
        assert local == later, local
        future = middle + datetime.timedelta(hours=1)
        assert Sandbox.list(query=SandboxQuery(metadata=suite, started_after=future)).next_items() == []
        both = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata=suite, template=template)).next_items()]
        assert both == [made[1].sandbox_id, made[0].sandbox_id], both
        assert Sandbox.list(query=SandboxQuery(metadata=suite, template="no-such-template")).next_items() == []
        ok("list: started_after (aware and naive) and template filters")
        for query, name in [("startedAfter=yesterday", "startedAfter"), ("state=zombie", "state"),
                            ("order=sideways", "order"), ("limit=0", "limit"), ("nextToken=bogus", "nextToken")]:
            status, body = raw("GET", f"/v2/sandboxes?{query}")
            error = json.loads(body)
            assert status == 400 and error["code"] == 400 and error["message"].startswith(name), (query, status, body)
        ok("list: a bad filter value is 400 naming the parameter")
        asyncio.run(async_list_filters(suite, middle, [made[1].sandbox_id]))
        ok("the async SDK's list: started_after and template filters")
    finally:
        for sandbox in made:
            sandbox.kill()


async def async_list_filters(suite, middle, later):
    query = SandboxQuery(metadata=suite, started_after=middle)
    assert [s.sandbox_id for s in await AsyncSandbox.list(query=query).next_items()] == later
    query = SandboxQuery(metadata=suite, template="no-such-template")
    assert await AsyncSandbox.list(query=query).next_items() == []


def metadata_key_checks(template):
    for key in [INJECTION, RECURSIVE]:
        expect_error(
            f"list by metadata key {key[:12]!r}... is 400 naming the key",
            lambda key=key: Sandbox.list(query=SandboxQuery(metadata={key: "1"})).next_items(),
            "metadata", "key", json.dumps(key),
        )
        # As the SDK sends it: each key and value quoted, the pairs encoded, then the parameter.
        metadata = urllib.parse.quote(urllib.parse.urlencode({urllib.parse.quote(key): urllib.parse.quote("1")}))
        started = time.monotonic()
        status, body = raw("GET", f"/v2/sandboxes?metadata={metadata}")
        error = json.loads(body)
        # The message names the key as JSON (and Rust's Debug) quote it.
        assert status == 400 and error["code"] == 400 and json.dumps(key) in error["message"], (status, body)
        assert time.monotonic() - started < 10, "the refusal took long"
    # A value with a space and a percent sign matches as it was given.
    metadata = {"suite": "e2b keys 100%", "app.io/name": "a+b"}
    sbx = Sandbox.create(template, timeout=60, metadata=metadata)
    try:
        listed = Sandbox.list(query=SandboxQuery(metadata=metadata)).next_items()
        assert [s.sandbox_id for s in listed] == [sbx.sandbox_id], listed
    finally:
        sbx.kill()
    ok("after the injection attempts the daemon answers; values with spaces, % and + match")
    expect_error(
        "create with a metadata key that is not a label key is 400 naming metadata",
        lambda: Sandbox.create(template, timeout=30, metadata={INJECTION: "1"}),
        "metadata", "key",
    )


async def async_metadata_keys(template):
    await expect_error_async(
        "the async SDK's list by an injection key is 400 naming the key",
        lambda: AsyncSandbox.list(query=SandboxQuery(metadata={RECURSIVE: "1"})).next_items(),
        "metadata", "key",
    )
    await expect_error_async(
        "the async SDK's create with a bad metadata key is 400",
        lambda: AsyncSandbox.create(template, timeout=30, metadata={INJECTION: "1"}),
        "metadata",
    )


def snapshot_ids(**filters):
    return [s.snapshot_id for s in Sandbox.list_snapshots(**filters).next_items()]


def snapshot_name_checks(template):
    sbx = Sandbox.create(template, timeout=120, envs={"WHICH": "named"})
    try:
        first = sbx.create_snapshot("ctl-base")
        assert first.snapshot_id.startswith("snap-") and first.names == ["ctl-base"], first
        assert snapshot_ids(name="ctl-base") == [first.snapshot_id]
        restored = Sandbox.create("ctl-base", timeout=60)
        try:
            assert restored.commands.run('echo "$WHICH"').stdout == "named\n"
        finally:
            restored.kill()
        ok("create_snapshot(name), list_snapshots(name=), Sandbox.create(name)")
        second = sbx.create_snapshot("ctl-base")
        assert second.snapshot_id != first.snapshot_id and second.names == ["ctl-base"], second
        assert snapshot_ids(name="ctl-base") == [second.snapshot_id]
        assert snapshot_ids(name=first.snapshot_id) == [first.snapshot_id]
        old = [s for s in Sandbox.list_snapshots().next_items() if s.snapshot_id == first.snapshot_id]
        assert [s.names for s in old] == [[first.snapshot_id]], old
        ok("a second snapshot of one name takes the name over; the first keeps its id")
        expect_error("a bad snapshot name is 400 naming name", lambda: sbx.create_snapshot("Bad Name!"), "name")
        expect_error("a snapshot named like a template is refused", lambda: sbx.create_snapshot(template), "template")
        assert Sandbox.delete_snapshot("ctl-base")
        assert not Sandbox.delete_snapshot("ctl-base")
        assert Sandbox.delete_snapshot(first.snapshot_id)
        assert snapshot_ids(name="ctl-base") == []
        ok("delete_snapshot by name, and again is False")
    finally:
        sbx.kill()


async def async_snapshot_names(template):
    sbx = await AsyncSandbox.create(template, timeout=120)
    try:
        snap = await sbx.create_snapshot("ctl-async")
        assert snap.names == ["ctl-async"], snap
        listed = await AsyncSandbox.list_snapshots(name="ctl-async").next_items()
        assert [s.snapshot_id for s in listed] == [snap.snapshot_id], listed
        restored = await AsyncSandbox.create("ctl-async", timeout=60)
        try:
            assert (await restored.commands.run("echo async-named")).stdout == "async-named\n"
        finally:
            await restored.kill()
        assert await AsyncSandbox.delete_snapshot("ctl-async")
        assert not await AsyncSandbox.delete_snapshot("ctl-async")
    finally:
        await sbx.kill()
