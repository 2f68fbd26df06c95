"""The sync Client against a live daemon: every call and its error paths."""

from __future__ import annotations

import io
import os
import tarfile
import time

import pytest

from rollbox_sdk import (
    BadRequest,
    Client,
    Conflict,
    ImageSource,
    NotFound,
    StreamError,
    Unauthorized,
    Unavailable,
)

pytestmark = pytest.mark.live


def test_healthz_metrics_and_a_wrong_key(rb: Client, sandbox: str) -> None:
    assert rb.healthz() == {"status": "ok"}
    text = rb.metrics()
    assert "rollbox_creates_total" in text and f'sandbox="{sandbox}"' in text
    with Client(socket=rb.config.socket, api_key="wrong-key") as bad:
        with pytest.raises(Unauthorized) as caught:
            bad.healthz()
        assert caught.value.status == 401 and "API key" in caught.value.message


def test_node_info_drain_and_undrain(rb: Client, template: str) -> None:
    node = rb.node()
    assert node.node_id and node.status == "ready" and len(node.cpu["id"]) == 16
    assert template in [t["name"] for t in node.templates]
    try:
        drained = rb.drain()
        assert drained.status == "draining" and drained.drain_deadline_ms is None
        with pytest.raises(Unavailable) as caught:
            rb.create_sandbox(template, ttl_s=60)
        assert caught.value.status == 503 and "draining" in caught.value.message
    finally:
        assert rb.undrain().status == "ready"


def test_templates_add_get_list_delete_and_errors(rb: Client, kernel: str, cmdline: str) -> None:
    added = rb.add_template("sdk-t1", kernel, cmdline=cmdline, memory_mib=32, vcpus=1)
    assert (added.name, added.memory_mib, added.kernel) == ("sdk-t1", 32, kernel)
    assert rb.get_template("sdk-t1") == added
    assert "sdk-t1" in [t.name for t in rb.list_templates()]
    with pytest.raises(Conflict):
        rb.add_template("sdk-t1", kernel)
    rb.delete_template("sdk-t1")
    with pytest.raises(NotFound, match="sdk-t1"):
        rb.get_template("sdk-t1")
    with pytest.raises(NotFound):
        rb.delete_template("sdk-t1")
    with pytest.raises(BadRequest) as caught:
        rb.add_template("Bad Name", kernel)
    assert caught.value.field == "name"
    with pytest.raises(BadRequest) as caught:
        rb.add_template("sdk-t2", "relative/vmlinux")
    assert caught.value.field == "kernel"
    with pytest.raises(BadRequest) as caught:
        rb.add_template("sdk-t2", kernel, memory_mib=0)
    assert caught.value.field == "memory_mib"
    with pytest.raises(BadRequest) as caught:
        rb.add_template("sdk-t2", kernel, ready_cmd="true")
    assert caught.value.field == "ready_cmd"
    # An image that is not there: refused, and nothing of the template is left.
    with pytest.raises(BadRequest, match="image"):
        rb.add_template("sdk-t2", kernel, image=ImageSource(docker_archive="/nonexistent.tar"))
    with pytest.raises(NotFound):
        rb.get_template("sdk-t2")


def test_boot_snapshot_template(rb: Client, kernel: str, cmdline: str) -> None:
    template = rb.add_template("sdk-boot", kernel, cmdline=cmdline, memory_mib=32, boot_snapshot=True)
    assert template.boot_snapshot and template.boot_snapshot.startswith("snap-")
    sb = rb.create_sandbox("sdk-boot", ttl_s=120)
    try:
        assert sb.state == "running"
        assert rb.run(sb, ["true"]).ok
        with pytest.raises(Conflict):
            rb.delete_snapshot(template.boot_snapshot)
    finally:
        rb.delete_sandbox(sb)
    rb.delete_template("sdk-boot")


def test_template_start_and_ready_commands(rb: Client, kernel: str, cmdline: str, tmp_path) -> None:
    # The daemon's sandboxes share a host agent: the commands run on this host.
    mark = tmp_path / "started"
    template = rb.add_template(
        "sdk-start",
        kernel,
        cmdline=cmdline,
        memory_mib=32,
        boot_snapshot=True,
        start_cmd=f"sleep 1; echo up > {mark}",
        ready_cmd=f"test -s {mark}",
        ready_timeout_s=60,
    )
    assert (template.start_cmd, template.ready_timeout_s) == (f"sleep 1; echo up > {mark}", 60)
    assert mark.read_text() == "up\n"
    rb.delete_template("sdk-start")


