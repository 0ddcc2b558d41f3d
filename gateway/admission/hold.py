"""The long-context hold (``AdmissionConfig.long_context_hold_s``; 0, the default, is off):
a request the long-context budget refuses with a told wait is kept by the gateway instead
of answered 503, while it has been held less than the bound in all. It waits the told wait
(the retry-after its 503 would have carried), then asks the budget again (the same admit
round trip), as a client honouring the retry-after would: the refusal recorded the tenant
as waiting and due back at that retry, so the turn order sees the held request exactly as
it sees a refused client coming back. Past the bound it gets the 503 of its last refusal.

A held request holds nothing of admission while it waits (a refused ask charges nothing),
only its connection and, in this process, a place among the held requests: at most
``long_context_hold_per_tenant`` per tenant and ``long_context_hold_max`` in all; past
either, the 503 at once, as without the hold (backpressure, not a queue). Its client
going away or the process starting its drain ends the wait at once.

``hold_wait_ms`` is the decision, pure; ``HoldPlaces`` the caps; ``LongContextHold`` the
loop the request pipeline runs around admission (gateway/endpoints/pipeline.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from gateway.errors import ApiError, Unavailable, retry_after_headers

T = TypeVar("T")

# The response header saying how long the gateway held the request before answering (ms),
# on every answer of a request it held at least once.
HELD_HEADER = "x-fairway-long-context-held-ms"

# What became of a long-context refusal the hold considered (the metric's ``outcome``):
# admitted after a hold; refused after a hold (its next told wait went past the bound);
# past_bound (not held: the first told wait alone went past it); over_cap (not held: the
# tenant's or the process's places were taken); client_gone, draining (the wait ended);
# other (a later ask ended another way: a quota 429, no replica, a store error).
Outcome = Literal[
    "admitted", "refused", "past_bound", "over_cap", "client_gone", "draining", "other"
]


class LongContextRefusal(Unavailable):
    """The long-context budget's 503 (``long_context_capacity``), with the retry-after it
    tells (``wait_ms``, jittered) kept for the hold."""

    def __init__(self, message: str, *, wait_ms: int, headers: dict[str, str]) -> None:
        super().__init__(message, code="long_context_capacity", headers=headers)
        self.wait_ms = wait_ms

    def after(self, *, waited_ms: float, held_ms: int, closing: bool = False) -> LongContextRefusal:
        """This refusal answered ``waited_ms`` into its wait: the retry-after is what is
        left of it (at least 1 ms), the held time is reported, and a process that is
        draining closes the connection."""
        left = max(1, round(self.wait_ms - waited_ms))
        headers = {**self.headers, **retry_after_headers(left), HELD_HEADER: str(held_ms)}
        if closing:
            headers["connection"] = "close"
        return LongContextRefusal(self.message, wait_ms=left, headers=headers)


class HoldEnded(Exception):
    """The process began its drain: a held request is answered its refusal at once (a
    client gone ends the wait with its own exception, which the pipeline answers as any
    client gone before admission)."""


def hold_wait_ms(*, told_ms: int, held_ms: float, bound_ms: float, left_ms: float) -> int | None:
    """How long to hold a refused long-context request before asking again (the told wait,
    ``told_ms``), or None: answer the 503 now. It is held only while its whole hold,
    ``held_ms`` so far plus this wait, stays within the bound (``bound_ms``; 0: the hold is
    off) and within ``left_ms``, the time its request deadlines leave. A wait past either
    is not held in part: the client is told it at once, and comes back at the same moment
    the held ask would have."""
    if bound_ms <= 0 or told_ms <= 0:
        return None
    if held_ms + told_ms > bound_ms or told_ms > left_ms:
        return None
    return told_ms


class HoldPlaces:
    """The places of this process's held requests: at most ``per_tenant`` per tenant and
    ``total`` in all."""

    def __init__(self, per_tenant: int, total: int) -> None:
        self.per_tenant = per_tenant
        self.total = total
        self._by_tenant: dict[str, int] = {}
        self._held = 0

    @property
    def held(self) -> int:
        return self._held

    def of(self, tenant: str) -> int:
        return self._by_tenant.get(tenant, 0)

    def take(self, tenant: str) -> bool:
        """One place for ``tenant``, or False when its own or the process's are taken."""
        if self._held >= self.total or self.of(tenant) >= self.per_tenant:
            return False
        self._by_tenant[tenant] = self.of(tenant) + 1
        self._held += 1
        return True

    def give_back(self, tenant: str) -> None:
        n = self.of(tenant) - 1
        if n > 0:
            self._by_tenant[tenant] = n
        else:
            self._by_tenant.pop(tenant, None)
        self._held -= 1


