"""``log.bound``: a handler's context on every line it logs, and only while it runs."""

from __future__ import annotations

import asyncio

import structlog

from tandem.common import log


def test_bound_context_is_put_back_as_it_was_when_blocks_nest() -> None:
    get = structlog.contextvars.get_contextvars
    structlog.contextvars.clear_contextvars()
    log.bind(service="worker")
    with log.bound(task_id="outer", model="digits"):
        assert get() == {"service": "worker", "task_id": "outer", "model": "digits"}
        with log.bound(task_id="inner", run="r1"):
            assert get() == {"service": "worker", "task_id": "inner", "model": "digits",
                             "run": "r1"}
        assert get() == {"service": "worker", "task_id": "outer", "model": "digits"}
    assert get() == {"service": "worker"}
    with log.bound(task_id="again"):  # a key seen before binds as the first time did
        assert get() == {"service": "worker", "task_id": "again"}
    assert get() == {"service": "worker"}
    structlog.contextvars.clear_contextvars()


async def test_each_task_sees_only_its_own_binding() -> None:
    seen: dict[str, object] = {}
    both = asyncio.Barrier(2)

    async def handle(task_id: str) -> None:
        with log.bound(task_id=task_id):
            await both.wait()  # both bound at once, each in its own context
            seen[task_id] = structlog.contextvars.get_contextvars().get("task_id")

    await asyncio.gather(handle("a"), handle("b"))
    assert seen == {"a": "a", "b": "b"}
    assert "task_id" not in structlog.contextvars.get_contextvars()