def test_create_get_keepalive_pause_resume_usage_delete(rb: Client, template: str, tag: str) -> None:
    sb = rb.create_sandbox(
        template,
        ttl_s=300,
        idle_ttl_s=200,
        labels={"test": tag, "role": "main"},
        metadata={"note": "hello"},
        env={"SDK_VAR": "from-create"},
        idempotency_key=f"key-{tag}",
    )
    assert sb.state == "running" and sb.is_live
    assert (sb.labels["role"], sb.metadata["note"], sb.env["SDK_VAR"]) == ("main", "hello", "from-create")
    assert (sb.idle_ttl_s, sb.idempotency_key, sb.template) == (200, f"key-{tag}", template)
    assert sb.pid and sb.expires_at_ms > sb.created_at_ms
    again = rb.create_sandbox(template, ttl_s=300, idempotency_key=f"key-{tag}")
    assert again.id == sb.id
    assert rb.get_sandbox(sb.id).id == sb.id
    kept = rb.keepalive(sb, 3600)
    assert kept.expires_at_ms > sb.expires_at_ms
    assert rb.pause(sb).state == "paused"
    assert rb.pause(sb).state == "paused"
    assert rb.resume(sb).state == "running"
    assert rb.resume(sb.id).state == "running"
    used = rb.usage(sb)
    assert (used.sandbox, used.template, used.vcpus, used.memory_mib) == (sb.id, template, 1, 32)
    assert used.running_s >= 1 and used.vcpu_seconds == used.running_s
    rb.delete_sandbox(sb)
    rb.delete_sandbox(sb)
    rb.delete_sandbox("sb-00000000000000aa")
    gone = rb.get_sandbox(sb)
    assert gone.state == "deleted" and not gone.is_live and gone.ended_at_ms
    with pytest.raises(Conflict):
        rb.keepalive(sb, 60)
    assert rb.usage(sb).ended_at_ms


def test_sandbox_errors_name_the_field(rb: Client, template: str) -> None:
    cases = [
        (dict(ttl_s=0), "ttl_s"),
        (dict(ttl_s=60, idle_ttl_s=-1), "idle_ttl_s"),
        (dict(ttl_s=60, vcpus=99), "vcpus"),
        (dict(ttl_s=60, labels={"bad key": "v"}), "labels"),
        (dict(ttl_s=60, cpu_limit=1000.0), "cpu_limit"),
        (dict(ttl_s=60, idempotency_key=""), "idempotency_key"),
        (dict(ttl_s=60, snapshot="snap-nope"), "snapshot"),
    ]
    for kwargs, field in cases:
        with pytest.raises(BadRequest) as caught:
            rb.create_sandbox(template if "snapshot" not in kwargs else None, **kwargs)
        assert caught.value.field == field, caught.value
    with pytest.raises(BadRequest) as caught:
        rb.create_sandbox(None, ttl_s=60)
    assert caught.value.field == "template"
    with pytest.raises(BadRequest) as caught:
        rb.create_sandbox("no-such-template", ttl_s=60)
    assert caught.value.field == "template" and "no-such-template" in caught.value.message
    with pytest.raises(BadRequest) as caught:
        rb.get_sandbox("sb-nothex")
    assert caught.value.field == "id"
    with pytest.raises(NotFound, match="sb-00000000000000ab"):
        rb.get_sandbox("sb-00000000000000ab")
    for call in (rb.pause, rb.resume, rb.usage):
        with pytest.raises(NotFound):
            call("sb-00000000000000ab")
    with pytest.raises(BadRequest) as caught:
        rb.keepalive("sb-00000000000000ab", 0)
    assert caught.value.field == "ttl_s"
    with pytest.raises(BadRequest) as caught:
        rb.list_sandboxes_page(state="sleeping")
    assert caught.value.field == "state"
    with pytest.raises(BadRequest) as caught:
        rb.list_sandboxes_page(limit=0)
    assert caught.value.field == "limit"


