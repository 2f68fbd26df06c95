"""The stock `e2b` SDK against `rollbox serve --e2b-listen` with a real Linux template (Debian,
the static agent as init): run by tests/tests/tier4_daemon.rs inside the nested lab.

Environment: E2B_API_URL, E2B_API_KEY, E2B_DOMAIN, E2B_SANDBOX_URL, plus ROLLBOX_E2B_TEMPLATE
(a Linux template with bash) and ROLLBOX_E2B_SCRATCH (unused here: files live in the guest).
Prints `ok NAME` per check and `figure: ...` lines (figures, not asserts); any failure raises
and exits non-zero.
"""

import faulthandler
import importlib.metadata
import os
import time

import e2b
from e2b import CommandExitException, Sandbox, SandboxQuery, Volume
from e2b.api.client.models.sandbox_state import SandboxState

# The host suite's PTY and watch checks, unchanged: they take the sandbox and a directory.
from test_sdk import expect_error, ok, percentile, pty_checks, run_main, watch_checks
from conformance_user import linux_user_checks
from conformance_files import check_metadata, check_signed_urls, check_write_events

TEMPLATE = os.environ["ROLLBOX_E2B_TEMPLATE"]
METADATA = {"suite": "e2b-linux"}


def main():
    print(f"e2b SDK {importlib.metadata.version('e2b')}, template {TEMPLATE}", flush=True)
    started = time.perf_counter()
    sbx = Sandbox.create(TEMPLATE, timeout=300, metadata=METADATA, envs={"GREETING": "hi there"})
    created = time.perf_counter()
    first = []
    sent = time.time()
    # The guest's clock (the agent steps it to the host's after a restore) splits the wait: until the command
    # ran, and from there until its output arrived.
    result = sbx.commands.run("echo first; date +%s.%N", on_stdout=lambda _: first.append(time.perf_counter()))
    arrived = time.time()
    assert first and result.stdout.startswith("first\n"), result
    ran = float(result.stdout.split()[1])
    print(
        "figure: Sandbox.create %.0f ms, create to first output %.0f ms; the first command ran "
        "%.0f ms after it was sent, its output came %.0f ms later (guest clock; lab: TCG L1, KVM L2)"
        % ((created - started) * 1000, (first[0] - started) * 1000, (ran - sent) * 1000, (arrived - ran) * 1000),
        flush=True,
    )
    ok(f"create {sbx.sandbox_id} from {TEMPLATE}")
    try:
        run_checks(sbx)
        lifecycle_checks(sbx)
    finally:
        sbx.kill()
    volume_checks()
    assert not Sandbox.kill(sbx.sandbox_id), "a second kill found the sandbox"
    ok("kill, and kill again is False")
    expect_error("connect after kill", lambda: Sandbox.connect(sbx.sandbox_id), "not found")


