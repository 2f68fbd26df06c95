"""The stock `e2b` SDK's Volume API against `rollbox serve --e2b-listen`: run by
rollbox/tests/e2b.rs. An E2B volume is a daemon volume (its id is its name); its content API
is this listener too (E2B_VOLUME_API_URL).

Environment: E2B_API_URL, E2B_VOLUME_API_URL, E2B_API_KEY, E2B_DOMAIN, E2B_SANDBOX_URL,
ROLLBOX_E2B_TEMPLATE (a template the daemon has) and ROLLBOX_NATIVE_SOCKET (the daemon's own
API, where the admin key makes tenant keys). Prints `ok NAME` per check.
"""

import http.client
import json
import os
import socket

from e2b import (
    NotFoundException,
    Sandbox,
    Volume,
    VolumeNotFoundException,
    VolumePathNotFoundException,
)

from checks import expect_error, ok
from test_sdk import run_main

TEMPLATE = os.environ["ROLLBOX_E2B_TEMPLATE"]


def content_checks(vol):
    entry = vol.write_file("notes/a.txt", "hello volume")
    assert (entry.name, entry.path, entry.size) == ("a.txt", "/notes/a.txt", 12), entry
    assert entry.type.value == "file", entry
    ok("write_file makes its parents and answers the entry")
    assert vol.read_file("notes/a.txt") == "hello volume"
    assert vol.read_file("/notes/a.txt", format="bytes") == b"hello volume"
    assert b"".join(vol.read_file("notes/a.txt", format="stream")) == b"hello volume"
    ok("read_file as text, bytes and stream")
    vol.write_file("notes/a.txt", b"again")
    assert vol.read_file("notes/a.txt") == "again"
    ok("write_file overwrites")
    top = vol.list("/")
    assert [(e.name, e.type.value, e.path) for e in top] == [("notes", "directory", "/notes")], top
    deep = vol.list("/", depth=2)
    assert [e.path for e in deep] == ["/notes", "/notes/a.txt"], deep
    assert [e.name for e in vol.list("notes")] == ["a.txt"]
    ok("list a directory, one level and two")
    info = vol.get_info("notes/a.txt")
    assert (info.type.value, info.size, info.mtime.tzinfo is not None) == ("file", 5, True), info
    assert vol.exists("notes") and not vol.exists("nope")
    ok("get_info and exists")
    made = vol.make_dir("made/deep", force=True)
    assert (made.type.value, made.path) == ("directory", "/made/deep"), made
    vol.make_dir("made/deep", force=True)
    expect_error("make_dir of an existing directory", lambda: vol.make_dir("made/deep"), "409", "exists")
    expect_error(
        "make_dir without its parent",
        lambda: vol.make_dir("x/y"),
        "VolumePathNotFoundException",
    )
    vol.make_dir("made/other")
    assert [e.name for e in vol.list("made")] == ["deep", "other"]
    ok("make_dir, with and without force")
    vol.write_file("made/deep/f", "f")
    vol.remove("made")
    assert not vol.exists("made")
    vol.remove("notes/a.txt")
    assert vol.list("notes") == []
    expect_error("remove a path that is gone", lambda: vol.remove("made"), "VolumePathNotFoundException")
    expect_error("remove the root", lambda: vol.remove("/"), "400", "root")
    ok("remove a file and a directory with what it holds")
    vol.write_file("notes/a.txt", "hello volume")
    expect_error("read_file of a directory", lambda: vol.read_file("notes"), "400", "a directory")
    expect_error("list a file", lambda: vol.list("notes/a.txt"), "400", "not a directory")
    expect_error("a path out of the volume", lambda: vol.read_file("../etc/passwd"), "400", "leaves the volume")
    expect_error("a file that is not there", lambda: vol.read_file("nope"), "VolumePathNotFoundException")
    expect_error(
        "update_metadata is refused",
        lambda: vol.update_metadata("notes/a.txt", mode=0o600),
        "501",
        "not served",
    )
    expect_error("write_file with a mode is refused", lambda: vol.write_file("m", "x", mode=0o600), "400", "mode")
    assert not vol.exists("m")


def token_checks(vol, other):
    expect_error(
        "a wrong token",
        lambda: Volume(vol.volume_id, vol.name, token="not-a-token").read_file("notes/a.txt"),
        "401",
    )
    expect_error(
        "another volume's token",
        lambda: Volume(vol.volume_id, vol.name, token=other.token).read_file("notes/a.txt"),
        "401",
    )
    key = Volume(vol.volume_id, vol.name, token=os.environ["E2B_API_KEY"])
    assert key.read_file("notes/a.txt") == "hello volume"
    ok("the content API takes the volume's own token or an API key, nothing else")


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=60)
        self.unix_path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self.unix_path)