def test_cpu_limit_is_kept_or_refused_whole(rb: Client, template: str, tag: str) -> None:
    try:
        sb = rb.create_sandbox(template, ttl_s=60, cpu_limit=0.5, labels={"test": tag})
    except Unavailable as refused:
        # A host without a writable cgroup cpu controller: nothing was created.
        assert "cpu" in refused.message
        assert list(rb.list_sandboxes(labels={"test": tag}, state="running")) == []
        return
    assert sb.cpu_limit == 0.5
    rb.delete_sandbox(sb)


def test_a_network_with_each_egress(rb: Client, template: str, tag: str) -> None:
    try:
        sb = rb.create_sandbox(template, ttl_s=60, egress=["192.0.2.0/24:443"], labels={"test": tag})
    except Unavailable as refused:
        # A host without nft or /dev/net/tun: nothing was created.
        assert refused.message.startswith("network: ")
        assert list(rb.list_sandboxes(labels={"test": tag}, state="running")) == []
        return
    assert sb.network is not None and sb.network.egress == "192.0.2.0/24:443"
    assert sb.network.address.startswith("10.244.0.") and sb.network.prefix_len == 30
    assert rb.get_sandbox(sb).network == sb.network
    flipped = rb.set_network(sb, "all")
    assert flipped.network is not None and flipped.network.egress == "all"
    assert flipped.network.address == sb.network.address
    rb.delete_sandbox(sb)
    plain = rb.create_sandbox(template, ttl_s=60, network=True, labels={"test": tag})
    assert plain.network is not None and plain.network.egress == "none"
    assert plain.network.dns is None
    rb.delete_sandbox(plain)
    with pytest.raises(BadRequest) as bad:
        rb.create_sandbox(template, ttl_s=60, egress="10.0.0.0/99")
    assert bad.value.field == "network.egress"


def test_list_filters_and_pages(rb: Client, template: str, tag: str) -> None:
    made = [rb.create_sandbox(template, ttl_s=120, labels={"test": tag, "i": str(i)}) for i in range(3)]
    try:
        page = rb.list_sandboxes_page(labels={"test": tag}, limit=2)
        assert [s.id for s in page.sandboxes] == [s.id for s in made[:2]] and page.next_page_token
        listed = list(rb.list_sandboxes(labels={"test": tag}, page_size=1))
        assert [s.id for s in listed] == [s.id for s in made]
        assert [s.id for s in rb.list_sandboxes(labels={"test": tag, "i": "1"})] == [made[1].id]
        assert [s.id for s in rb.list_sandboxes(ids=[made[2], made[0].id])] == [made[0].id, made[2].id]
        assert list(rb.list_sandboxes(labels={"test": tag}, state="paused")) == []
        rb.delete_sandbox(made[0])
        assert [s.id for s in rb.list_sandboxes(labels={"test": tag})] == [s.id for s in made[1:]]
        assert [s.id for s in rb.list_sandboxes(labels={"test": tag}, state="deleted")] == [made[0].id]
    finally:
        rb.delete_sandboxes(labels={"test": tag})


def test_batches_and_bulk_deletes(rb: Client, template: str, tag: str) -> None:
    results = rb.create_batch(3, template, ttl_s=120, labels={"test": tag}, idempotency_key=f"b-{tag}")
    assert len(results) == 3 and all(r.ok and r.error is None for r in results)
    ids = [r.sandbox.id for r in results if r.sandbox]
    again = rb.create_batch(3, template, ttl_s=120, labels={"test": tag}, idempotency_key=f"b-{tag}")
    assert [r.sandbox.id for r in again if r.sandbox] == ids
    assert rb.delete_sandboxes(ids=[ids[0]]) == [ids[0]]
    assert sorted(rb.delete_sandboxes(labels={"test": tag})) == sorted(ids[1:])
    assert rb.delete_sandboxes(labels={"test": tag}) == []
    with pytest.raises(BadRequest):
        rb.delete_sandboxes()
    with pytest.raises(BadRequest) as caught:
        rb.create_batch(0, template, ttl_s=60)
    assert caught.value.field == "count"
    with pytest.raises(BadRequest) as caught:
        rb.create_batch(2, template, ttl_s=0)
    assert caught.value.field == "ttl_s"