def run_checks(sbx):
    result = sbx.commands.run("uname -s; echo $BASH_VERSION | cut -d. -f1; cat /etc/debian_version")
    lines = result.stdout.splitlines()
    assert lines[0] == "Linux" and lines[1].isdigit() and lines[2], result
    ok(f"commands.run is bash in a Linux guest: bash {lines[1]}, Debian {lines[2]}")

    chunks = []
    result = sbx.commands.run(
        "echo one; echo oops >&2; sleep 2; echo two",
        on_stdout=lambda data: chunks.append((time.perf_counter(), "out", data)),
        on_stderr=lambda data: chunks.append((time.perf_counter(), "err", data)),
    )
    ended = time.perf_counter()
    assert result.exit_code == 0 and result.stdout == "one\ntwo\n" and result.stderr == "oops\n", result
    assert "".join(d for _, s, d in chunks if s == "out") == "one\ntwo\n", chunks
    assert "".join(d for _, s, d in chunks if s == "err") == "oops\n", chunks
    # Streamed: "one" arrived while the command still slept (2 s), not with the result.
    assert ended - chunks[0][0] > 0.5, (ended, chunks)
    ok("foreground run streams stdout and stderr through the callbacks")

    result = sbx.commands.run('pwd; echo "$GREETING" "$EXTRA"', cwd="/tmp", envs={"EXTRA": "x"})
    assert result.stdout == "/tmp\nhi there x\n", result
    ok("cwd, sandbox envVars and command envs")

    failed = expect_error("non-zero exit raises", lambda: sbx.commands.run("echo bad >&2; exit 3"), "CommandExit")
    assert isinstance(failed, CommandExitException) and failed.exit_code == 3, failed
    assert failed.stderr == "bad\n", failed.stderr

    handle = sbx.commands.run("sleep 0.5; echo bg", background=True)
    assert handle.pid > 0
    assert handle.wait().stdout == "bg\n"
    ok("background + wait")

    handle = sbx.commands.run("sleep 2; echo later", background=True)
    pid = handle.pid
    handle.disconnect()
    assert pid in [p.pid for p in sbx.commands.list()], "a disconnect ended the command"
    result = sbx.commands.connect(pid).wait()
    assert result.exit_code == 0 and "later" in result.stdout, result
    ok("disconnect, then connect by pid and wait")

    handle = sbx.commands.run("sleep 60", background=True, timeout=0)
    assert sbx.commands.kill(handle.pid)
    deadline = time.time() + 20
    while handle.pid in [p.pid for p in sbx.commands.list()]:
        assert time.time() < deadline, "a killed process stayed listed"
        time.sleep(0.2)
    ok("commands.kill by pid")

    # Commands and files run as E2B's `user` (image builds add the account), so the checks live in its home.
    linux_user_checks(sbx)
    base = "/home/user/e2b-linux"
    sbx.files.write(f"{base}/a.txt", "content one")
    assert sbx.files.read(f"{base}/a.txt") == "content one"
    sbx.files.write(f"{base}/sub/b.bin", b"\x00\x01binary")
    assert sbx.files.read(f"{base}/sub/b.bin", format="bytes") == bytearray(b"\x00\x01binary")
    assert sorted(e.name for e in sbx.files.list(base)) == ["a.txt", "sub"]
    assert sorted(e.name for e in sbx.files.list(base, depth=2)) == ["a.txt", "b.bin", "sub"]
    assert sbx.commands.run(f"cat {base}/a.txt").stdout == "content one"
    ok("files write/read/list in the guest's filesystem")

    # A stuck terminal or watch would block a read for ever: end the script with a traceback.
    faulthandler.dump_traceback_later(240, exit=True)
    pty_checks(sbx, base)
    # Without the 10,000-event flood: a daemon-side limit the host suite covers, and 10,100
    # files take the lab's guest longer than the SDK's 60 s command timeout at times.
    watch_checks(sbx, base, flood=False)
    # envd's write events, file metadata as ext4 xattrs, and signed URLs, in a real guest.
    check_write_events(sbx, base, host=False)
    owner = sbx.commands.run(f"stat -c %U {base}/write-events/new.txt").stdout
    assert owner == "user\n", owner
    ok("a file written through the files API is the request's user's (user)")
    check_metadata(sbx, base)
    ok("file metadata in the guest's ext4 (the agent keeps it as user.e2b.* extended attributes)")
    check_signed_urls(sbx, base)
    faulthandler.cancel_dump_traceback_later()

    runs = []
    for _ in range(20):
        started = time.perf_counter()
        sbx.commands.run("true")
        runs.append((time.perf_counter() - started) * 1000)
    print(
        "figure: commands.run('true') round trip p50 %.1f ms, max %.1f ms (n=20, lab)"
        % (percentile(runs, 0.5), max(runs)),
        flush=True,
    )

    sbx.set_timeout(250)
    info = sbx.get_info()
    left = info.end_at.timestamp() - time.time()
    assert 200 < left <= 251, left
    assert info.metadata == METADATA, info.metadata
    ok("set_timeout and get_info")

    ids = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata=METADATA)).next_items()]
    assert ids == [sbx.sandbox_id], ids
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": "other"})).next_items() == []
    ok("list with metadata")

    same = Sandbox.connect(sbx.sandbox_id)
    assert same.commands.run("echo again").stdout == "again\n"
    ok("connect")

    sbx.commands.run(f"echo before-pause > {base}/state.txt")
    assert sbx.pause()
    assert str(sbx.get_info().state) == "paused"
    paused = Sandbox.list(query=SandboxQuery(metadata=METADATA, state=[SandboxState.PAUSED])).next_items()
    assert [s.sandbox_id for s in paused] == [sbx.sandbox_id], paused
    resumed = Sandbox.connect(sbx.sandbox_id)
    assert str(resumed.get_info().state) == "running"
    assert resumed.commands.run(f"cat {base}/state.txt").stdout == "before-pause\n"
    ok("pause, and connect resumes with the guest's state")

    forks = sbx.fork(count=1, timeout=120)
    assert len(forks) == 1, forks
    fork = forks[0]
    try:
        assert fork.sandbox_id != sbx.sandbox_id
        assert fork.commands.run(f'cat {base}/state.txt; echo "$GREETING"').stdout == "before-pause\nhi there\n"
        fork.commands.run(f"echo fork > {base}/state.txt")
        assert sbx.commands.run(f"cat {base}/state.txt").stdout == "before-pause\n"
        assert fork.get_info().metadata == METADATA
        ok("fork: a clone with the parent's files, envVars and metadata; its writes are its own")
    finally:
        fork.kill()


