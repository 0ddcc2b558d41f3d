"""Which requests are retries (docs/design.md R6, "identity of retries"): only what the
gateway can tell is one, never the client's word.

Two signals. An ``Idempotency-Key`` whose earlier attempt failed (the idempotency store's
tombstone, gateway/admission/idempotency.py) decides for a request that carries one. For the
others, this module's memory: the same tenant and API key sending the same body bytes again
within ``ttl_s`` of the gateway answering that body with a retryable failure (429, 408, 409,
5xx, a response cut off before completion, a client that went away before it) is a retry.
One failure answers for at most one retry: the retry takes the mark, and if it fails in turn
it leaves a new one. A success leaves nothing, so a body sent again after a success is a new
request. The ``x-stainless-retry-count`` header never makes a retry; it only says whether the
shared marks are worth a round trip (below).

Two levels:

- ``RetryMemory``, in this process: a bounded LRU of (tenant, key id, body digest) → (expiry,
  failures), aged by ``ttl_s``. A request of a tenant-key with no live mark costs one dict
  lookup and no hashing; only a tenant-key with a recent failure pays for the digest (the
  first 16 bytes of the body's SHA-256, hardware-assisted on this machine: 1.8x BLAKE2b's
  rate). It catches a retry sent on the same keep-alive connection (the openai SDK's pool
  reuses the connection for a retry within its 5 s keep-alive) whatever headers it has.
- ``SharedRetryMarks``, in Redis (``fw:rt:{<tenant>}:<key id>:<digest>``, a count with
  ``ttl_s``): every failure leaves its mark there too (written off the response path), and a
  request that this process cannot place but that says it is a retry
  (``x-stainless-retry-count`` > 0) is checked there, one round trip. A retry that honours a
  503's ``retry-after`` (5 s and more) outlives the SDK's 5 s keep-alive, so it comes on a
  new connection, which the load balancer (nginx, least connections) or the kernel (the
  workers' shared socket) may hand to any process: the shared mark is what recognises it. A
  client lying with the header costs itself one round trip and counts nothing; a client that
  retries on another process without the header is not recognised (a first attempt: its
  quota still applies).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

DIGEST_BYTES = 16
SHARED_PREFIX = "fw:rt:"

# The statuses after which the official SDKs retry (408, 409, 429, 5xx), and the gateway's
# own for a client that went away before the answer (nginx's 499).
RETRYABLE = frozenset({408, 409, 429, 499})


def retryable(status: int) -> bool:
    """Whether a client (the openai SDK among them) retries after this answer."""
    return status >= 500 or status in RETRYABLE


@dataclass(slots=True)
class RequestPrint:
    """One request's identity for the memory: its tenant, its API key and its body bytes;
    the digest is computed once, and only when asked for."""

    tenant_id: str
    key_id: str
    body: bytes
    _digest: bytes | None = field(default=None, repr=False)

    @property
    def owner(self) -> tuple[str, str]:
        return self.tenant_id, self.key_id

    @property
    def digest(self) -> bytes:
        if self._digest is None:
            self._digest = hashlib.sha256(self.body).digest()[:DIGEST_BYTES]
        return self._digest

    def shared_key(self) -> str:
        # The tenant in the hash tag: one tenant's marks share a slot on a cluster.
        return f"{SHARED_PREFIX}{{{self.tenant_id}}}:{self.key_id}:{self.digest.hex()}"


class RetryMemory:
    """The recent retryable failures this process answered, per tenant and key (pure: the
    clock is injected). Bounded by ``max_entries`` (the least recently failed go first) and
    aged by ``ttl_s``."""

    def __init__(
        self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError("max_entries >= 1 and ttl_s > 0")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        # (tenant, key, digest) -> (expires at, failures not yet taken by a retry); in
        # order of expiry (a new failure moves its entry to the end).
        self._entries: OrderedDict[tuple[str, str, bytes], tuple[float, int]] = OrderedDict()
        self._owners: Counter[tuple[str, str]] = Counter()  # live entries per tenant-key

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, entry: tuple[str, str, bytes]) -> None:
        del self._entries[entry]
        owner = entry[0], entry[1]
        self._owners[owner] -= 1
        if self._owners[owner] <= 0:
            del self._owners[owner]

    def _expire(self, now: float) -> None:
        while self._entries:
            entry, (expires, _) = next(iter(self._entries.items()))
            if expires > now:
                return
            self._drop(entry)

    def failed(self, p: RequestPrint) -> None:
        """This request was answered with a retryable failure: its next attempt is a retry."""
        now = self._clock()
        self._expire(now)
        entry = (p.tenant_id, p.key_id, p.digest)
        held = self._entries.pop(entry, None)
        if held is None:
            self._owners[p.owner] += 1
        self._entries[entry] = (now + self.ttl_s, (held[1] if held else 0) + 1)
        while len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))

    def take(self, p: RequestPrint) -> bool:
        """True (and one failure consumed) when this request repeats one that failed within
        ``ttl_s``; a tenant-key with no live mark answers without hashing the body."""
        if p.owner not in self._owners:
            return False
        self._expire(self._clock())
        entry = (p.tenant_id, p.key_id, p.digest)
        held = self._entries.get(entry)
        if held is None:
            return False
        if held[1] > 1:
            self._entries[entry] = (held[0], held[1] - 1)
        else:
            self._drop(entry)
        return True


# KEYS[1] the mark. Returns 1 and takes one failure when there is one, else 0 (no key left
# behind either way).
_TAKE = """
local n = redis.call('DECR', KEYS[1])
if n < 0 then redis.call('DEL', KEYS[1]) return 0 end
if n == 0 then redis.call('DEL', KEYS[1]) end
return 1
"""


class SharedRetryMarks:
    """The same marks in Redis, for a retry that reaches another process."""

    def __init__(self, redis: Redis, ttl_s: float) -> None:
        self._redis = redis
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._take = redis.register_script(_TAKE)

    async def failed(self, p: RequestPrint) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.incr(p.shared_key())
            pipe.pexpire(p.shared_key(), self._ttl_ms)
            await pipe.execute()

    async def take(self, p: RequestPrint) -> bool:
        return bool(await self._take(keys=[p.shared_key()]))


class RetryIdentity:
    """Both levels together, as the request pipeline asks them."""

    def __init__(
        self,
        memory: RetryMemory,
        shared: SharedRetryMarks | None,
        spawn: Callable[[Coroutine[Any, Any, Any]], object],
    ) -> None:
        self.memory = memory
        self.shared = shared
        self._spawn = spawn

    async def recognise(self, p: RequestPrint, *, claimed: bool) -> str | None:
        """How this request is known to be a retry (``"memory"``, ``"shared"``), or None: a
        first attempt. ``claimed``: the client says it retries (only buys the shared look-up)."""
        if self.memory.take(p):
            if self.shared is not None:
                self._spawn(self._take_quietly(p))  # the same failure's shared mark
            return "memory"
        if claimed and self.shared is not None and await self._take_quietly(p):
            return "shared"
        return None

    def failed(self, p: RequestPrint) -> None:
        self.memory.failed(p)
        if self.shared is not None:
            self._spawn(self._fail_quietly(p))

    async def _take_quietly(self, p: RequestPrint) -> bool:
        # Store trouble makes a first attempt, never a refusal: the retry budget is the
        # only thing that reads the answer.
        try:
            return await self.shared.take(p) if self.shared is not None else False
        except RedisError:
            return False

    async def _fail_quietly(self, p: RequestPrint) -> None:
        with contextlib.suppress(RedisError):
            if self.shared is not None:
                await self.shared.failed(p)