class HoldStats(Protocol):
    """What the hold reports (gateway/metrics.py's ``AdmissionMetrics`` implements it)."""

    def hold_ended(self, outcome: Outcome, held_s: float | None) -> None:
        """One refusal the hold considered: its outcome, and how long it was held (None:
        it was not held)."""

    def holding(self, delta: int) -> None:
        """Requests held now in this process, up or down by ``delta``."""


class NullHoldStats:
    def hold_ended(self, outcome: Outcome, held_s: float | None) -> None:
        pass

    def holding(self, delta: int) -> None:
        pass


@dataclass(slots=True)
class Held:
    """How long the gateway held a request it then admitted."""

    held_ms: int

    @property
    def held_s(self) -> float:
        return self.held_ms / 1000


class LongContextHold:
    """The hold loop around one request's admission (see the module doc)."""

    def __init__(
        self,
        bound_s: float,
        places: HoldPlaces,
        stats: HoldStats | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.bound_ms = bound_s * 1000
        self.places = places
        self.stats: HoldStats = stats or NullHoldStats()
        self._sleep = sleep

    @property
    def enabled(self) -> bool:
        return self.bound_ms > 0

    async def run(
        self,
        refusal: LongContextRefusal,
        ask: Callable[[], Awaitable[T]],
        *,
        tenant: str,
        left_s: float,
        ended: Callable[[], Awaitable[BaseException]],
    ) -> tuple[T, Held]:
        """Hold the request ``refusal`` refused: wait its told wait, then ``ask`` again,
        while ``hold_wait_ms`` allows; the admitted answer and how long it was held, or
        the refusal to answer (``LongContextRefusal.after``). ``left_s``: the time its
        request deadlines leave it. ``ended``: what ends a wait from outside — awaited
        beside each wait, it returns the exception to raise (the client's going away) or
        ``HoldEnded`` (the drain: the refusal is answered, the connection closed)."""
        wait = hold_wait_ms(
            told_ms=refusal.wait_ms, held_ms=0, bound_ms=self.bound_ms, left_ms=left_s * 1000
        )
        if wait is None:
            self.stats.hold_ended("past_bound", None)
            raise refusal
        if not self.places.take(tenant):
            self.stats.hold_ended("over_cap", None)
            raise refusal
        self.stats.holding(1)
        start = time.monotonic()
        outcome: Outcome = "other"
        watch = asyncio.ensure_future(ended())
        try:
            while True:
                waited_from = time.monotonic()
                sleep = asyncio.ensure_future(self._sleep(wait / 1000))
                try:
                    await asyncio.wait({sleep, watch}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    sleep.cancel()
                held_ms = _ms_since(start)
                if watch.done():
                    stop = watch.result()
                    if isinstance(stop, HoldEnded):
                        outcome = "draining"
                        waited = (time.monotonic() - waited_from) * 1000
                        raise refusal.after(waited_ms=waited, held_ms=held_ms, closing=True)
                    outcome = "client_gone"
                    raise stop
                try:
                    got = await ask()
                except LongContextRefusal as again:
                    refusal = again
                except ApiError as other:  # a quota 429, no replica: answered as it is
                    other.headers[HELD_HEADER] = str(_ms_since(start))
                    raise
                else:
                    outcome = "admitted"
                    return got, Held(_ms_since(start))
                held_ms = _ms_since(start)
                left_ms = left_s * 1000 - held_ms
                next_wait = hold_wait_ms(
                    told_ms=refusal.wait_ms,
                    held_ms=held_ms,
                    bound_ms=self.bound_ms,
                    left_ms=left_ms,
                )
                if next_wait is None:
                    outcome = "refused"
                    raise refusal.after(waited_ms=0, held_ms=held_ms)
                wait = next_wait
        finally:
            watch.cancel()
            self.places.give_back(tenant)
            self.stats.holding(-1)
            self.stats.hold_ended(outcome, time.monotonic() - start)


def _ms_since(start: float) -> int:
    return round((time.monotonic() - start) * 1000)
