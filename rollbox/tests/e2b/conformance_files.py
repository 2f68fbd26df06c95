"""envd data-plane conformance checks (sync and async), called from test_sdk.py's main:
writes fire envd's watch events, file metadata (envd 0.6.2), watch events with their entry
(0.6.3) and watches with network mounts allowed (0.6.4), signed `/files` URLs, and a command
whose sandbox is killed under it. Each check prints `ok NAME` only once it passed. They need
the pinned SDK (2.63); older ones (test_sdk.py also runs with 2.50) print `skip` instead.
"""

import asyncio
import importlib.metadata
import os
import pwd
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import e2b
from e2b import AsyncSandbox, FilesystemEventType, InvalidArgumentException, Sandbox

from checks import ok

# Not imported from test_sdk: that module runs as __main__ and imports this one.
TEMPLATE = os.environ["ROLLBOX_E2B_TEMPLATE"]
SCRATCH = os.environ["ROLLBOX_E2B_SCRATCH"]
T = FilesystemEventType


def supported():
    """Whether this SDK has what these checks use (file metadata, include_entry,
    SandboxNotRunningException): 2.63, the pinned one; else a `skip` line says why."""
    version = importlib.metadata.version("e2b")
    if tuple(int(p) for p in version.split(".")[:2]) >= (2, 63):
        return True
    print(f"skip the envd conformance checks: e2b {version} predates them", flush=True)
    return False


def settle(poll, wanted, what, quiet=0.7):
    """Polls `poll()` (a list of new events) until every (name, type) in `wanted` was seen and
    then `quiet` seconds pass without more; returns every event seen."""
    seen = []
    deadline = time.time() + 20
    while not wanted <= {(e.name, e.type) for e in seen}:
        assert time.time() < deadline, f"{what}: {wanted} not all in {[(e.name, e.type) for e in seen]}"
        seen.extend(poll())
        time.sleep(0.05)
    end = time.time() + quiet
    while time.time() < end:
        seen.extend(poll())
        time.sleep(0.05)
    return seen


def check_write_events(sbx, base, host=True):
    """A write is envd's: the file itself, given to the user and truncated, so a new file is
    CREATE + CHMOD (the chown) + WRITE of its own name, an overwrite CHMOD + WRITE; no
    temporary name, no RENAME. `host`: the files are on this host (the host agent), so their
    owners are checked here too."""
    watched = f"{base}/write-events"
    sbx.files.make_dir(watched)
    watcher = sbx.files.watch_dir(watched)
    sbx.files.write(f"{watched}/new.txt", "one")
    new = {("new.txt", T.CREATE), ("new.txt", T.CHMOD), ("new.txt", T.WRITE)}
    events = settle(watcher.get_new_events, new, "a new file")
    assert {(e.name, e.type) for e in events} == new, [(e.name, e.type) for e in events]
    sbx.files.write(f"{watched}/new.txt", "two, longer")
    over = {("new.txt", T.CHMOD), ("new.txt", T.WRITE)}
    events = settle(watcher.get_new_events, over, "an overwrite")
    assert {(e.name, e.type) for e in events} == over, [(e.name, e.type) for e in events]
    assert sbx.files.read(f"{watched}/new.txt") == "two, longer"
    watcher.stop()
    if not host:
        ok("files.write fires envd's events: CREATE+CHMOD+WRITE of a new file, CHMOD+WRITE of an overwrite, no temp names")
        return
    # The file is given to the request's user, as envd does. The scratch directory is on this
    # host (the host agent), so its owner is seen here.
    sbx.files.write(f"{watched}/nobody.txt", "n", user="nobody")
    assert os.stat(f"{watched}/nobody.txt").st_uid == pwd.getpwnam("nobody").pw_uid
    sbx.files.write(f"{watched}/nobody.txt", "root's now")
    assert os.stat(f"{watched}/nobody.txt").st_uid == 0
    ok("files.write fires envd's events: CREATE+CHMOD+WRITE of a new file, CHMOD+WRITE of an overwrite, no temp names; the file is the user's")


