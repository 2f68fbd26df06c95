"""What needs no daemon: configuration, error mapping, the field parser against the daemon's
real 400 messages, body building."""

from __future__ import annotations

import pytest

from rollbox_sdk import (
    BadRequest,
    Client,
    ConfigError,
    Conflict,
    NotFound,
    Overloaded,
    ServerError,
    Unavailable,
)
from rollbox_sdk import _core
from rollbox_sdk.errors import error_for, parse_fields


def test_config_follows_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ROLLBOX_URL", "ROLLBOX_SOCKET", "ROLLBOX_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="ROLLBOX_API_KEY"):
        Client()
    monkeypatch.setenv("ROLLBOX_API_KEY", " k1 \n")
    config = _core.resolve_config(None, None, None, 5.0)
    assert (config.socket, config.api_key) == (_core.DEFAULT_SOCKET, "k1")
    monkeypatch.setenv("ROLLBOX_SOCKET", "/tmp/x.sock")
    assert _core.resolve_config(None, None, None, 5.0).socket == "/tmp/x.sock"
    monkeypatch.setenv("ROLLBOX_URL", "http://127.0.0.1:7000/")
    config = _core.resolve_config(None, None, None, 5.0)
    assert (config.base_url, config.socket) == ("http://127.0.0.1:7000", None)
    # Arguments win over the environment.
    config = _core.resolve_config(None, "/tmp/y.sock", "k2", 5.0)
    assert (config.socket, config.api_key) == ("/tmp/y.sock", "k2")
    with pytest.raises(ConfigError, match="url"):
        Client("127.0.0.1:7000")


@pytest.mark.parametrize(
    "message, fields",
    [
        ("ttl_s: 0 is out of range (1-2592000)", ("ttl_s",)),
        ("labels.team: the value must be at most 255 bytes", ("labels.team",)),
        ("vcpus, memory_mib: a restore keeps its snapshot's shape", ("vcpus", "memory_mib")),
        ('id: "x" is not a sandbox id (sb- and 16 hex digits)', ("id",)),
        ("bad JSON body: expected value at line 1", ()),
        ("the request needs a JSON body", ()),
        ('no template "nope"', ()),
    ],
)
def test_fields_are_parsed_from_the_daemons_messages(message: str, fields: tuple) -> None:
    assert parse_fields(message) == fields


def test_statuses_map_to_exceptions() -> None:
    error = error_for(400, "count: required (how many sandboxes)", "POST", "/x", None)
    assert isinstance(error, BadRequest) and error.field == "count"
    assert "count: required" in str(error) and "POST /x" in str(error)
    assert isinstance(error_for(404, "no sandbox sb-1", "GET", "/", None), NotFound)
    assert error_for(404, "id: x", "GET", "/", None).field is None
    assert isinstance(error_for(409, "m", "GET", "/", None), Conflict)
    assert isinstance(error_for(500, "m", "GET", "/", None), ServerError)
    assert isinstance(error_for(502, "m", "GET", "/", None), ServerError)
    assert isinstance(error_for(503, "m", "GET", "/", None), Unavailable)
    busy = error_for(429, "8 creates are already in flight; retry later", "POST", "/", "2")
    assert isinstance(busy, Overloaded) and busy.retry_after == 2.0
    assert error_for(429, "m", "POST", "/", "soon").retry_after is None  # type: ignore[attr-defined]


