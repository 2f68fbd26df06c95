"""Volumes without a daemon: mount requests and their JSON, the objects parsed from the
daemon's JSON, each volume call's request, and both clients against a mock transport."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Dict, List

import httpx
import pytest

from rollbox_sdk import (
    AsyncClient,
    Client,
    FileInfo,
    NotFound,
    Sandbox,
    Snapshot,
    Volume,
    VolumeInfo,
)
from rollbox_sdk import _core

VOLUME = {
    "name": "traj",
    "host_path": "/var/lib/rollbox/volumes/traj",
    "created_at_ms": 1733300000000,
    "tenant": "team-a",
    "mounted_by": ["sb-0123456789abcdef"],
}
ENTRY = {
    "name": "a.txt",
    "path": "/d/a.txt",
    "kind": "file",
    "size": 5,
    "mode": 0o644,
    "uid": 0,
    "gid": 0,
    "mtime_ns": 1,
    "link_target": None,
}


def test_mounts_are_sent_as_the_contract_says() -> None:
    assert Volume("traj", "/data").to_json() == {
        "name": "traj",
        "mount_path": "/data",
        "readonly": False,
    }
    body = _core.create_body(
        "t", None, None, None, 60, None, None, None, None, None, None, False,
        [Volume("traj", "/data"), {"name": "in", "mount_path": "/in", "readonly": True}],
    )
    assert body["volumes"] == [
        {"name": "traj", "mount_path": "/data", "readonly": False},
        {"name": "in", "mount_path": "/in", "readonly": True},
    ]
    # No volumes: no key (a restore may not name any).
    body = _core.create_body(None, "snap-1", None, None, 60, None, None, None, None, None, None)
    assert "volumes" not in body
    assert "volumes" not in _core.create_body(
        "t", None, None, None, 60, None, None, None, None, None, None, False, []
    )


def test_sandboxes_snapshots_and_volumes_parse() -> None:
    mounts = [{"name": "traj", "mount_path": "/data", "readonly": True}]
    sandbox = Sandbox.from_json({"id": "sb-1", "state": "running", "volumes": mounts})
    assert sandbox.volumes == [Volume("traj", "/data", readonly=True)]
    assert Sandbox.from_json({"id": "sb-1", "state": "running"}).volumes == []
    assert Snapshot.from_json({"id": "snap-1", "volumes": mounts}).volumes == sandbox.volumes
    assert Snapshot.from_json({"id": "snap-1"}).volumes == []
    info = VolumeInfo.from_json(VOLUME)
    assert (info.name, info.tenant, info.mounted_by) == ("traj", "team-a", VOLUME["mounted_by"])
    admin = VolumeInfo.from_json({"name": "x", "host_path": "/x", "created_at_ms": 1})
    assert (admin.tenant, admin.mounted_by) == (None, [])


def test_volume_calls() -> None:
    call = _core.create_volume("traj", None)
    assert (call.method, call.path, call.json) == ("POST", "/volumes", {"name": "traj"})
    assert _core.create_volume("traj", "/srv/d").json == {"name": "traj", "host_path": "/srv/d"}
    assert _core.get_volume(VolumeInfo.from_json(VOLUME)).path == "/volumes/traj"
    assert (_core.delete_volume("traj").method, _core.list_volumes().path) == ("DELETE", "/volumes")
    write = _core.write_volume_file("traj", "a/b", b"x")
    assert (write.method, write.path) == ("PUT", "/volumes/traj/files")
    assert write.params == [("path", "a/b")]
    assert write.headers == {"Content-Type": "application/octet-stream"}

    listing = httpx.Response(200, json={"entries": [ENTRY]})
    data = httpx.Response(
        200, content=b"hi\x00", headers={"content-type": "application/octet-stream"}
    )
    read = _core.read_volume_file("traj", "/d")
    assert read.params == [("path", "/d")] and read.parse(data) == b"hi\x00"
    with pytest.raises(IsADirectoryError, match="'/d'"):
        read.parse(listing)
    ls = _core.list_volume("traj", "/d")
    assert ls.parse(listing) == [FileInfo.from_json(ENTRY)]
    with pytest.raises(NotADirectoryError, match="'/d'"):
        ls.parse(data)


def mock(seen: List[Dict[str, Any]]) -> httpx.MockTransport:
    """Answers the volume routes as the contract says, and records each request."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = request.read()
        seen.append(
            {
                "method": request.method,
                "path": request.url.path,
                "query": dict(request.url.params),
                "body": body,
            }
        )
        path = request.url.path
        if path == "/volumes" and request.method == "POST":
            return httpx.Response(201, json={**VOLUME, "name": json.loads(body)["name"]})
        if path == "/volumes":
            return httpx.Response(200, json={"volumes": [VOLUME]})
        if path == "/volumes/nope":
            return httpx.Response(404, json={"error": "no volume nope"})
        if path == "/volumes/traj" and request.method == "DELETE":
            return httpx.Response(204)
        if path == "/volumes/traj":
            return httpx.Response(200, json=VOLUME)
        if path == "/volumes/traj/files" and request.method == "PUT":
            return httpx.Response(201, json={"path": "/a", "bytes": len(body)})
        if path == "/volumes/traj/files" and request.url.params["path"] in ("", "/"):
            return httpx.Response(200, json={"entries": [ENTRY]})
        if path == "/volumes/traj/files":
            return httpx.Response(
                200, content=b"bytes", headers={"content-type": "application/octet-stream"}
            )
        if path == "/sandboxes":
            mounts = json.loads(body)["volumes"]
            return httpx.Response(201, json={"id": "sb-1", "state": "running", "volumes": mounts})
        return httpx.Response(404, json={"error": f"mock: no route {path}"})

    return httpx.MockTransport(handle)


