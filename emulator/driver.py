"""Runs an ``Engine`` against the wall clock inside an asyncio loop.

Model time runs ``speed`` times faster than wall time. The loop is: step the engine (instant),
sleep until the wall time at which that step ends, then hand the step's events to each
request's ``handle.on_step(req)``. Sleep targets come from the engine clock, so timer overshoot
(~1 ms per sleep) is absorbed by the next sleep instead of accumulating. Only when the process
falls behind by more than ``tolerance`` of wall time (CPU-bound) does the model clock jump
forward to the wall clock, which shows honestly as higher latency; those jumps are counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from emulator.engine import Engine, Request

logger = logging.getLogger("emulator.driver")


class EngineDriver:
    def __init__(
        self,
        engine: Engine,
        speed: float = 1.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        tolerance: float = 0.1,
        on_kv_events: Callable[[list[Any]], None] | None = None,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.engine = engine
        self.speed = speed
        self._clock = clock
        self._on_kv_events = on_kv_events  # receives each step's KV-cache events, if any
        self._tolerance_model = tolerance * speed
        self._wall0 = clock()
        self._model0 = engine.now
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.clock_resyncs = 0
        self.clock_lag_model_seconds = 0.0  # total model time skipped to catch up with wall

    # -- clock ---------------------------------------------------------------------------

    def model_now(self) -> float:
        return self._model0 + (self._clock() - self._wall0) * self.speed

    def wall_for(self, model_time: float) -> float:
        return self._wall0 + (model_time - self._model0) / self.speed

    # -- requests ------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        handle: Any,
        **kwargs: Any,
    ) -> Request:
        """Add a request arriving now; ``handle.on_step(req)`` receives its token events."""
        engine = self.engine
        now = self.model_now()
        if engine.has_work():
            # Mid-step the engine clock is at that step's end (>= now); when lagging it is
            # behind, and the arrival is clamped to it so TTFT is never under-reported.
            arrival = min(now, engine.now)
        else:
            engine.advance_to(now)
            arrival = now
        req = engine.add_request(
            request_id, prompt_token_ids, max_tokens, arrival_time=arrival, **kwargs
        )
        req.handle = handle
        self._wake.set()
        return req

    def abort(self, req: Request, reason: str = "abort") -> None:
        if not req.finished:
            self.engine.abort(req.request_id, reason)

    # -- loop ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")
            self._task.add_done_callback(_log_crash)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        engine = self.engine
        clock = self._clock
        while True:
            if not engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                engine.advance_to(self.model_now())
                continue
            lag = self.model_now() - engine.now
            if lag > self._tolerance_model:
                self.clock_resyncs += 1
                self.clock_lag_model_seconds += lag
                engine.advance_to(engine.now + lag)
            result = engine.step()
            if self._on_kv_events is not None:
                events = engine.take_kv_events()
                if events:
                    self._on_kv_events(events)
            delay = self.wall_for(engine.now) - clock()
            # Always yield at least once so HTTP I/O interleaves with zero-length steps.
            await asyncio.sleep(delay if delay > 0 else 0)
            for req in result.emitted:
                handle = req.handle
                if handle is not None:
                    try:
                        handle.on_step(req)
                    except Exception:  # one broken stream must not stop the engine
                        logger.exception("stream handler failed for %s", req.request_id)
                        self.abort(req, "error")


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("engine loop died", exc_info=task.exception())