def test_bodies_leave_out_what_is_not_given() -> None:
    body = _core.create_body("t", None, None, None, 60, None, {"a": "b"}, None, {}, None, None)
    assert body == {"template": "t", "ttl_s": 60, "labels": {"a": "b"}}
    plain = [None] * 10
    assert _core.create_body("t", *plain, network=True)["network"] == {}
    assert _core.create_body("t", *plain, egress="all")["network"] == {"egress": "all"}
    assert _core.create_body("t", *plain, egress="1.1.1.1,10.0.0.0/8:443")["network"] == {
        "egress": "1.1.1.1,10.0.0.0/8:443"
    }
    assert _core.create_body("t", *plain, egress=["1.1.1.1"])["network"] == {
        "egress": {"allow": ["1.1.1.1"]}
    }
    body = _core.exec_body("echo hi", None, None, None, b"in", True, 1.5, None)
    assert body == {"cmd": "echo hi", "stdin": "in", "stdin_open": True, "timeout_s": 1.5}
    with pytest.raises(ConfigError, match="stdin"):
        _core.exec_body(["cat"], None, None, None, b"\xff", False, None, None)
    call = _core.stdin_call("sb-0", 7, b"\x00\xff", False)
    assert call.json == {"data": "AP8=", "encoding": "base64"}
    assert _core.write_params("/a", 0o755, True) == [
        ("path", "/a"),
        ("mode", "755"),
        ("parents", "true"),
    ]
    assert _core.list_page(["sb-1", "sb-2"], {"k": "v"}, "running", 5, "t").params == [
        ("ids", "sb-1,sb-2"),
        ("label", "k=v"),
        ("state", "running"),
        ("limit", "5"),
        ("page_token", "t"),
    ]


def test_registry_auth_goes_in_the_image_and_hides_in_repr() -> None:
    image = _core.ImageSource(reference="127.0.0.1:5001/private/app:v1")
    for given, sent in [
        (_core.RegistryAuth(username="u", password="pw"), {"username": "u", "password": "pw"}),
        (("u", "pw"), {"username": "u", "password": "pw"}),
        ({"token": "tok"}, {"token": "tok"}),
    ]:
        call = _core.add_template("t", "/k", None, image, False, None, None, None, None,
                                  registry_auth=given)
        assert call.json["image"] == {"reference": image.reference, "auth": sent}
    assert "hunter2" not in repr(_core.RegistryAuth(username="u", password="hunter2"))
    assert "hunter2" not in repr(_core.RegistryAuth(token="hunter2"))
    with pytest.raises(ConfigError, match="registry_auth"):
        _core.add_template("t", "/k", None, image, False, None, None, None, None,
                           registry_auth=_core.RegistryAuth(username="u"))
    with pytest.raises(ConfigError, match="registry_auth"):
        _core.add_template("t", "/k", None, {"docker_archive": "/a.tar"}, False, None, None,
                           None, None, registry_auth=("u", "pw"))


def test_docker_templates_and_docker_run_argv() -> None:
    call = _core.add_template("d", "/k", None, None, True, None, None, None, None, docker=True)
    assert call.json["docker"] is True
    plain = _core.add_template("p", "/k", None, None, False, None, None, None, None)
    assert "docker" not in plain.json
    assert _core.Template.from_json(
        {"name": "d", "kernel": "/k", "vcpus": 1, "memory_mib": 128, "docker": True}
    ).docker
    # An argv: no shell between the exec and docker, so nothing is quoted.
    argv = _core.docker_run_argv(
        "10.0.0.2:5000/app:1", ["echo", "a b; $x"], False, None, {"K": "v w"}, "none", ["-m", "64m"]
    )
    assert argv == [
        "docker", "run", "--rm", "--env", "K=v w", "--network", "none", "-m", "64m",
        "10.0.0.2:5000/app:1", "echo", "a b; $x",
    ]
    assert _core.docker_run_argv("busybox", "sleep 9 && true", True, "s", None, None, None) == [
        "docker", "run", "--detach", "--name", "s", "busybox", "sh", "-c", "sleep 9 && true",
    ]
    assert _core.docker_run_argv("busybox", None, False, None, None, None, None)[-1] == "busybox"
    body = _core.exec_body(argv, None, None, None, None, False, 30, None)
    assert body == {"cmd": argv, "timeout_s": 30}
    for image in ["", "--privileged", "a b"]:
        with pytest.raises(ConfigError, match="image"):
            _core.docker_run_argv(image, None, False, None, None, None, None)
    with pytest.raises(ConfigError, match="env"):
        _core.docker_run_argv("busybox", None, False, None, {"A=B": "c"}, None, None)