async def async_write_events(sandbox_id, watched):
    sandbox = await AsyncSandbox.connect(sandbox_id)
    queue = []
    handle = await sandbox.files.watch_dir(watched, on_event=queue.append, timeout=0)

    def poll():
        taken = list(queue)
        queue.clear()
        return taken

    async def settle_async(wanted, what):
        seen = []
        deadline = time.time() + 20
        while not wanted <= {(e.name, e.type) for e in seen}:
            assert time.time() < deadline, f"{what}: {wanted} not in {[(e.name, e.type) for e in seen]}"
            seen.extend(poll())
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.7)
        return seen + poll()

    await sandbox.files.write(f"{watched}/anew.txt", "one")
    new = {("anew.txt", T.CREATE), ("anew.txt", T.CHMOD), ("anew.txt", T.WRITE)}
    events = await settle_async(new, "async new file")
    assert {(e.name, e.type) for e in events} == new, [(e.name, e.type) for e in events]
    await sandbox.files.write(f"{watched}/anew.txt", "two")
    over = {("anew.txt", T.CHMOD), ("anew.txt", T.WRITE)}
    events = await settle_async(over, "async overwrite")
    assert {(e.name, e.type) for e in events} == over, [(e.name, e.type) for e in events]
    await handle.stop()


def check_metadata(sbx, base):
    """files.write(metadata=...) keeps it as user.e2b.* xattrs: the write's answer, get_info,
    list and rename show it; an overwrite without metadata clears it; bad keys are refused."""
    folder = f"{base}/meta"
    path = f"{folder}/m.txt"
    info = sbx.files.write(path, "x", metadata={"Owner": "alice", "tag": "a b"})
    want = {"owner": "alice", "tag": "a b"}
    assert info.metadata == want, info
    assert sbx.files.get_info(path).metadata == want
    listed = {e.name: e.metadata for e in sbx.files.list(folder)}
    assert listed == {"m.txt": want}, listed
    moved = sbx.files.rename(path, f"{folder}/moved.txt")
    assert moved.metadata == want, moved
    assert sbx.files.get_info(f"{folder}/moved.txt").metadata == want
    again = sbx.files.write(f"{folder}/moved.txt", "y")
    assert again.metadata is None, again
    assert sbx.files.get_info(f"{folder}/moved.txt").metadata is None
    infos = sbx.files.write_files(
        [{"path": f"{folder}/one", "data": "1"}, {"path": f"{folder}/two", "data": b"2"}],
        metadata={"batch": "7"},
    )
    assert [i.metadata for i in infos] == [{"batch": "7"}] * 2, infos
    assert sbx.files.get_info(f"{folder}/two").metadata == {"batch": "7"}
    try:
        sbx.files.write(f"{folder}/bad", "z", metadata={"bad key": "v"})
        raise AssertionError("a metadata key with a space was accepted")
    except InvalidArgumentException:
        pass
    # The server's own check, past the SDK's: a value that is not printable US-ASCII.
    status, body = raw_files(sbx, "POST", f"{folder}/bad", b"z", token=True,
                             headers={"X-Metadata-Note": "caf\u00e9".encode("latin-1")})
    assert status == 400 and b"x-metadata-note" in body and b"US-ASCII" in body, (status, body)
    ok("file metadata: written, shown by get_info/list/rename, cleared by an overwrite, bad values 400")


async def async_metadata(sandbox_id, folder):
    sandbox = await AsyncSandbox.connect(sandbox_id)
    path = f"{folder}/async.txt"
    info = await sandbox.files.write(path, "x", metadata={"k": "v"})
    assert info.metadata == {"k": "v"}, info
    assert (await sandbox.files.get_info(path)).metadata == {"k": "v"}
    assert {e.name: e.metadata for e in await sandbox.files.list(folder)}["async.txt"] == {"k": "v"}
    await sandbox.files.write(path, "y")
    assert (await sandbox.files.get_info(path)).metadata is None
    try:
        await sandbox.files.write(path, "z", metadata={"": "v"})
        raise AssertionError("an empty metadata key was accepted")
    except InvalidArgumentException:
        pass