def test_run(rb: Client, sandbox: str, scratch: str) -> None:
    result = rb.run(sandbox, ["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (result.exit_code, result.stdout, result.stderr, result.ok) == (3, "out\n", "err\n", False)
    assert (result.timed_out, result.oom, result.truncated, result.signal) == (False, False, False, None)
    result = rb.run(sandbox, "cat; echo $SDK_X; pwd", stdin="in\n", env={"SDK_X": "x1"}, cwd=scratch)
    assert result.ok and result.stdout == f"in\nx1\n{os.path.realpath(scratch)}\n"
    result = rb.run(sandbox, ["sh", "-c", "printf '\\377\\000'"])
    assert result.stdout_bytes == b"\xff\x00"
    result = rb.run(sandbox, ["sh", "-c", "head -c 5000 /dev/zero"], max_output_bytes=100)
    assert result.truncated and len(result.stdout_bytes) <= 100
    started = time.monotonic()
    result = rb.run(sandbox, ["sleep", "30"], timeout_s=0.5)
    assert result.timed_out and time.monotonic() - started < 20
    with pytest.raises(BadRequest) as caught:
        rb.run(sandbox, [])
    assert caught.value.field == "cmd"
    with pytest.raises(BadRequest) as caught:
        rb.run(sandbox, "true", timeout_s=-1)
    assert caught.value.field == "timeout_s"
    with pytest.raises(BadRequest) as caught:
        rb.run(sandbox, "true", cwd="relative")
    assert caught.value.field == "cwd"
    with pytest.raises(NotFound):
        rb.run("sb-00000000000000ab", "true")


def test_create_env_reaches_every_exec(rb: Client, template: str) -> None:
    sb = rb.create_sandbox(template, ttl_s=60, env={"A": "from-create", "B": "b"})
    try:
        result = rb.run(sb, "echo $A $B", env={"A": "from-exec"})
        assert result.stdout == "from-exec b\n"
    finally:
        rb.delete_sandbox(sb)


def test_stream_events_stdin_and_signals(rb: Client, sandbox: str) -> None:
    with rb.stream(sandbox, ["sh", "-c", "echo one; echo two >&2; exit 4"]) as proc:
        assert proc.pid > 0
        events = list(proc)
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[0].type == "started" and events[0].pid == proc.pid
    assert events[-1].type == "exit" and events[-1].exit and events[-1].exit.exit_code == 4
    out = b"".join(e.data for e in events if e.type == "stdout")
    err = b"".join(e.data for e in events if e.type == "stderr")
    assert (out, err) == (b"one\n", b"two\n")

    with rb.stream(sandbox, ["cat"], stdin_open=True) as proc:
        proc.write_stdin("hello\n")
        proc.write_stdin(b"\x00\x01 there\n")
        proc.close_stdin()
        result = proc.wait()
    assert (result.exit_code, result.stdout_bytes) == (0, b"hello\n\x00\x01 there\n")
    with pytest.raises(NotFound):
        rb.write_stdin(sandbox, proc.pid, "late")

    with rb.stream(sandbox, ["sleep", "30"]) as proc:
        with pytest.raises(Conflict, match="stdin_open"):
            proc.write_stdin("x")
        with pytest.raises(BadRequest) as caught:
            proc.signal("NOSUCHSIG")
        assert caught.value.field == "signal"
        proc.signal("KILL")
        result = proc.wait()
    assert result.signal == 9 and result.exit_code is None

    with rb.stream(sandbox, ["sh", "-c", "sleep 30"]) as proc:
        rb.signal(sandbox, proc.pid, 15, group=True)
        assert proc.wait().signal == 15
    with pytest.raises(NotFound):
        rb.signal(sandbox, 999999, "TERM")
    with pytest.raises(BadRequest) as caught:
        rb.stream(sandbox, "")
    assert caught.value.field == "cmd"
    with pytest.raises(NotFound):
        rb.stream("sb-00000000000000ab", "true")
    # Reading past the end gives nothing more; a closed stream raises nothing.
    proc = rb.stream(sandbox, "true")
    assert proc.wait().ok and list(proc) == []
    proc.close()
    assert StreamError  # raised on broken streams; see test_offline for the mapping


def test_files(rb: Client, sandbox: str, scratch: str) -> None:
    base = os.path.join(scratch, "files")
    written = rb.write_file(sandbox, f"{base}/a/b.txt", b"hello", parents=True, mode=0o600)
    assert (written.path, written.bytes) == (f"{base}/a/b.txt", 5)
    assert rb.read_file(sandbox, f"{base}/a/b.txt") == b"hello"
    info = rb.stat(sandbox, f"{base}/a/b.txt")
    assert (info.kind, info.size, info.mode & 0o777, info.name) == ("file", 5, 0o600, "b.txt")
    big = os.urandom(3 << 20)
    assert rb.write_file(sandbox, f"{base}/big", io.BytesIO(big), mode="644").bytes == len(big)
    assert b"".join(rb.iter_file(sandbox, f"{base}/big", chunk_size=65536)) == big
    assert rb.write_file(sandbox, f"{base}/gen", (bytes([i]) * 1000 for i in range(10))).bytes == 10000
    rb.write_file(sandbox, f"{base}/text", "é")
    assert rb.read_file(sandbox, f"{base}/text") == "é".encode()
    names = [(e.name, e.kind) for e in rb.list_dir(sandbox, base)]
    assert names == [("a", "dir"), ("big", "file"), ("gen", "file"), ("text", "file")]
    assert rb.stat(sandbox, f"{base}/a").is_dir

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        member = tarfile.TarInfo("t/x.txt")
        member.size = 3
        tar.addfile(member, io.BytesIO(b"xyz"))
    assert rb.upload_tar(sandbox, f"{base}/untar", buffer.getvalue()).bytes == len(buffer.getvalue())
    assert rb.read_file(sandbox, f"{base}/untar/t/x.txt") == b"xyz"
    with tarfile.open(fileobj=io.BytesIO(rb.download_tar(sandbox, f"{base}/untar"))) as tar:
        assert "t/x.txt" in [m.name.lstrip("./") for m in tar.getmembers()]
    streamed = b"".join(rb.iter_tar(sandbox, f"{base}/untar"))
    with tarfile.open(fileobj=io.BytesIO(streamed)) as tar:
        assert tar.extractfile([m for m in tar.getmembers() if m.name.endswith("x.txt")][0]).read() == b"xyz"  # type: ignore[union-attr]
    rb.upload_tar(sandbox, f"{base}/untar2", io.BytesIO(buffer.getvalue()))
    assert rb.read_file(sandbox, f"{base}/untar2/t/x.txt") == b"xyz"

    with pytest.raises(Conflict):
        rb.remove(sandbox, f"{base}/a")
    rb.remove(sandbox, f"{base}/a", recursive=True)
    rb.remove(sandbox, f"{base}/big")
    with pytest.raises(NotFound):
        rb.stat(sandbox, f"{base}/big")
    with pytest.raises(NotFound):
        rb.read_file(sandbox, f"{base}/big")
    with pytest.raises(NotFound):
        b"".join(rb.iter_file(sandbox, f"{base}/big"))
    with pytest.raises(NotFound):
        rb.list_dir(sandbox, f"{base}/nothing")
    with pytest.raises(NotFound):
        rb.write_file(sandbox, f"{base}/no/parent", b"x")
    for call in (
        lambda: rb.read_file(sandbox, "relative"),
        lambda: rb.write_file(sandbox, "/a/../b", b""),
        lambda: rb.stat(sandbox, "x"),
        lambda: rb.list_dir(sandbox, "x"),
        lambda: rb.remove(sandbox, "x"),
        lambda: rb.download_tar(sandbox, "x"),
        lambda: rb.upload_tar(sandbox, "x", b""),
    ):
        with pytest.raises(BadRequest) as caught:
            call()
        assert caught.value.field == "path", caught.value
    with pytest.raises(BadRequest) as caught:
        rb.write_file(sandbox, f"{base}/m", b"", mode="999")
    assert caught.value.field == "mode"


def test_snapshots_fork_and_reset(rb: Client, template: str, tag: str, tmp_path) -> None:
    parent = rb.create_sandbox(template, ttl_s=300, labels={"test": tag})
    try:
        snap = rb.snapshot(parent, ttl_s=600)
        assert (snap.sandbox, snap.template) == (parent.id, template)
        assert snap.expires_at_ms and snap.id.startswith("snap-")
        assert rb.get_snapshot(snap.id) == snap
        assert snap.id in [s.id for s in rb.list_snapshots(sandbox=parent)]
        assert snap.id in [s.id for s in rb.list_snapshots()]

        restored = rb.create_sandbox(snapshot=snap, ttl_s=120, labels={"test": tag})
        assert restored.state == "running"
        with pytest.raises(BadRequest) as caught:
            rb.create_sandbox(snapshot=snap, vcpus=2, ttl_s=60)
        assert caught.value.fields == ("vcpus", "memory_mib")

        children = rb.fork(parent, 2, ttl_s=120, labels={"test": tag, "kind": "child"})
        assert len(children) == 2 and all(c.ok for c in children)
        child = children[0].sandbox
        assert child and child.metadata["forked_from"] == parent.id and child.labels["kind"] == "child"
        old_pid = child.pid
        again = rb.reset(child)
        assert (again.id, again.state) == (child.id, "running") and again.pid != old_pid
        assert rb.reset(child, snapshot=snap).state == "running"
        assert rb.run(child, "true").ok

        # A deterministic sandbox: shown as such, its snapshots too, and it restores only those.
        det = rb.create_sandbox(template, ttl_s=120, labels={"test": tag}, deterministic=True)
        assert det.deterministic and not parent.deterministic
        det_snap = rb.snapshot(det)
        assert det_snap.deterministic and not snap.deterministic
        assert rb.reset(det, snapshot=det_snap).deterministic
        with pytest.raises(BadRequest) as caught:
            rb.create_sandbox(snapshot=snap, ttl_s=60, deterministic=True)
        assert caught.value.field == "deterministic" and snap.id in caught.value.message

        with pytest.raises(BadRequest) as caught:
            rb.fork(parent, 0)
        assert caught.value.field == "count"
        with pytest.raises(BadRequest) as caught:
            rb.fork(parent, 65)
        assert caught.value.field == "count"
        with pytest.raises(NotFound):
            rb.fork("sb-00000000000000ab", 1)
        with pytest.raises(BadRequest) as caught:
            rb.reset(child, snapshot="snap-x")
        assert caught.value.field == "snapshot"
        with pytest.raises(BadRequest) as caught:
            rb.reset(child, snapshot="snap-00000000000000ab")
        assert caught.value.field == "snapshot" and "snap-00000000000000ab" in caught.value.message
        with pytest.raises(BadRequest) as caught:
            rb.snapshot(parent, ttl_s=0)
        assert caught.value.field == "ttl_s"
        with pytest.raises(BadRequest) as caught:
            rb.list_snapshots(sandbox="nope")
        # The daemon checks ?sandbox= with the path id's check, so its message says "id".
        assert caught.value.field in ("sandbox", "id") and "nope" in caught.value.message

        final = rb.snapshot(parent, stop=True)
        assert rb.get_sandbox(parent).state == "deleted"
        with pytest.raises(Conflict):
            rb.snapshot(parent)
        with pytest.raises(Conflict):
            rb.fork(parent, 1)
        # Export and import (here on one node): the same id comes back, once imported.
        archive = tmp_path / "final.tar"
        assert rb.export_snapshot(final, archive) == archive.stat().st_size
        rb.delete_snapshot(final)
        back = rb.import_snapshot(archive)
        assert (back.id, back.template) == (final.id, final.template)
        assert rb.import_snapshot(str(archive)) == back
        with pytest.raises(NotFound):
            rb.export_snapshot("snap-00000000000000ab", tmp_path / "none.tar")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["final.tar"]
        rb.delete_snapshot(final)
        rb.delete_snapshot(final.id)
        with pytest.raises(NotFound):
            rb.get_snapshot(final)
        with pytest.raises(BadRequest):
            rb.get_snapshot("snap-x")
    finally:
        rb.delete_sandboxes(labels={"test": tag})
        rb.delete_sandbox(parent)
