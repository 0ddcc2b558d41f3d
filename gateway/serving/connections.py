"""Connection-level limits: one slow or greedy client must not hold what others need.

- ``header_protocol``: uvicorn's httptools protocol with a deadline for a request's head.
  uvicorn has none (its keep-alive timeout stops at the first byte), so a client trickling
  header bytes would hold a connection, and a slot of ``limit_concurrency``, for ever.
- ``TenantConnections``: concurrent requests per tenant in this process; past the cap a
  tenant gets 429 while others are served.
- ``RecentRefusals``: a tenant and model refused with 429 on requests per minute are
  remembered for the Retry-After they were given; until then a new request is refused from
  memory, before its body is parsed or the limits store is asked again. (Only that layer:
  a tokens refusal depends on the request's size and a KV·seconds one on what is in
  flight, so a different request may well pass.)
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import ApiError, RateLimited, retry_after_headers


def header_protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """The httptools protocol, closing a connection whose request head is not complete
    ``header_timeout_s`` after it connected or after the head's first byte.

    One timer per connection, not one per request: a head's start is only noted, and a
    timer that fires while a later head is pending is set again for that head's remainder
    (a keep-alive connection's requests each cost a clock read, not a timer and its
    cancellation; see bench/results/gateway_cpu_trace.md)."""

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_since: float | None = None  # loop time the pending head began; None: none

        def _head_begins(self) -> None:
            if self._head_since is None:
                self._head_since = self.loop.time()
                if self._head_timer is None:
                    self._head_timer = self.loop.call_later(header_timeout_s, self._head_due)

        def _head_due(self) -> None:
            self._head_timer = None
            if self._head_since is None:
                return  # that head completed; the next one sets a timer when it begins
            left = self._head_since + header_timeout_s - self.loop.time()
            # A later head than the one the timer was set for (1 ms: the timers' grain).
            if left > 0.001:
                self._head_timer = self.loop.call_later(left, self._head_due)
            elif self.transport is not None and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._head_begins()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_begins()

        def on_headers_complete(self) -> None:
            self._head_since = None
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_since = None
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

    return HeaderDeadlineProtocol


class TenantConnections:
    """Concurrent requests per tenant, in this process."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._open: dict[str, int] = {}

    def acquire(self, tenant_id: str) -> None:
        count = self._open.get(tenant_id, 0)
        if count >= self._cap:
            raise RateLimited(
                f"Too many concurrent requests for this organization (at most {self._cap} "
                "per gateway instance); wait for some to finish.",
                code="too_many_concurrent_requests",
                headers={"retry-after": "1"},
            )
        self._open[tenant_id] = count + 1

    def release(self, tenant_id: str) -> None:
        count = self._open.get(tenant_id, 0) - 1
        if count > 0:
            self._open[tenant_id] = count
        else:
            self._open.pop(tenant_id, None)

    def open(self, tenant_id: str) -> int:
        return self._open.get(tenant_id, 0)


# The model named in a chat body, found without parsing it (a hint only: a body it does not
# match is parsed as usual).
_MODEL = re.compile(rb'"model"\s*:\s*"([A-Za-z0-9._:/-]{1,200})"')


def peek_model(body: bytes) -> str | None:
    found = _MODEL.search(body, 0, 4096) or _MODEL.search(body)
    return found.group(1).decode("ascii") if found else None


class RecentRefusals:
    """(tenant, model) → when its last requests-per-minute 429 runs out; a bounded LRU."""

    LAYER = "requests"

    def __init__(self, max_entries: int = 10_000) -> None:
        # key -> (when the limit frees, when the client was told to retry, the refusal)
        self._until: OrderedDict[tuple[str, str], tuple[float, float, ApiError]] = OrderedDict()
        self._max = max_entries

    def remember(self, tenant_id: str, model: str, refusal: ApiError) -> None:
        if refusal.status != 429 or refusal.type != self.LAYER:
            return
        headers = refusal.headers
        try:
            ms = headers.get("retry-after-ms")
            told = float(ms) / 1000 if ms is not None else float(headers.get("retry-after", "0"))
        except ValueError:
            return
        # Remembered until the limit frees, not until the jittered Retry-After: the jitter
        # spreads this client's retries; it must not keep the tenant's other requests
        # refused after the store would admit them.
        frees = getattr(refusal, "frees_in_s", None)
        wait = min(told, frees) if frees is not None else told
        if wait <= 0:
            return
        key = (tenant_id, model)
        now = time.monotonic()
        self._until[key] = (now + wait, now + told, refusal)
        self._until.move_to_end(key)
        while len(self._until) > self._max:
            self._until.popitem(last=False)

    def forget(self, tenant_id: str | None) -> None:
        """A tenant's limits may have changed (None: every tenant's): what was refused on the
        old ones is asked again."""
        if tenant_id is None:
            self._until.clear()
        else:
            for key in [k for k in self._until if k[0] == tenant_id]:
                del self._until[key]

    def check(self, tenant_id: str, model: str | None) -> None:
        if model is None or not self._until:
            return
        entry = self._until.get((tenant_id, model))
        if entry is None:
            return
        until, told, refusal = entry
        now = time.monotonic()
        if until <= now:
            del self._until[(tenant_id, model)]
            return
        # The same answer as the refusal it repeats, its (jittered) delay counted down.
        left = told - now
        headers = {**refusal.headers, **retry_after_headers(left * 1000)}
        raise RateLimited(refusal.message, code=refusal.code, type=refusal.type, headers=headers)

    def __len__(self) -> int:
        return len(self._until)
