"""API-key authentication: ``Authorization: Bearer fw-…`` → KeyRecord → TenantRecord."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from redis.asyncio import Redis

from contracts import keyformat, schema
from gateway.errors import Forbidden, RateLimited, Unauthorized
from gateway.identity.readmodel import ReadModelCache

log = logging.getLogger("gateway.auth")

# Longer secrets are not ours; refusing them early keeps HMAC input bounded.
MAX_SECRET_LEN = 256


@dataclass(frozen=True, slots=True)
class Principal:
    key: schema.KeyRecord
    tenant: schema.TenantRecord


class FailureLimiter:
    """A token bucket of failed authentications per client address, in process.

    Each failure takes a token; ``burst`` of them refill at ``per_s``. An address with an
    empty bucket is answered 429 before any hashing or lookup, so a client guessing keys
    costs one dict lookup per request, not a Redis read. A lookup in the store takes its
    token before the read (``take``) and settles it after (``resolve``: a good key gives it
    back): charged only after the read, every request already in flight when a token
    refilled would reach the store. A cold lookup that finds the budget held by lookups
    still in flight waits for one of them (``wait_resolved``) instead of being refused, so
    many good keys arriving together from one address (a customer behind one NAT, after a
    restart) all authenticate, while a guesser's wave reads the store ``burst`` times.
    The map is an LRU of at most ``max_addresses`` buckets: a spray from many addresses
    cannot grow it without bound (an evicted address simply starts with a full bucket).
    """

    def __init__(self, burst: int, per_s: float, max_addresses: int) -> None:
        self._burst = float(burst)
        self._per_s = per_s
        self._max = max_addresses
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, at
        self._pending: dict[str, int] = {}  # lookups in flight holding a token, by address
        self._resolved: dict[str, asyncio.Event] = {}  # set when one of them settles

    def _tokens(self, address: str, now: float) -> float:
        entry = self._buckets.get(address)
        if entry is None:
            return self._burst
        tokens, at = entry
        return min(self._burst, tokens + (now - at) * self._per_s)

    def retry_after(self, address: str | None, now: float | None = None) -> int:
        """0 when the address may try; else whole seconds until its next token."""
        if address is None or address not in self._buckets:
            return 0
        tokens = self._tokens(address, time.monotonic() if now is None else now)
        if tokens >= 1.0:
            return 0
        return max(1, math.ceil((1.0 - tokens) / self._per_s))

    def failed(self, address: str | None, now: float | None = None) -> None:
        self._add(address, -1.0, now)

    def take(self, address: str | None) -> None:
        """A token reserved for a lookup whose outcome is not known yet."""
        if address is not None:
            self._add(address, -1.0, None)
            self._pending[address] = self._pending.get(address, 0) + 1

    def resolve(self, address: str | None, *, good: bool) -> None:
        """The reserved lookup settled: a good key (or no authentication verdict at all)
        gives its token back; a failure keeps it spent."""
        if address is None:
            return
        if good:
            self._add(address, 1.0, None)
        left = self._pending.get(address, 0) - 1
        if left > 0:
            self._pending[address] = left
        else:
            self._pending.pop(address, None)
        event = self._resolved.pop(address, None)
        if event is not None:
            event.set()

    def pending(self, address: str | None) -> int:
        return self._pending.get(address, 0) if address is not None else 0

    async def wait_resolved(self, address: str, within: float) -> bool:
        """Until one of the address's pending lookups settles (False: none did in time)."""
        event = self._resolved.setdefault(address, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), within)
        except TimeoutError:
            return False
        return True

    def _add(self, address: str | None, delta: float, now: float | None) -> None:
        if address is None:
            return
        now = time.monotonic() if now is None else now
        tokens = min(self._burst, max(0.0, self._tokens(address, now) + delta))
        self._buckets[address] = (tokens, now)
        self._buckets.move_to_end(address)
        while len(self._buckets) > self._max:
            self._buckets.popitem(last=False)

    def __len__(self) -> int:
        return len(self._buckets)


