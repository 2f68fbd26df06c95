"""A template built from a `docker save` archive with a boot snapshot (rollbox/tests/
python_sdk.rs runs it alone, with `-m image`, as root, with ROLLBOX_SDK_IMAGE_ARCHIVE)."""

from __future__ import annotations

import os

import pytest

import sys

from rollbox_sdk import Client, Conflict, ImageSource, NotFound, function

pytestmark = [pytest.mark.live, pytest.mark.image]


def test_image_template_with_boot_snapshot(rb: Client, kernel: str, cmdline: str) -> None:
    archive = os.environ["ROLLBOX_SDK_IMAGE_ARCHIVE"]
    reference = os.environ["ROLLBOX_SDK_IMAGE_REFERENCE"]
    template = rb.add_template(
        "sdk-img",
        kernel,
        cmdline=cmdline,
        memory_mib=32,
        image=ImageSource(docker_archive=archive, reference=reference),
        boot_snapshot=True,
    )
    assert template.image and template.image.startswith(f"{reference}@sha256:")
    assert template.rootfs and template.rootfs.endswith("sdk-img/rootfs.ext4")
    assert template.boot_snapshot and template.boot_snapshot.startswith("snap-")
    sb = rb.create_sandbox("sdk-img", ttl_s=120)
    assert rb.run(sb, ["sh", "-c", "echo ok"]).stdout == "ok\n"
    assert rb.reset(sb).state == "running"
    with pytest.raises(Conflict, match="sdk-img"):
        rb.delete_snapshot(template.boot_snapshot)
    rb.delete_template("sdk-img")
    with pytest.raises(NotFound):
        rb.get_snapshot(template.boot_snapshot)
    assert rb.get_sandbox(sb).state == "running"
    rb.delete_sandbox(sb)


def test_a_function_from_an_image(rb: Client, kernel: str, scratch: str) -> None:
    """`@function(image=...)`: the image becomes a template with a boot snapshot at the first
    call, and later calls (and functions of the same image) use it."""
    source = ImageSource(
        docker_archive=os.environ["ROLLBOX_SDK_IMAGE_ARCHIVE"],
        reference=os.environ["ROLLBOX_SDK_IMAGE_REFERENCE"],
    )

    @function(image=source, kernel=kernel, memory_mib=32, client=rb, workdir=scratch,
              python=sys.executable, timeout_s=120)
    def answer(x: int) -> int:
        return x * 2

    assert answer.template is None, "made at the first call"
    assert answer.remote(21) == 42
    name = answer.template
    assert name and name.startswith("fn-")
    made = rb.get_template(name)
    assert made.boot_snapshot and made.image
    assert answer.remote(1) == 2

    @function(image=source, kernel=kernel, memory_mib=32, client=rb, workdir=scratch,
              python=sys.executable, timeout_s=120)
    def again() -> str:
        return "same template"

    assert again.remote() == "same template"
    assert again.template == name
    rb.delete_template(name)
