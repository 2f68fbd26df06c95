"""The AsyncClient against a live daemon: every call, and its error paths."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
from typing import AsyncIterator

import pytest

from rollbox_sdk import AsyncClient, BadRequest, Conflict, NotFound, Unauthorized

pytestmark = pytest.mark.live


def test_async_everything(kernel: str, cmdline: str, scratch: str, template: str, tag: str) -> None:
    asyncio.run(everything(kernel, cmdline, scratch, template, tag))


async def everything(kernel: str, cmdline: str, scratch: str, template: str, tag: str) -> None:
    async with AsyncClient() as rb:
        assert await rb.healthz() == {"status": "ok"}
        assert "rollbox_sandboxes" in await rb.metrics()
        async with AsyncClient(socket=rb.config.socket, api_key="nope") as bad:
            with pytest.raises(Unauthorized):
                await bad.list_templates()

        added = await rb.add_template("sdk-async", kernel, cmdline=cmdline, memory_mib=32)
        assert await rb.get_template("sdk-async") == added
        assert "sdk-async" in [t.name for t in await rb.list_templates()]
        await rb.delete_template("sdk-async")
        with pytest.raises(NotFound):
            await rb.get_template("sdk-async")
        with pytest.raises(BadRequest) as caught:
            await rb.add_template("sdk-async", kernel, vcpus=0)
        assert caught.value.field == "vcpus"

        labels = {"test": tag}
        sb = await rb.create_sandbox(template, ttl_s=300, labels=labels, env={"E": "e1"})
        with pytest.raises(BadRequest) as caught:
            await rb.create_sandbox(template, ttl_s=0)
        assert caught.value.field == "ttl_s"
        batch = await rb.create_batch(2, template, ttl_s=120, labels={**labels, "b": "1"})
        assert all(item.ok for item in batch)
        assert (await rb.get_sandbox(sb)).state == "running"
        page = await rb.list_sandboxes_page(labels=labels, limit=1)
        assert [s.id for s in page.sandboxes] == [sb.id] and page.next_page_token
        listed = [s.id async for s in rb.list_sandboxes(labels=labels, page_size=2)]
        assert listed == [sb.id] + [item.sandbox.id for item in batch if item.sandbox]
        assert len(await rb.delete_sandboxes(labels={**labels, "b": "1"})) == 2
        assert (await rb.keepalive(sb, 900)).expires_at_ms > sb.expires_at_ms
        assert (await rb.pause(sb)).state == "paused"
        assert (await rb.resume(sb)).state == "running"
        assert (await rb.usage(sb)).sandbox == sb.id

        result = await rb.run(sb, "echo $E; cat", stdin=b"in")
        assert (result.exit_code, result.stdout) == (0, "e1\nin")
        with pytest.raises(BadRequest) as caught:
            await rb.run(sb, [])
        assert caught.value.field == "cmd"
        runs = await asyncio.gather(*(rb.run(sb, ["echo", str(i)]) for i in range(4)))
        assert [r.stdout for r in runs] == [f"{i}\n" for i in range(4)]

        async with rb.stream(sb, ["cat"], stdin_open=True) as proc:
            assert proc.pid > 0
            await proc.write_stdin("a\n")
            await proc.close_stdin()
            events = [event async for event in proc]
        assert [e.seq for e in events] == list(range(len(events)))
        assert b"".join(e.data for e in events if e.type == "stdout") == b"a\n"
        assert events[-1].exit and events[-1].exit.exit_code == 0
        async with rb.stream(sb, ["sleep", "30"]) as proc:
            with pytest.raises(Conflict):
                await rb.write_stdin(sb, proc.pid, b"x")
            await proc.signal("TERM")
            assert (await proc.wait()).signal == 15
        async with rb.stream(sb, ["sleep", "30"], stdin_open=True) as proc:
            await rb.close_stdin(sb, proc.pid)
            await rb.signal(sb, proc.pid, "SIGKILL")
            assert (await proc.wait()).signal == 9
        with pytest.raises(NotFound):
            await rb.stream("sb-00000000000000ab", "true").start()

        base = os.path.join(scratch, "async")
        assert (await rb.write_file(sb, f"{base}/f", b"data", parents=True)).bytes == 4
        assert await rb.read_file(sb, f"{base}/f") == b"data"

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(3):
                yield bytes([65 + i]) * 100000

        assert (await rb.write_file(sb, f"{base}/g", chunks())).bytes == 300000
        assert (await rb.write_file(sb, f"{base}/h", io.BytesIO(b"h" * 70000))).bytes == 70000
        assert b"".join([c async for c in rb.iter_file(sb, f"{base}/g")])[-1:] == b"C"
        assert (await rb.stat(sb, f"{base}/g")).size == 300000
        assert [e.name for e in await rb.list_dir(sb, base)] == ["f", "g", "h"]
        tar_bytes = await rb.download_tar(sb, base)
        with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
            assert {m.name.lstrip("./") for m in tar.getmembers() if m.isfile()} == {"f", "g", "h"}
        assert b"".join([c async for c in rb.iter_tar(sb, base)])[:100] == tar_bytes[:100]
        assert (await rb.upload_tar(sb, f"{base}/copy", tar_bytes)).bytes == len(tar_bytes)
        assert await rb.read_file(sb, f"{base}/copy/f") == b"data"
        await rb.remove(sb, f"{base}/copy", recursive=True)
        with pytest.raises(NotFound):
            await rb.stat(sb, f"{base}/copy")
        with pytest.raises(BadRequest) as caught:
            await rb.read_file(sb, "relative")
        assert caught.value.field == "path"
        with pytest.raises(NotFound):
            [c async for c in rb.iter_file(sb, f"{base}/none")]

        snap = await rb.snapshot(sb, ttl_s=300)
        assert (await rb.get_snapshot(snap)).id == snap.id
        assert [s.id for s in await rb.list_snapshots(sandbox=sb)] == [snap.id]
        forks = await rb.fork(sb, 2, labels={**labels, "fork": "1"})
        assert all(f.ok for f in forks)
        kids = [f.sandbox for f in forks if f.sandbox]
        reset = await asyncio.gather(*(rb.reset(kid) for kid in kids))
        assert [r.id for r in reset] == [k.id for k in kids]
        assert (await rb.reset(kids[0], snapshot=snap.id)).state == "running"
        with pytest.raises(BadRequest) as caught:
            await rb.fork(sb, 0)
        assert caught.value.field == "count"
        await rb.delete_sandboxes(labels={**labels, "fork": "1"})
        archive = os.path.join(scratch, f"{snap.id}.tar")
        assert await rb.export_snapshot(snap, archive) == os.path.getsize(archive)
        with tarfile.open(archive) as members:
            assert members.getnames()[:3] == ["rollbox-snapshot.json", "vmstate", "memory"]
        assert (await rb.import_snapshot(archive)).id == snap.id
        await rb.delete_snapshot(snap)
        assert (await rb.import_snapshot(archive)).id == snap.id
        os.unlink(archive)
        await rb.delete_snapshot(snap)
        with pytest.raises(NotFound):
            await rb.get_snapshot(snap.id)
        await rb.delete_sandbox(sb)
        await rb.delete_sandbox(sb)
        assert (await rb.get_sandbox(sb)).state == "deleted"
