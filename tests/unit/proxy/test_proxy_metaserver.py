from __future__ import annotations

import asyncio

import pytest

from proxy.errors import ProxyError
from proxy.metaserver import Pending, PendingTable


def test_table_add_get_finish_releases_waiters() -> None:
    async def go() -> None:
        t = PendingTable()
        p = Pending("a", "/v1/completions", {}, 1)
        t.add(p)
        with pytest.raises(KeyError):
            t.add(Pending("a", "/v1/completions", {}, 1))
        assert t.get("a") is p and len(t) == 1
        p.dispatched = asyncio.get_running_loop().create_future()
        t.finish(p)
        assert t.get("a") is None and len(t) == 0 and p.done
        with pytest.raises(ProxyError) as ei:
            await p.dispatched
        assert ei.value.status == 404

    asyncio.run(go())


def test_fail_cancels_owner_once_and_not_after_start() -> None:
    async def go() -> None:
        p = Pending("a", "/v1/completions", {}, 1)
        owner = asyncio.get_running_loop().create_task(asyncio.sleep(30))
        p.owner = owner
        assert p.fail(ProxyError(502, "boom"))
        assert not p.fail(ProxyError(503, "second"))  # first error wins
        with pytest.raises(asyncio.CancelledError):
            await owner
        assert p.error is not None and p.error.status == 502

        q = Pending("b", "/v1/completions", {}, 1)
        owner2 = asyncio.get_running_loop().create_task(asyncio.sleep(0.05))
        q.owner = owner2
        q.started = True
        assert not q.fail(ProxyError(502, "late"))
        await owner2  # not cancelled
        assert q.error is None

    asyncio.run(go())


def test_deadline_fails_with_504_unless_disarmed() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        p = Pending("a", "/v1/completions", {}, 1)
        p.owner = loop.create_task(asyncio.sleep(30))
        p.arm_deadline(loop, 0.01)
        with pytest.raises(asyncio.CancelledError):
            await p.owner
        assert p.error is not None and p.error.status == 504 and "register" in p.error.message

        q = Pending("b", "/v1/completions", {}, 1)
        q.owner = loop.create_task(asyncio.sleep(0.1))
        q.arm_deadline(loop, 0.01)
        q.disarm_deadline()
        await q.owner
        assert q.error is None

    asyncio.run(go())
