"""429 from a daemon whose creates are slow and limited to one in flight
(rollbox/tests/python_sdk.rs runs it alone, with `-m overload`, against such a daemon)."""

from __future__ import annotations

import asyncio

import pytest

from rollbox_sdk import AsyncClient, Client, Overloaded

pytestmark = [pytest.mark.live, pytest.mark.overload]


def test_a_create_over_the_pending_limit_is_overloaded(template: str, tag: str) -> None:
    asyncio.run(overloaded(template, tag))


async def overloaded(template: str, tag: str) -> None:
    async with AsyncClient() as rb:
        first = asyncio.ensure_future(rb.create_sandbox(template, ttl_s=60, labels={"test": tag}))
        await asyncio.sleep(0.7)  # the first is surely in flight (its VMM starts 2 s late)
        with pytest.raises(Overloaded) as caught:
            await rb.create_sandbox(template, ttl_s=60)
        assert caught.value.status == 429 and caught.value.retry_after == 1.0
        assert "in flight" in caught.value.message
        with pytest.raises(Overloaded):
            await rb.create_batch(1, template, ttl_s=60)
        sandbox = await first
        assert sandbox.state == "running"
    with Client() as rb:
        assert rb.delete_sandboxes(labels={"test": tag}) == [sandbox.id]
