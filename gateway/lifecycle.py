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
        self.draining = False
        self.started = False
        self._background: set[asyncio.Task[Any]] = set()

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