def test_the_sync_client() -> None:
    seen: List[Dict[str, Any]] = []
    with Client("http://rollbox.test", api_key="k") as rb:
        rb._http.close()
        rb._http = httpx.Client(base_url="http://rollbox.test", transport=mock(seen))
        assert rb.create_volume("traj").name == "traj"
        assert [v.name for v in rb.volumes()] == ["traj"]
        assert rb.volume("traj").mounted_by == VOLUME["mounted_by"]
        with pytest.raises(NotFound, match="no volume nope"):
            rb.volume("nope")
        assert rb.read_volume_file("traj", "/a") == b"bytes"
        assert [e.name for e in rb.list_volume("traj")] == ["a.txt"]
        assert rb.write_volume_file("traj", "/a", b"12345") is None
        assert rb.delete_volume("traj") is None
        sb = rb.create_sandbox("t", ttl_s=60, volumes=[Volume("traj", "/data", True)])
        assert sb.volumes == [Volume("traj", "/data", True)]
    assert seen[-3]["body"] == b"12345" and seen[-3]["query"] == {"path": "/a"}
    assert seen[-2]["method"] == "DELETE"
    assert seen[-4]["query"] == {"path": "/"}


def test_the_async_client() -> None:
    async def go() -> None:
        seen: List[Dict[str, Any]] = []
        async with AsyncClient("http://rollbox.test", api_key="k") as rb:
            await rb._http.aclose()
            rb._http = httpx.AsyncClient(base_url="http://rollbox.test", transport=mock(seen))
            info = await rb.create_volume("traj", host_path="/srv/traj")
            assert info.name == "traj"
            assert json.loads(seen[0]["body"]) == {"name": "traj", "host_path": "/srv/traj"}
            with pytest.raises(IsADirectoryError):
                await rb.read_volume_file("traj", "/")
            await rb.write_volume_file("traj", "a", b"xy")
            assert seen[-1]["body"] == b"xy"
            sb = await rb.create_sandbox("t", ttl_s=60, volumes=[Volume("traj", "/data")])
            assert sb.volumes == [Volume("traj", "/data")]

    asyncio.run(go())
