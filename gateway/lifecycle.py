"""A worker process's lifecycle as requests see it: whether it is draining or started, and
the background work (idempotency records, admission settling) that must finish even when
the request that started it is cancelled, and that shutdown waits for."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger("gateway.server")
T = TypeVar("T")


class Lifecycle:
    def __init__(self) -> None:
        self._draining = False
        self._drain_begun: asyncio.Event | None = None
        self.started = False
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        if self._drain_begun is not None:
            if value:
                self._drain_begun.set()
            elif self._drain_begun.is_set():
                self._drain_begun = None

    async def drain_begun(self) -> None:
        """Returns once the drain has begun (at once while draining): what ends a request
        the gateway holds before its admission (gateway/admission/hold.py)."""
        if self._draining:
            return
        if self._drain_begun is None:
            self._drain_begun = asyncio.Event()
        await self._drain_begun.wait()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` to completion even if the request that started it is cancelled;
        shutdown waits for it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task failed: %r", task.exception())

    async def wait_background(self, timeout_s: float) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout_s)