def check_watch_entry_and_mounts(sbx, base):
    """include_entry (0.6.3): CREATE/WRITE events carry the entry; allow_network_mounts
    (0.6.4) is accepted (a local directory is watched either way)."""
    watched = f"{base}/entries"
    sbx.files.make_dir(watched)
    watcher = sbx.files.watch_dir(watched, include_entry=True, allow_network_mounts=True)
    sbx.files.write(f"{watched}/e.txt", "entry", metadata={"m": "1"})
    events = settle(watcher.get_new_events, {("e.txt", T.CREATE), ("e.txt", T.WRITE)}, "include_entry")
    with_entry = [e for e in events if e.type == T.WRITE and e.entry is not None]
    assert with_entry, [(e.name, e.type, e.entry) for e in events]
    entry = with_entry[-1].entry
    assert entry.name == "e.txt" and entry.path == f"{watched}/e.txt", entry
    watcher.stop()
    plain = sbx.files.watch_dir(watched)
    sbx.files.write(f"{watched}/f.txt", "plain")
    events = settle(plain.get_new_events, {("f.txt", T.CREATE)}, "no include_entry")
    assert all(e.entry is None for e in events), events
    plain.stop()
    ok("watch_dir(include_entry=True) events carry the entry; allow_network_mounts is accepted")


async def async_watch_entry(sandbox_id, watched):
    sandbox = await AsyncSandbox.connect(sandbox_id)
    events = asyncio.Queue()
    handle = await sandbox.files.watch_dir(watched, on_event=events.put_nowait, timeout=0,
                                           include_entry=True, allow_network_mounts=True)
    await sandbox.files.write(f"{watched}/ae.txt", "a")
    while True:
        event = await asyncio.wait_for(events.get(), 20)
        if event.name == "ae.txt" and event.type == T.CREATE:
            assert event.entry is not None and event.entry.name == "ae.txt", event
            break
    await handle.stop()


def raw_files(sbx, method, path, body=None, token=False, url=None, headers=None):
    """A plain HTTP request to envd's /files (routed by the E2b-Sandbox-Id header, as the
    gateway of these tests is E2B_SANDBOX_URL): (status, body). `url` is a whole signed URL."""
    if url is None:
        query = urllib.parse.urlencode({"path": path})
        url = f"{sbx.envd_api_url}/files?{query}"
    request = urllib.request.Request(url, method=method, data=body)
    request.add_header("E2b-Sandbox-Id", sbx.sandbox_id)
    if token:
        request.add_header("X-Access-Token", sbx._envd_access_token)
    if method == "POST":
        request.add_header("Content-Type", "application/octet-stream")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def upload(sbx, url, data):
    return raw_files(sbx, "POST", None, body=data, url=url)


def check_signed_urls(sbx, base):
    """download_url()/upload_url() of a secure sandbox: signed, used without the token header;
    expired, tampered, or used for the other operation: 401."""
    assert sbx._envd_access_token, "the sandbox has no envd access token"
    path = f"{base}/signed/s.txt"
    status, _ = upload(sbx, sbx.upload_url(path, use_signature_expiration=60), b"signed upload")
    assert status == 200, status
    assert sbx.files.read(path) == "signed upload"
    for url in (sbx.download_url(path), sbx.download_url(path, use_signature_expiration=60)):
        status, body = raw_files(sbx, "GET", None, url=url)
        assert (status, body) == (200, b"signed upload"), (status, body)
    status, _ = upload(sbx, sbx.upload_url(path), b"unexpiring")
    assert status == 200 and sbx.files.read(path) == "unexpiring", status

    expired = sbx.download_url(path, use_signature_expiration=-5)
    status, body = raw_files(sbx, "GET", None, url=expired)
    assert status == 401 and b"expired" in body, (status, body)
    good = sbx.download_url(path, use_signature_expiration=60)
    parts = urllib.parse.urlsplit(good)
    query = dict(urllib.parse.parse_qsl(parts.query))
    for name, value in [
        ("signature", query["signature"][:-1] + ("A" if query["signature"][-1] != "A" else "B")),
        ("path", f"{base}/signed/other.txt"),
        ("username", "root"),
        ("signature_expiration", str(int(query["signature_expiration"]) + 100)),
    ]:
        tampered = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode({**query, name: value})))
        status, body = raw_files(sbx, "GET", None, url=tampered)
        assert status == 401 and b"invalid" in body, (name, status, body)
    # A read signature does not write, and no signature at all is refused.
    status, body = upload(sbx, good, b"overwritten?")
    assert status == 401, (status, body)
    status, body = raw_files(sbx, "GET", path)
    assert status == 401, (status, body)
    assert sbx.files.read(path) == "unexpiring"
    ok("signed download_url/upload_url work without the token; expired, tampered, wrong-operation ones are 401")