def lifecycle_checks(first):
    """E2B's lifecycle in a Linux guest: a second sandbox made to pause at its timeout and to
    resume on the next request; the list, newest first, shows both across running and paused;
    and a command running when its sandbox is killed raises SandboxNotRunningException."""
    # The TTL runs from the create's start, and a lab create takes 10-16 s.
    sbx = Sandbox.create(TEMPLATE, timeout=40, metadata=METADATA,
                         lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        assert sbx.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
        sbx.commands.run("echo kept > /home/user/lifecycle.txt")
        deadline = time.time() + 180
        while str(sbx.get_info().state) != "paused":
            assert time.time() < deadline, "the timeout did not pause the sandbox"
            time.sleep(1)
        listed = Sandbox.list(query=SandboxQuery(metadata=METADATA)).next_items()
        assert [s.sandbox_id for s in listed] == [sbx.sandbox_id, first.sandbox_id], listed
        assert [str(s.state) for s in listed] == ["paused", "running"], listed
        ok("lifecycle on_timeout=pause: the timeout pauses it; the list is newest first across paused and running")
        assert sbx.commands.run("cat /home/user/lifecycle.txt").stdout == "kept\n"
        assert str(sbx.get_info().state) == "running"
        ok("lifecycle auto_resume: a command on the paused sandbox resumes it, with its files")
        handle = sbx.commands.run("sleep 60", background=True)
        started = time.time()
        assert Sandbox.kill(sbx.sandbox_id)
        try:
            handle.wait()
            raise AssertionError("wait() returned after the sandbox was killed")
        except e2b.SandboxNotRunningException as error:
            assert "was not found" in str(error), error
            assert time.time() - started < 30, time.time() - started
        ok("a command whose sandbox is killed raises SandboxNotRunningException")
    finally:
        sbx.kill()


def volume_checks():
    """A volume (the daemon's, made through E2B's Volume API) mounted by a sandbox and by its
    fork: each reads what the other wrote, and the volume's content API reads both."""
    vol = Volume.create("lab-shared")
    first = Sandbox.create(TEMPLATE, timeout=300, metadata={"suite": "e2b-linux-volume"},
                           volume_mounts={"/data": vol})
    try:
        first.files.write("/data/first.txt", first.sandbox_id)
        fork = first.fork(count=1, timeout=120)[0]
        try:
            assert fork.commands.run("cat /data/first.txt").stdout == first.sandbox_id
            fork.files.write("/data/fork.txt", fork.sandbox_id)
            assert first.files.read("/data/fork.txt") == fork.sandbox_id
            assert vol.read_file("fork.txt") == fork.sandbox_id
            assert vol.read_file("first.txt") == first.sandbox_id
            ok("volume_mounts: a sandbox and its fork share the volume; the content API reads both")
        finally:
            fork.kill()
    finally:
        first.kill()
    assert Volume.destroy(vol.volume_id)
    ok("the volume is destroyed once no sandbox mounts it")


if __name__ == "__main__":
    run_main(main)
