"""``@function`` against a live daemon: the test guest's sandboxes run the function through
the host agent that stands in for a guest's (so "in the sandbox" is this host, and the
working directory is the scratch directory). Values, exceptions with the remote traceback,
streamed output, ``map`` in order, ``spawn``, and the sandbox gone after each call."""

from __future__ import annotations

import os
import sys

import pytest

from rollbox_sdk import Client, FunctionCall, NotFound, RemoteTraceback, Volume, function

pytestmark = pytest.mark.live


class Diverged(Exception):
    pass


def test_remote_returns_values_raises_exceptions_and_streams_output(
    rb: Client, template: str, scratch: str, capfd: pytest.CaptureFixture[str]
) -> None:
    base = 10

    @function(template=template, client=rb, workdir=scratch, python=sys.executable, timeout_s=120)
    def step(x: int, *, scale: int = 1) -> dict:
        print(f"step {x} in {os.getcwd()}")
        print("to stderr", file=sys.stderr)
        if x < 0:
            raise Diverged(f"loss diverged at {x}")
        return {"value": (x + base) * scale, "cwd": os.getcwd()}

    assert step(1) == {"value": 11, "cwd": os.getcwd()}  # a local call, as undecorated
    out = step.remote(2, scale=3)
    assert out == {"value": 36, "cwd": scratch}
    printed = capfd.readouterr()
    assert f"step 2 in {scratch}" in printed.out
    assert "to stderr" in printed.err

    with pytest.raises(Diverged, match="loss diverged at -1") as raised:
        step.remote(-1)
    cause = raised.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "raise Diverged" in cause.text

    assert step.map([1, 2, 3], concurrency=3) == [
        {"value": v, "cwd": scratch} for v in (11, 12, 13)
    ]
    call = step.spawn(5)
    assert isinstance(call, FunctionCall)
    assert call.get(timeout=120) == {"value": 15, "cwd": scratch}

    # Every call's sandbox is gone.
    live = rb.list_sandboxes(labels={"rollbox.function": "step"}, state="running")
    assert list(live) == []


def test_volumes_are_made_and_relative_mount_paths_are_under_the_workdir(
    rb: Client, template: str, scratch: str
) -> None:
    name = "fn-" + os.urandom(4).hex()

    @function(
        template=template,
        client=rb,
        workdir=scratch,
        python=sys.executable,
        volumes=[Volume(name, "./data")],
    )
    def nothing() -> None:
        return None

    assert nothing.volumes == [Volume(name, os.path.join(scratch, "data"))]
    if not os.environ.get("ROLLBOX_VIRTIOFSD"):
        pytest.skip("ROLLBOX_VIRTIOFSD is not set: this daemon serves no volumes")
    assert nothing.remote() is None
    assert rb.volume(name).mounted_by == []
    rb.delete_volume(name)
    with pytest.raises(NotFound):
        rb.volume(name)


def test_bad_arguments_are_refused_before_any_sandbox() -> None:
    for kwargs, field in [
        ({"template": "t", "image": "python:3.11"}, "image="),
        ({"kernel": "/vmlinux"}, "kernel="),
        ({"template": "t", "timeout_s": 0}, "timeout_s"),
        ({"template": "t", "workdir": "rel"}, "workdir"),
    ]:
        with pytest.raises(ValueError, match=field):
            function(**kwargs)(lambda: None)


def test_beams_names_snapshot_memory_and_create_from_memory_snapshot(
    rb: Client, template: str
) -> None:
    from rollbox_sdk.beam import Sandbox

    env = Sandbox(template=template, memory=32, client=rb).create()
    try:
        snapshot_id = env.snapshot_memory()
        env2 = Sandbox(template=template, client=rb).create_from_memory_snapshot(snapshot_id)
        try:
            assert rb.get_sandbox(env2.sandbox_id).state == "running"
            process = env2.process.exec("sh", "-c", "echo from-the-restore")
            assert process.wait() == 0 and process.stdout == "from-the-restore\n"
        finally:
            assert env2.terminate()
    finally:
        env.terminate()
    rb.delete_snapshot(snapshot_id)


def test_a_function_without_a_template_takes_rollbox_template(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLBOX_TEMPLATE", "from-env")
    assert function(lambda: None).template == "from-env"
    monkeypatch.delenv("ROLLBOX_TEMPLATE")
    assert function(lambda: None).template == "python"
