"""The pool that counts large prompts off the event loop is fair between tenants: one
tenant's backlog of large bodies does not stand in front of another tenant's count.

Real threads; the order is made deterministic by holding the first count on an event."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from gateway.admission.tokens import INLINE_MAX_BYTES, CountingPool

LARGE = INLINE_MAX_BYTES + 1


def _job(order: list[str], name: str, gate: threading.Event | None = None) -> Callable[[], str]:
    def count() -> str:
        if gate is not None:
            assert gate.wait(10), "the test never opened the gate"
        order.append(name)
        return name

    return count


async def _until(predicate: Callable[[], bool]) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


class OneThread:
    """A one-thread pool whose first count is held on the thread until ``release``, so
    what queues behind it is served in a known order; ``order`` records the counts run."""

    first: asyncio.Task[str]  # the held count, once ``hold`` ran

    def __init__(self) -> None:
        self.pool = CountingPool(threads=1)
        self.order: list[str] = []
        self._gate = threading.Event()

    async def hold(self, tenant: str, name: str) -> None:
        self.first = asyncio.create_task(
            self.pool.run(tenant, LARGE, _job(self.order, name, self._gate))
        )
        await _until(lambda: self.pool.running == 1)

    def submit(self, tenant: str, name: str) -> asyncio.Task[str]:
        return asyncio.create_task(self.pool.run(tenant, LARGE, _job(self.order, name)))

    async def queued(self, n: int) -> None:
        await _until(lambda: self.pool.waiting == n)

    def release(self) -> None:
        self._gate.set()


async def test_a_tenants_backlog_does_not_stand_in_front_of_another_tenant() -> None:
    t = OneThread()
    try:
        await t.hold("heavy", "heavy-1")
        backlog = [t.submit("heavy", f"heavy-{i}") for i in range(2, 9)]
        await t.queued(7)
        other = t.submit("light", "light-1")
        await t.queued(8)
        t.release()
        assert await other == "light-1"
        await asyncio.gather(t.first, *backlog)
    finally:
        t.pool.close()
    # heavy's turn came before light arrived, so one more of its counts goes first; then
    # light, then the rest of heavy's backlog. FIFO would have put light last.
    assert t.order == ["heavy-1", "heavy-2", "light-1", *[f"heavy-{i}" for i in range(3, 9)]]


async def test_tenants_waiting_together_take_turns() -> None:
    t = OneThread()
    try:
        await t.hold("a", "a-0")
        tasks = [t.submit(tenant, f"{tenant}-{i}") for tenant in ("a", "b", "c") for i in (1, 2)]
        await t.queued(6)
        t.release()
        await asyncio.gather(t.first, *tasks)
    finally:
        t.pool.close()
    assert t.order == ["a-0", "a-1", "b-1", "c-1", "a-2", "b-2", "c-2"]


async def test_a_cancelled_wait_is_skipped_and_frees_nothing_twice() -> None:
    t = OneThread()
    try:
        await t.hold("a", "a-1")
        gone = t.submit("b", "b-gone")
        kept = t.submit("c", "c-1")
        await t.queued(2)
        gone.cancel()  # the client went away while its count waited
        t.release()
        assert await kept == "c-1"
        assert await t.first == "a-1"
        with pytest.raises(asyncio.CancelledError):
            await gone
        # the thread is free again: a later count runs at once
        assert await t.submit("b", "b-2") == "b-2"
    finally:
        t.pool.close()
    assert t.order == ["a-1", "c-1", "b-2"]


async def test_errors_reach_the_caller_and_small_bodies_are_counted_inline() -> None:
    pool = CountingPool(threads=2)

    def broken() -> int:
        raise ValueError("bad tokenizer input")

    try:
        with pytest.raises(ValueError, match="bad tokenizer input"):
            await pool.run("a", LARGE, broken)
        caller = threading.get_ident()
        assert await pool.run("a", INLINE_MAX_BYTES, threading.get_ident) == caller
        assert await pool.run("a", LARGE, threading.get_ident) != caller
    finally:
        pool.close()
    # closed (the drain's stragglers): counted inline rather than refused
    assert await pool.run("a", LARGE, lambda: 7) == 7


def test_a_pool_needs_a_thread() -> None:
    with pytest.raises(ValueError):
        CountingPool(threads=0)
