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


async def test_a_tenants_backlog_does_not_stand_in_front_of_another_tenant() -> None:
    pool = CountingPool(threads=1)
    order: list[str] = []
    gate = threading.Event()
    try:
        first = asyncio.create_task(pool.run("heavy", LARGE, _job(order, "heavy-1", gate)))
        await _until(lambda: pool.running == 1)  # heavy-1 is on the thread, held at the gate
        backlog = [
            asyncio.create_task(pool.run("heavy", LARGE, _job(order, f"heavy-{i}")))
            for i in range(2, 9)
        ]
        await _until(lambda: pool.waiting == 7)
        other = asyncio.create_task(pool.run("light", LARGE, _job(order, "light-1")))
        await _until(lambda: pool.waiting == 8)
        gate.set()
        assert await other == "light-1"
        await asyncio.gather(first, *backlog)
    finally:
        pool.close()
    # heavy's turn came before light arrived, so one more of its counts goes first; then
    # light, then the rest of heavy's backlog. FIFO would have put light last.
    assert order == ["heavy-1", "heavy-2", "light-1", *[f"heavy-{i}" for i in range(3, 9)]]


async def test_tenants_waiting_together_take_turns() -> None:
    pool = CountingPool(threads=1)
    order: list[str] = []
    gate = threading.Event()
    try:
        first = asyncio.create_task(pool.run("a", LARGE, _job(order, "a-0", gate)))
        await _until(lambda: pool.running == 1)
        tasks = [
            asyncio.create_task(pool.run(tenant, LARGE, _job(order, f"{tenant}-{i}")))
            for tenant in ("a", "b", "c")
            for i in (1, 2)
        ]
        await _until(lambda: pool.waiting == 6)
        gate.set()
        await asyncio.gather(first, *tasks)
    finally:
        pool.close()
    assert order == ["a-0", "a-1", "b-1", "c-1", "a-2", "b-2", "c-2"]


async def test_a_cancelled_wait_is_skipped_and_frees_nothing_twice() -> None:
    pool = CountingPool(threads=1)
    order: list[str] = []
    gate = threading.Event()
    try:
        first = asyncio.create_task(pool.run("a", LARGE, _job(order, "a-1", gate)))
        await _until(lambda: pool.running == 1)
        gone = asyncio.create_task(pool.run("b", LARGE, _job(order, "b-gone")))
        kept = asyncio.create_task(pool.run("c", LARGE, _job(order, "c-1")))
        await _until(lambda: pool.waiting == 2)
        gone.cancel()  # the client went away while its count waited
        gate.set()
        assert await kept == "c-1"
        assert await first == "a-1"
        with pytest.raises(asyncio.CancelledError):
            await gone
        # the thread is free again: a later count runs at once
        assert await pool.run("b", LARGE, _job(order, "b-2")) == "b-2"
    finally:
        pool.close()
    assert order == ["a-1", "c-1", "b-2"]


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
