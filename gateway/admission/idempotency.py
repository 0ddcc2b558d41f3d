"""``Idempotency-Key`` (docs/design.md §3): a retried request replays the stored response,
not a new one.

Per tenant and key, one Redis hash holds the body's hash, a state and, once complete, the
response exactly as the client received it (the JSON body, or the SSE byte stream),
zlib-compressed, for 24 h. Every transition is one Lua call, so two gateways racing on the
same key cannot both generate:

- new key                          → claim it (``inflight``), generate
- same body, ``inflight``          → 409 (the first attempt is still running)
- same body, ``done``              → replay, no generation, no usage event; one request
                                     of requests/min, no tokens (``charge_replay``)
- same body, ``failed``            → claim again; this attempt is a retry (``is_retry``)
- different body, any state        → 422

A failed or cancelled attempt leaves a ``failed`` tombstone instead of the response, so the
client may retry, and the retry is recognised as one (R6's retry budget reads ``is_retry``).
A claim refused before any generation (quota, capacity, validation after the claim) keeps
its tombstone only briefly (``refused_ttl_s``): a tenant being refused must not be able to
fill the store with day-long records.

Each tenant has a budget of new records and of stored response bytes per record lifetime,
kept in one counter hash next to its records (the same hash slot, so the claim and the
count are one atomic call, in a cluster too). Past the record budget a new key is refused
with 429 (``idempotency_quota_exceeded``); past the byte budget a response is not kept (the
claim becomes a tombstone, so a retry generates again rather than replaying nothing).
"""

from __future__ import annotations

import hashlib
import secrets
import zlib
from dataclasses import dataclass

import orjson
from redis.asyncio import Redis

from gateway.errors import BadRequest, Conflict, RateLimited, Unprocessable

MAX_KEY_LEN = 255
KEY_PREFIX = "fw:idem:"

