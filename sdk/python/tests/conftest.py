"""Fixtures for the suite against a live `rollbox serve` (rollbox/tests/python_sdk.rs starts
one): ROLLBOX_SOCKET and ROLLBOX_API_KEY name it, ROLLBOX_SDK_KERNEL and ROLLBOX_SDK_CMDLINE
are the test guest, ROLLBOX_SDK_SCRATCH a host directory (exec and files reach a host agent,
so paths are the host's)."""

from __future__ import annotations

import importlib.util
import os
import uuid
from typing import Iterator

import pytest

from rollbox_sdk import Client, NotFound

# test_ray.py needs Ray, which only scripts/ray-venv.sh's venv has.
collect_ignore = [] if importlib.util.find_spec("ray") else ["test_ray.py"]

LIVE = all(
    os.environ.get(name)
    for name in ("ROLLBOX_API_KEY", "ROLLBOX_SDK_KERNEL", "ROLLBOX_SDK_SCRATCH")
)


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if LIVE:
        return
    # Without a daemon only the offline tests run; the live ones say why they did not.
    marker = pytest.mark.skip(reason="no daemon: run it through rollbox/tests/python_sdk.rs")
    for item in items:
        if "live" in item.keywords:
            item.add_marker(marker)


@pytest.fixture(scope="session")
def kernel() -> str:
    return os.environ["ROLLBOX_SDK_KERNEL"]


@pytest.fixture(scope="session")
def cmdline() -> str:
    return os.environ.get("ROLLBOX_SDK_CMDLINE", "")


@pytest.fixture(scope="session")
def scratch() -> str:
    return os.environ["ROLLBOX_SDK_SCRATCH"]


@pytest.fixture(scope="session")
def rb() -> Iterator[Client]:
    with Client() as client:
        yield client


@pytest.fixture(scope="session")
def template(rb: Client, kernel: str, cmdline: str) -> str:
    """The test guest, registered once as "guest"."""
    try:
        rb.get_template("guest")
    except NotFound:
        rb.add_template("guest", kernel, cmdline=cmdline, memory_mib=32)
    return "guest"


@pytest.fixture
def tag() -> str:
    """A label value unique to one test, so its filters see only its own sandboxes."""
    return uuid.uuid4().hex[:12]


@pytest.fixture
def sandbox(rb: Client, template: str, tag: str) -> Iterator[str]:
    sb = rb.create_sandbox(template, ttl_s=600, labels={"test": tag})
    yield sb.id
    rb.delete_sandbox(sb.id)