def tenant_key(tenant):
    """A new tenant key, made with the admin key on the native API."""
    connection = UnixConnection(os.environ["ROLLBOX_NATIVE_SOCKET"])
    connection.request(
        "POST",
        "/keys",
        body=json.dumps({"tenant": tenant}),
        headers={"Authorization": f"Bearer {os.environ['E2B_API_KEY']}", "Content-Type": "application/json"},
    )
    response = connection.getresponse()
    body = json.loads(response.read())
    assert response.status == 201, body
    return body["key"]


def tenant_checks():
    key_a, key_b = tenant_key("team-a"), tenant_key("team-b")
    vol = Volume.create("team-a-vol", api_key=key_a)
    vol.write_file("secret", "a's")
    assert "team-a-vol" not in [v.name for v in Volume.list(api_key=key_b)]
    assert "team-a-vol" in [v.name for v in Volume.list()]
    expect_error(
        "another tenant's volume is not there",
        lambda: Volume.get_info("team-a-vol", api_key=key_b),
        "VolumeNotFoundException",
    )
    assert Volume.destroy("team-a-vol", api_key=key_b) is False
    expect_error(
        "another tenant's key on the content API",
        lambda: Volume("team-a-vol", "team-a-vol", token=key_b).read_file("secret"),
        "VolumePathNotFoundException",
    )
    assert Volume.connect("team-a-vol", api_key=key_a).read_file("secret") == "a's"
    assert Volume.destroy("team-a-vol", api_key=key_a) is True
    ok("a tenant's volumes are its own (another tenant's answers as no volume)")


def main():
    vol = Volume.create("e2b-vol")
    assert (vol.volume_id, vol.name) == ("e2b-vol", "e2b-vol") and vol.token, vol
    ok("Volume.create: its id is its name, with a token")
    expect_error("a second volume of that name", lambda: Volume.create("e2b-vol"), "409", "exists")
    expect_error("a bad name", lambda: Volume.create("Bad Name"), "400", "name")
    other = Volume.create("e2b-other")
    content_checks(vol)
    token_checks(vol, other)
    listed = sorted((v.volume_id, v.name) for v in Volume.list())
    assert listed == [("e2b-other", "e2b-other"), ("e2b-vol", "e2b-vol")], listed
    info = Volume.get_info("e2b-vol")
    assert (info.volume_id, info.token) == ("e2b-vol", vol.token), info
    again = Volume.connect("e2b-vol")
    assert again.read_file("notes/a.txt") == "hello volume"
    expect_error("get_info of no volume", lambda: Volume.get_info("nope"), "VolumeNotFoundException")
    ok("Volume.list, get_info and connect")

    sbx = Sandbox.create(TEMPLATE, timeout=120, volume_mounts={"/data": vol})
    ok("Sandbox.create with volume_mounts")
    expect_error(
        "a mount of no volume",
        lambda: Sandbox.create(TEMPLATE, timeout=60, volume_mounts={"/data": "no-such-volume"}),
        "400",
        "volumeMounts[0].name",
        "no volume",
    )
    expect_error(
        "a bad mount path",
        lambda: Sandbox.create(TEMPLATE, timeout=60, volume_mounts={"data": vol}),
        "400",
        "volumeMounts[0].path",
    )
    expect_error(
        "destroy a volume a live sandbox mounts",
        lambda: Volume.destroy("e2b-vol"),
        "409",
        sbx.sandbox_id,
    )
    sbx.kill()
    assert Volume.destroy("e2b-vol") is True
    assert Volume.destroy("e2b-vol") is False
    expect_error("get_info of a destroyed volume", lambda: Volume.get_info("e2b-vol"), "VolumeNotFoundException")
    ok("Volume.destroy: refused while mounted, done once the sandbox is killed")
    remade = Volume.create("e2b-vol")
    assert remade.token != vol.token
    expect_error(
        "the token of the volume that was destroyed",
        lambda: vol.read_file("notes/a.txt"),
        "401",
    )
    expect_error("the new volume is empty", lambda: remade.read_file("notes/a.txt"), "VolumePathNotFoundException")
    ok("a volume made again under the name has another token and no files")
    tenant_checks()
    for name in ("e2b-vol", "e2b-other"):
        assert Volume.destroy(name) is True
    assert issubclass(VolumeNotFoundException, NotFoundException)
    assert issubclass(VolumePathNotFoundException, NotFoundException)


if __name__ == "__main__":
    run_main(main)