# KEYS[1] the record, KEYS[2] the tenant's counters; ARGV: body hash, owner, in-flight TTL,
# record budget, counter TTL.
_BEGIN = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  local n = tonumber(redis.call('HGET', KEYS[2], 'records') or '0')
  if n >= tonumber(ARGV[4]) then
    return {'quota', tostring(redis.call('TTL', KEYS[2]))}
  end
  if redis.call('HINCRBY', KEYS[2], 'records', 1) == 1 then
    redis.call('EXPIRE', KEYS[2], ARGV[5])
  end
  redis.call('HSET', KEYS[1], 'state', 'inflight', 'body', ARGV[1], 'owner', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  return {'fresh', '0'}
end
if redis.call('HGET', KEYS[1], 'body') ~= ARGV[1] then return {'mismatch', ''} end
if state == 'inflight' then return {'inflight', ''} end
if state == 'failed' then
  redis.call('HSET', KEYS[1], 'state', 'inflight', 'owner', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  return {'fresh', '1'}
end
return {'done', redis.call('HGET', KEYS[1], 'resp')}
"""

# KEYS[1] the record, KEYS[2] the tenant's counters; ARGV: owner, outcome, response, TTL,
# byte budget, counter TTL. Returns 1 stored, 2 tombstoned over the byte budget, 0 not ours.
_FINISH = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if ARGV[2] == 'done' then
  local used = tonumber(redis.call('HGET', KEYS[2], 'bytes') or '0')
  if used + string.len(ARGV[3]) <= tonumber(ARGV[5]) then
    redis.call('HINCRBY', KEYS[2], 'bytes', string.len(ARGV[3]))
    if redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], ARGV[6]) end
    redis.call('HSET', KEYS[1], 'state', 'done', 'resp', ARGV[3])
    redis.call('EXPIRE', KEYS[1], ARGV[4])
    return 1
  end
  redis.call('HSET', KEYS[1], 'state', 'failed')
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  return 2
end
redis.call('HSET', KEYS[1], 'state', 'failed')
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""

KIND_JSON = b"j"
KIND_SSE = b"s"


@dataclass(frozen=True, slots=True)
class Claim:
    redis_key: str
    owner: str
    is_retry: bool
    quota_key: str = ""


@dataclass(frozen=True, slots=True)
class Replay:
    kind: bytes  # KIND_JSON or KIND_SSE
    body: bytes


def validate_key(raw: bytes) -> str:
    try:
        key = raw.decode("ascii")
    except UnicodeDecodeError:
        raise BadRequest(
            "Idempotency-Key must be printable ASCII.",
            param="Idempotency-Key",
            code="invalid_idempotency_key",
        ) from None
    if not 0 < len(key) <= MAX_KEY_LEN or not key.isprintable():
        raise BadRequest(
            f"Idempotency-Key must be 1 to {MAX_KEY_LEN} printable characters.",
            param="Idempotency-Key",
            code="invalid_idempotency_key",
        )
    return key


def fingerprint(body: bytes) -> str:
    """SHA-256 of the body's canonical JSON (sorted keys, no spaces): the same request sent
    by a different client library, with its own key order and spacing, is the same body."""
    canonical = orjson.dumps(orjson.loads(body), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(canonical).hexdigest()


class IdempotencyStore:
    def __init__(
        self,
        redis: Redis,
        ttl_s: int,
        inflight_ttl_s: int,
        *,
        refused_ttl_s: int = 60,
        max_records: int = 100_000,
        max_bytes: int = 256 << 20,
    ) -> None:
        self._redis = redis
        self._ttl_s = ttl_s
        self._inflight_ttl_s = inflight_ttl_s
        self._refused_ttl_s = refused_ttl_s
        self._max_records = max_records
        self._max_bytes = max_bytes
        self._begin = redis.register_script(_BEGIN)
        self._finish = redis.register_script(_FINISH)

    @staticmethod
    def redis_key(tenant_id: str, key: str) -> str:
        # Hashing bounds the Redis key length and keeps the client's string out of it. The
        # braces put a tenant's records and counters in one cluster hash slot.
        digest = hashlib.sha256(key.encode()).hexdigest()
        return f"{KEY_PREFIX}{{{tenant_id}}}:{digest}"

    @staticmethod
    def quota_key(tenant_id: str) -> str:
        return f"{KEY_PREFIX}{{{tenant_id}}}:quota"

    async def begin(self, tenant_id: str, key: str, body: bytes) -> Claim | Replay:
        redis_key = self.redis_key(tenant_id, key)
        owner = secrets.token_hex(8)
        body_hash = fingerprint(body)
        quota_key = self.quota_key(tenant_id)
        state, value = await self._begin(
            keys=[redis_key, quota_key],
            args=[body_hash, owner, self._inflight_ttl_s, self._max_records, self._ttl_s],
        )
        if state == b"fresh":
            return Claim(
                redis_key=redis_key, owner=owner, is_retry=value == b"1", quota_key=quota_key
            )
        if state == b"quota":
            wait = int(value) if value.lstrip(b"-").isdigit() and int(value) > 0 else 60
            raise RateLimited(
                f"This organization holds the maximum of {self._max_records} "
                "Idempotency-Key records; retry later or send the request without one.",
                param="Idempotency-Key",
                code="idempotency_quota_exceeded",
                headers={"retry-after": str(wait)},
            )
        if state == b"mismatch":
            raise Unprocessable(
                "This Idempotency-Key was already used with a different request body.",
                param="Idempotency-Key",
                code="idempotency_key_reused",
            )
        if state == b"inflight":
            raise Conflict(
                "A request with this Idempotency-Key is still in progress; retry later.",
                param="Idempotency-Key",
                code="idempotency_key_in_use",
            )
        return Replay(kind=value[:1], body=zlib.decompress(value[1:]))

    async def complete(self, claim: Claim, kind: bytes, body: bytes) -> bool:
        """True when the response is kept for replays (False: over the byte budget)."""
        stored = kind + zlib.compress(body, 1)
        result = await self._finish(
            keys=[claim.redis_key, claim.quota_key],
            args=[claim.owner, "done", stored, self._ttl_s, self._max_bytes, self._ttl_s],
        )
        return bool(result == 1)

    async def abandon(self, claim: Claim, *, refused: bool = False) -> None:
        """A failed attempt's tombstone; ``refused``: nothing was generated, keep it briefly."""
        ttl = self._refused_ttl_s if refused else self._ttl_s
        await self._finish(
            keys=[claim.redis_key, claim.quota_key],
            args=[claim.owner, "failed", "", ttl, self._max_bytes, self._ttl_s],
        )