async def async_signed_urls(sandbox_id, path):
    sandbox = await AsyncSandbox.connect(sandbox_id)
    url = sandbox.upload_url(path, use_signature_expiration=30)
    status, _ = await asyncio.to_thread(upload, sandbox, url, b"async signed")
    assert status == 200, status
    url = sandbox.download_url(path, use_signature_expiration=30)
    status, body = await asyncio.to_thread(raw_files, sandbox, "GET", None, None, False, url)
    assert (status, body) == (200, b"async signed"), (status, body)
    url = sandbox.download_url(path, use_signature_expiration=-1)
    status, _ = await asyncio.to_thread(raw_files, sandbox, "GET", None, None, False, url)
    assert status == 401, status


def expect_killed(what, started, error):
    assert isinstance(error, e2b.SandboxNotRunningException), f"{what}: {type(error).__name__}: {error}"
    assert "was not found" in str(error), f"{what}: {error}"
    assert time.time() - started < 15, f"{what}: took {time.time() - started:.1f} s"


def check_killed_commands():
    """A command whose sandbox is killed (from another handle) raises
    SandboxNotRunningException: a background handle's wait(), and a foreground run."""
    sbx = Sandbox.create(TEMPLATE, timeout=60)
    try:
        handle = sbx.commands.run("sleep 30", background=True)
        started = time.time()
        assert Sandbox.kill(sbx.sandbox_id)
        try:
            handle.wait()
            raise AssertionError("wait() returned after the sandbox was killed")
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001 - the type is the check
            expect_killed("background wait", started, e)
    finally:
        sbx.kill()
    sbx = Sandbox.create(TEMPLATE, timeout=60)
    try:
        killer = threading.Timer(1.0, lambda: Sandbox.kill(sbx.sandbox_id))
        started = time.time()
        killer.start()
        try:
            sbx.commands.run("sleep 30")
            raise AssertionError("run() returned after the sandbox was killed")
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001
            expect_killed("foreground run", started, e)
        killer.join()
    finally:
        sbx.kill()
    ok("a command whose sandbox is killed raises SandboxNotRunningException (wait and run)")


async def async_killed_commands():
    sandbox = await AsyncSandbox.create(TEMPLATE, timeout=60)
    try:
        handle = await sandbox.commands.run("sleep 30", background=True)
        started = time.time()
        assert await AsyncSandbox.kill(sandbox.sandbox_id)
        try:
            await handle.wait()
            raise AssertionError("wait() returned after the sandbox was killed")
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001
            expect_killed("async background wait", started, e)
    finally:
        await sandbox.kill()
    sandbox = await AsyncSandbox.create(TEMPLATE, timeout=60)
    try:
        async def kill_soon():
            await asyncio.sleep(1.0)
            await AsyncSandbox.kill(sandbox.sandbox_id)

        started = time.time()
        killer = asyncio.create_task(kill_soon())
        try:
            await sandbox.commands.run("sleep 30")
            raise AssertionError("run() returned after the sandbox was killed")
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001
            expect_killed("async foreground run", started, e)
        await killer
    finally:
        await sandbox.kill()


def file_checks(sbx):
    """Every check on the running `sbx` (files under SCRATCH), sync then async."""
    if not supported():
        return
    base = f"{SCRATCH}/{sbx.sandbox_id}-conformance"
    sbx.files.make_dir(base)
    check_write_events(sbx, base)
    asyncio.run(async_write_events(sbx.sandbox_id, f"{base}/write-events"))
    ok("the async SDK: the same events from a WatchDir stream")
    check_metadata(sbx, base)
    asyncio.run(async_metadata(sbx.sandbox_id, f"{base}/meta"))
    ok("the async SDK: file metadata")
    check_watch_entry_and_mounts(sbx, base)
    asyncio.run(async_watch_entry(sbx.sandbox_id, f"{base}/entries"))
    ok("the async SDK: watch_dir(include_entry=True, allow_network_mounts=True)")
    check_signed_urls(sbx, base)
    asyncio.run(async_signed_urls(sbx.sandbox_id, f"{base}/signed/async.txt"))
    ok("the async SDK: signed URLs")
    sbx.files.remove(base)


def killed_checks():
    """Each makes and kills sandboxes of its own."""
    if not supported():
        return
    check_killed_commands()
    asyncio.run(async_killed_commands())
    ok("the async SDK: a command whose sandbox is killed raises SandboxNotRunningException")