class Authenticator:
    def __init__(
        self,
        readmodel: ReadModelCache,
        pepper: bytes,
        last_used: LastUsedRecorder,
        *,
        previous_pepper: bytes | None = None,
        failures: FailureLimiter | None = None,
        legacy_keys: bool = True,
    ) -> None:
        self._readmodel = readmodel
        self._pepper = pepper
        # Pepper rotation (docs/operations.md): keys created before it still match.
        self._previous = previous_pepper if previous_pepper != pepper else None
        self._last_used = last_used
        self._failures = failures if failures is not None else FailureLimiter(20, 2.0, 10_000)
        self._legacy_keys = legacy_keys

    async def authenticate(
        self, authorization: bytes | None, scope: str, client: str | None = None
    ) -> Principal:
        reserved = _Reservation()
        try:
            principal = await self._authenticate(authorization, scope, client, reserved)
        except Unauthorized:
            if reserved.taken:
                self._failures.resolve(client, good=False)
            else:
                self._failures.failed(client)
            raise
        except BaseException:
            if reserved.taken:  # not an authentication failure (suspended, scope, cancelled)
                self._failures.resolve(client, good=True)
            raise
        if reserved.taken:
            self._failures.resolve(client, good=True)
        return principal

    async def _authenticate(
        self,
        authorization: bytes | None,
        scope: str,
        client: str | None,
        reserved: _Reservation,
    ) -> Principal:
        wait = self._failures.retry_after(client)
        secret = _bearer_secret(authorization)
        shape = keyformat.classify(secret, legacy_allowed=self._legacy_keys)
        if shape == "malformed":
            if wait:
                raise _too_many_failures(wait)
            raise Unauthorized("Incorrect API key provided.")
        key_hash = schema.hash_api_key(secret, self._pepper)
        cached = self._readmodel.cached_key(key_hash)
        key: schema.KeyRecord | None
        if wait and cached is not None:
            # Over its failure budget, an address is served only keys this process already
            # holds (a tenant behind the same NAT as a guesser keeps working).
            key = cached
        else:
            if cached is None:
                await self._reserve(client, wait)
                reserved.taken = True
            key = await self._readmodel.key(key_hash)
            if key is None and self._previous is not None:
                key = await self._readmodel.key(schema.hash_api_key(secret, self._previous))
        now = time.time()
        if key is None:
            raise Unauthorized("Incorrect API key provided.")
        if key.is_expired(now):
            raise Unauthorized("The API key has expired.")
        tenant = await self._readmodel.tenant(key.tenant_id)
        if tenant is None:
            raise Unauthorized("The API key's organization no longer exists.")
        if tenant.suspended:
            raise Forbidden("The organization is suspended.", code="organization_suspended")
        if scope not in key.scopes:
            raise Forbidden(f"The API key lacks the '{scope}' scope.", code="insufficient_scope")
        self._last_used.touch(key.key_id, now)
        return Principal(key=key, tenant=tenant)

    async def _reserve(self, client: str | None, wait: int) -> None:
        """A failure token for a store lookup; over budget, wait while this address's
        lookups in flight may still give theirs back, else 429 without reading."""
        while wait:
            assert client is not None  # an address without a budget never waits
            if not self._failures.pending(client):
                raise _too_many_failures(wait)
            if not await self._failures.wait_resolved(client, LOOKUP_WAIT_S):
                raise _too_many_failures(wait)
            wait = self._failures.retry_after(client)
        self._failures.take(client)  # no await since the check: the reservation holds


class _Reservation:
    """Whether this request took a failure token before reading the store."""

    __slots__ = ("taken",)

    def __init__(self) -> None:
        self.taken = False


LOOKUP_WAIT_S = 2.0  # longest a cold lookup waits for its address's lookups in flight


def _too_many_failures(wait: int) -> RateLimited:
    return RateLimited(
        "Too many failed authentication attempts from this address; retry later.",
        code="too_many_auth_failures",
        headers={"retry-after": str(wait)},
    )


def _bearer_secret(authorization: bytes | None) -> str:
    if not authorization:
        raise Unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer fw-...'."
        )
    try:
        text = authorization.decode("ascii")
    except UnicodeDecodeError:
        raise Unauthorized("Malformed Authorization header.") from None
    scheme, _, secret = text.strip().partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        raise Unauthorized("Malformed Authorization header; expected 'Bearer fw-...'.")
    if not secret.startswith(schema.API_KEY_PREFIX) or len(secret) > MAX_SECRET_LEN:
        raise Unauthorized("Incorrect API key provided.")
    return secret


class LastUsedRecorder:
    """Batches key last-use stamps in memory and flushes them off the hot path.

    One ``HSET`` every few seconds per process instead of one write per request. The
    control plane reads the hash into ``ApiKey.last_used_at``; a lost flush only makes
    the stamp a few seconds older.
    """

    def __init__(self, redis: Redis, interval_s: float) -> None:
        self._redis = redis
        self._interval_s = interval_s
        self._pending: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def touch(self, key_id: str, now: float) -> None:
        self._pending[key_id] = int(now)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="last-used-flush")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self.flush()

    async def flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, {}
        try:
            await self._redis.hset(schema.KEY_LAST_USED_HASH, mapping=batch)  # type: ignore[arg-type]
        except Exception:
            # Keep the newest stamps for the next attempt.
            for key_id, ts in batch.items():
                self._pending[key_id] = max(ts, self._pending.get(key_id, 0))
            raise

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.flush()
            except Exception as exc:  # noqa: BLE001
                log.warning("last-used flush failed: %r", exc)
