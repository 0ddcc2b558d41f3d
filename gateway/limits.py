"""Quota state in Redis: one atomic script to admit, one to settle, one to renew leases.

Key layout (all under ``fw:rl:``; the ``{...}`` hash tag keeps one tenant-model's keys in
one slot):

- ``fw:rl:{<tenant>:<family>}:b``  HASH  requests and tokens buckets: ``rl``/``rt`` (level,
  last ms) and ``tl``/``tt``. TTL = time until both are full again (an absent bucket is full).
- ``fw:rl:{<tenant>:<family>}:l``  HASH  in-flight leases: ``<lease_id>`` -> ``"<est_kv>:<end>"``
  (milli-GiB·s, expected end in ms) and ``#`` -> their sum. TTL lease + 60 s, refreshed.
- ``fw:rl:{<tenant>:<family>}:e``  ZSET  ``<lease_id>`` scored by lease deadline (ms).
- ``fw:rl:rb:{<version>}``         HASH  retry budget: six slots ``0``..``5`` of
  ``"<slot index>:<admitted>:<retries>"`` over a sliding minute. TTL two windows.

Every script reads the clock with Redis ``TIME``, so all gateways share one clock. The
admit script also reclaims leases unrenewed past their deadline (a crashed gateway's
capacity comes back on that tenant's next admission, within the 15 s lease: no sweeper
process to run or to fail; a tenant that sends nothing more has nothing to compete for).

Overshoot under any concurrency (scripts are atomic): requests/min 0 (admit iff a whole
request is left); KV·seconds 0 except one request admitted alone whose estimate exceeds
the cap (it could otherwise never run); tokens/min at most one request's estimate (admit
while the bucket is positive, then charge the estimate: a large request is not starved by
a stream of small ones, and the debt is repaid before the next admission).

§8: when Redis is unreachable, requests and tokens fail OPEN (shadow buckets only feed the
headers) and KV·seconds fails CLOSED to ``local_kv_fraction`` of each tenant's cap, counted
in this process; both are logged on the transition and counted in metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.policy import (
    AdmissionConfig,
    Layer,
    LocalBucket,
    RateLimitState,
    WindowCounts,
    bucket_reset_ms,
    in_retry_storm,
)
from gateway.scriptchannel import Arg, LuaScript, ScriptChannel

log = logging.getLogger("fairway.gateway.limits")

PREFIX = "fw:rl:"
RECLAIM_PER_ADMIT = 64  # bounds the work one admission can do on behalf of a dead gateway
RENEW_CHUNK = 500  # leases per EVALSHA inside the one renewal pipeline

_REASONS: dict[int, Layer | None] = {0: None, 1: "requests", 2: "tokens", 3: "kv_seconds"}
RETRY_BUDGET = 4

ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid = ARGV[1]
local rpm, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
local est_tok, est_kv, kv_cap = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local lease_ms, expected_ms = tonumber(ARGV[7]), tonumber(ARGV[8])
local is_retry, retry_check = tonumber(ARGV[9]), tonumber(ARGV[10])
local rb_ratio, rb_min, rb_window = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local reclaim_limit = tonumber(ARGV[14])

-- 1. reclaim leases nobody renewed (R4)
local reclaimed = 0
local dead = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, reclaim_limit)
if #dead > 0 then
  local freed = 0
  for _, id in ipairs(dead) do
    local v = redis.call('HGET', KEYS[2], id)
    if v then
      freed = freed + tonumber(string.match(v, '^(%d+)'))
      redis.call('HDEL', KEYS[2], id)
      reclaimed = reclaimed + 1
    end
    redis.call('ZREM', KEYS[3], id)
  end
  if freed > 0 then redis.call('HINCRBY', KEYS[2], '#', -freed) end
end
local inflight = tonumber(redis.call('HGET', KEYS[2], '#') or '0')

-- 2. buckets, refilled continuously at capacity per minute; absent = full
local b = redis.call('HMGET', KEYS[1], 'rl', 'rt', 'tl', 'tt')
local function level(v, ts, cap)
  if not v then return cap end
  return math.min(cap, tonumber(v) + math.max(0, now - tonumber(ts)) * cap / 60000)
end
local rl, tl = 0, 0
if rpm > 0 then rl = level(b[1], b[2], rpm) end
if tpm > 0 then tl = level(b[3], b[4], tpm) end
local function reset(l, cap)
  if cap <= 0 then return 0 end
  return math.max(0, math.ceil((cap - l) * 60000 / cap))
end

-- 3. retry budget window (R6): slot i holds "index:admitted:retries"
local width = rb_window / 6
local idx = math.floor(now / width)
local slots = redis.call('HMGET', KEYS[4], '0', '1', '2', '3', '4', '5')
local adm, ret = 0, 0
for _, s in ipairs(slots) do
  if s then
    local si, sa, sr = string.match(s, '^(%d+):(%d+):(%d+)$')
    if si and tonumber(si) > idx - 6 then adm = adm + tonumber(sa); ret = ret + tonumber(sr) end
  end
end

local function deny(reason, wait)
  return {0, reason, math.ceil(wait), math.floor(rl), reset(rl, rpm), math.floor(tl),
          reset(tl, tpm), inflight, reclaimed, adm, ret, now}
end

if rpm > 0 and rl < 1 then return deny(1, (1 - rl) * 60000 / rpm) end
if tpm > 0 and tl <= 0 then return deny(2, (-tl) * 60000 / tpm + 1) end
if kv_cap > 0 and inflight > 0 and inflight + est_kv > kv_cap then
  -- when will enough of the in-flight leases end (their expected ends) for this to fit?
  local need = inflight + est_kv - kv_cap
  local ends = {}
  local all = redis.call('HGETALL', KEYS[2])
  for i = 1, #all, 2 do
    if all[i] ~= '#' then
      local e, en = string.match(all[i + 1], '^(%d+):(%d+)$')
      table.insert(ends, {tonumber(en), tonumber(e)})
    end
  end
  table.sort(ends, function(x, y) return x[1] < y[1] end)
  local wait, got = lease_ms, 0
  for _, p in ipairs(ends) do
    got = got + p[2]
    if got >= need then wait = math.max(0, p[1] - now); break end
  end
  return deny(3, wait)
end
if is_retry == 1 and retry_check == 1 and adm >= rb_min and ret > rb_ratio * adm then
  return deny(4, 0)
end

-- 4. charge: bucket, lease, budget
local ttl = 1000
if rpm > 0 then rl = rl - 1; ttl = math.max(ttl, reset(rl, rpm) + 1000) end
if tpm > 0 then tl = tl - est_tok; ttl = math.max(ttl, reset(tl, tpm) + 1000) end
if rpm > 0 or tpm > 0 then
  redis.call('HSET', KEYS[1], 'rl', string.format('%.17g', rl), 'rt', now,
             'tl', string.format('%.17g', tl), 'tt', now)
  redis.call('PEXPIRE', KEYS[1], ttl)
end
redis.call('HSET', KEYS[2], rid, est_kv .. ':' .. (now + expected_ms))
redis.call('HINCRBY', KEYS[2], '#', est_kv)
redis.call('ZADD', KEYS[3], now + lease_ms, rid)
redis.call('PEXPIRE', KEYS[2], lease_ms + 60000)
redis.call('PEXPIRE', KEYS[3], lease_ms + 60000)
local slot = tostring(idx % 6)
local cur = slots[(idx % 6) + 1]
local ca, cr = 0, 0
if cur then
  local si, sa, sr = string.match(cur, '^(%d+):(%d+):(%d+)$')
  if si and tonumber(si) == idx then ca = tonumber(sa); cr = tonumber(sr) end
end
redis.call('HSET', KEYS[4], slot, idx .. ':' .. (ca + 1) .. ':' .. (cr + is_retry))
redis.call('PEXPIRE', KEYS[4], rb_window * 2)
return {1, 0, 0, math.floor(rl), reset(rl, rpm), math.floor(tl), reset(tl, tpm), inflight,
        reclaimed, adm + 1, ret + is_retry, now}
"""

SETTLE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid = ARGV[1]
local est_tok, actual, refund_req = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local rpm, tpm = tonumber(ARGV[5]), tonumber(ARGV[6])
local released = 0
local v = redis.call('HGET', KEYS[2], rid)
if v then
  redis.call('HDEL', KEYS[2], rid)
  redis.call('HINCRBY', KEYS[2], '#', -tonumber(string.match(v, '^(%d+)')))
  released = 1
end
redis.call('ZREM', KEYS[3], rid)
if rpm > 0 or tpm > 0 then
  local b = redis.call('HMGET', KEYS[1], 'rl', 'rt', 'tl', 'tt')
  local function level(x, ts, cap)
    if not x then return cap end
    return math.min(cap, tonumber(x) + math.max(0, now - tonumber(ts)) * cap / 60000)
  end
  local rl, tl = 0, 0
  local ttl = 1000
  if rpm > 0 then
    rl = level(b[1], b[2], rpm)
    if refund_req == 1 then rl = math.min(rpm, rl + 1) end
    ttl = math.max(ttl, math.ceil((rpm - rl) * 60000 / rpm) + 1000)
  end
  if tpm > 0 then
    -- refund the unused estimate at once; charge the actual (which may exceed it)
    tl = math.min(tpm, level(b[3], b[4], tpm) + est_tok - actual)
    ttl = math.max(ttl, math.ceil((tpm - tl) * 60000 / tpm) + 1000)
  end
  redis.call('HSET', KEYS[1], 'rl', string.format('%.17g', rl), 'rt', now,
             'tl', string.format('%.17g', tl), 'tt', now)
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return released
"""

RENEW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease_ms = tonumber(ARGV[1])
local renewed, lost = 0, 0
for i = 1, #KEYS, 2 do
  local id = ARGV[(i + 1) / 2 + 1]
  -- XX: never resurrect a lease that was settled or reclaimed meanwhile
  if redis.call('ZSCORE', KEYS[i], id) then
    redis.call('ZADD', KEYS[i], 'XX', now + lease_ms, id)
    redis.call('PEXPIRE', KEYS[i], lease_ms + 60000)
    redis.call('PEXPIRE', KEYS[i + 1], lease_ms + 60000)
    renewed = renewed + 1
  else
    lost = lost + 1
  end
end
return {renewed, lost}
"""


def connect(
    url: str,
    *,
    timeout_s: float = 0.5,
    max_connections: int = 512,
    health_check_interval: int = 0,
) -> aioredis.Redis:
    """A client that fails fast: explicit timeouts, and one immediate retry only for a
    broken connection (a stale pooled one), never a backoff, and never a retry after a
    timeout (a hung store would cost every request twice the timeout before §8's fallback
    answers). The pool blocks (up to ``timeout_s``) for a free connection: a burst of
    concurrent calls must queue, not read as "the store is down"."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=health_check_interval,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    return aioredis.Redis(connection_pool=pool)


def tenant_tag(tenant_id: str, family: str) -> str:
    return f"{PREFIX}{{{tenant_id}:{family}}}"


def retry_key(version: str) -> str:
    return f"{PREFIX}rb:{{{version}}}"


class LimiterStats(Protocol):
    """What the limiter reports; the admission controller backs it with Prometheus."""

    def redis_up(self, up: bool) -> None: ...
    def fail_open(self, layer: str) -> None: ...
    def fail_closed(self, admitted: bool) -> None: ...
    def leases_reclaimed(self, n: int) -> None: ...
    def leases_lost(self, n: int) -> None: ...


class NullStats:
    def redis_up(self, up: bool) -> None:
        pass

    def fail_open(self, layer: str) -> None:
        pass

    def fail_closed(self, admitted: bool) -> None:
        pass

    def leases_reclaimed(self, n: int) -> None:
        pass

    def leases_lost(self, n: int) -> None:
        pass


@dataclass(frozen=True, slots=True)
class QuotaRequest:
    request_id: str
    tenant_id: str
    family: str
    version: str
    rpm: int  # 0 = unlimited (likewise tpm and kv_cap_milli)
    tpm: int
    est_tokens: int
    est_kv_milli: int
    kv_cap_milli: int
    expected_ms: int
    is_retry: bool
    retry_exempt: bool  # reserved tenants are never shed by the retry budget


@dataclass(slots=True)
class Grant:
    """An admitted request's hold on quota, released exactly once by ``settle``."""

    lease_id: str
    tenant_id: str
    family: str
    rpm: int
    tpm: int
    est_tokens: int
    est_kv_milli: int
    local: bool  # admitted while Redis was unreachable: nothing to release there
    settled: bool = False

    @classmethod
    def of(cls, q: QuotaRequest, lease_id: str, *, local: bool) -> Grant:
        return cls(
            lease_id, q.tenant_id, q.family, q.rpm, q.tpm, q.est_tokens, q.est_kv_milli, local
        )


@dataclass(frozen=True, slots=True)
class QuotaDecision:
    admitted: bool
    layer: Layer | None  # which quota layer refused (429)
    retry_storm: bool  # a retry shed by the budget (503, not 429)
    frees_in_ms: int  # when the refusing limit frees
    state: RateLimitState
    inflight_kv_milli: int  # the tenant's in-flight KV before this request
    grant: Grant | None
    degraded: bool  # decided without Redis (§8)
    store_ms: int = 0  # the store's clock at the decision (0 when decided locally)


@dataclass(slots=True)
class _LocalTenant:
    """In-process view of one tenant-model: fail-closed KV ledger and header shadows."""

    rpm: LocalBucket
    tpm: LocalBucket
    leases: dict[str, int] = field(default_factory=dict)

    @property
    def inflight(self) -> int:
        return sum(self.leases.values())


class Limiter:
    """Admits, settles and renews quota holds; degrades per §8 when Redis is unreachable."""

    def __init__(
        self,
        client: aioredis.Redis,
        cfg: AdmissionConfig,
        *,
        stats: LimiterStats | None = None,
        probe_interval_s: float = 1.0,
    ) -> None:
        self._redis = client
        self._cfg = cfg
        self._stats: LimiterStats = stats or NullStats()
        # The hot path (admit, settle) and the renewal go through one multiplexed
        # connection (gateway.scriptchannel); redis-py's script objects remain for TLS.
        self._channel = ScriptChannel.for_client(client)
        self._admit_lua = LuaScript.of(ADMIT_LUA)
        self._settle_lua = LuaScript.of(SETTLE_LUA)
        self._renew_lua = LuaScript.of(RENEW_LUA)
        self._admit = client.register_script(ADMIT_LUA)
        self._settle = client.register_script(SETTLE_LUA)
        self._renew = client.register_script(RENEW_LUA)
        # Lease ids: the request id (clients' ids may repeat, ours are unique per process)
        # plus this limiter's random tag and a counter — no uuid4 (an os.urandom syscall)
        # per request.
        self._lease_tag = os.urandom(4).hex()
        self._lease_seq = itertools.count()
        self._probe_interval_s = probe_interval_s
        self._down_until = 0.0  # monotonic; while in the future, skip Redis entirely
        self._up = True
        self._local: dict[tuple[str, str], _LocalTenant] = {}
        self._local_retries: dict[str, WindowCounts] = {}

    @property
    def redis_up(self) -> bool:
        return self._up

    async def aclose(self) -> None:
        """Close the script channel (the redis-py client belongs to the caller)."""
        if self._channel is not None:
            await self._channel.aclose()

    async def _eval(
        self, lua: LuaScript, script: Any, keys: Sequence[Arg], args: Sequence[Arg]
    ) -> Any:
        if self._channel is not None:
            return await self._channel.evalsha(lua, keys, args)
        return await script(keys=list(keys), args=list(args))

    # -- health ------------------------------------------------------------------------
    def _redis_usable(self) -> bool:
        return self._up or time.monotonic() >= self._down_until

    def _mark(self, up: bool, exc: BaseException | None = None) -> None:
        if not up:
            self._down_until = time.monotonic() + self._probe_interval_s
        if up == self._up:
            return
        self._up = up
        self._stats.redis_up(up)
        if up:
            log.warning(
                "limits store reachable again: requests/tokens enforced, KV·seconds "
                "back on the shared ledger"
            )
        else:
            log.error(
                "limits store unreachable (%s): requests/min and tokens/min FAIL OPEN, "
                "KV·seconds FAILS CLOSED to %.0f%% of each tenant's cap in-process",
                exc,
                self._cfg.local_kv_fraction * 100,
            )

    def _local_for(self, q_tenant: str, family: str, rpm: int, tpm: int) -> _LocalTenant:
        key = (q_tenant, family)
        entry = self._local.get(key)
        if entry is None or entry.rpm.capacity != rpm or entry.tpm.capacity != tpm:
            leases = entry.leases if entry else {}
            entry = _LocalTenant(LocalBucket(rpm), LocalBucket(tpm), leases)
            self._local[key] = entry
        return entry

    # -- admit -------------------------------------------------------------------------
    async def admit(self, q: QuotaRequest) -> QuotaDecision:
        lease_id = f"{q.request_id}:{self._lease_tag}{next(self._lease_seq):x}"
        local = self._local_for(q.tenant_id, q.family, q.rpm, q.tpm)
        if self._redis_usable():
            try:
                decision = await self._admit_redis(q, lease_id)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                self._mark(False, exc)
            else:
                self._mark(True)
                if decision.grant is not None:
                    local.leases[lease_id] = q.est_kv_milli
                return decision
        return self._admit_local(q, lease_id, local)

    async def _admit_redis(self, q: QuotaRequest, lease_id: str) -> QuotaDecision:
        tag = tenant_tag(q.tenant_id, q.family)
        cfg = self._cfg
        res: list[Any] = await self._eval(
            self._admit_lua,
            self._admit,
            (f"{tag}:b", f"{tag}:l", f"{tag}:e", retry_key(q.version)),
            (
                lease_id,
                q.rpm,
                q.tpm,
                q.est_tokens,
                q.est_kv_milli,
                q.kv_cap_milli,
                int(cfg.lease_ttl_s * 1000),
                q.expected_ms,
                int(q.is_retry),
                int(not q.retry_exempt),
                repr(cfg.retry_budget_ratio),
                cfg.retry_budget_min_admitted,
                int(cfg.retry_budget_window_s * 1000),
                RECLAIM_PER_ADMIT,
            ),
        )
        (ok, reason, wait, rrem, rreset, trem, treset, inflight, reclaimed, _adm, _ret, now_ms) = (
            int(x) for x in res
        )
        if reclaimed:
            self._stats.leases_reclaimed(reclaimed)
            log.info(
                "reclaimed %d unrenewed leases of tenant %s model %s",
                reclaimed,
                q.tenant_id,
                q.family,
            )
        state = RateLimitState(q.rpm, max(0, rrem), rreset, q.tpm, max(0, trem), treset)
        grant = None
        if ok:
            grant = Grant.of(q, lease_id, local=False)
        return QuotaDecision(
            admitted=bool(ok),
            layer=_REASONS.get(reason),
            retry_storm=reason == RETRY_BUDGET,
            frees_in_ms=wait,
            state=state,
            inflight_kv_milli=inflight,
            grant=grant,
            degraded=False,
            store_ms=now_ms,
        )

    def _admit_local(self, q: QuotaRequest, lease_id: str, local: _LocalTenant) -> QuotaDecision:
        now_ms = int(time.time() * 1000)
        # Requests and tokens fail open: charged to the shadow buckets only for the headers.
        rl = local.rpm.take(1, now_ms) if q.rpm else 0.0
        tl = local.tpm.take(q.est_tokens, now_ms) if q.tpm else 0.0
        if q.rpm and rl < 0:
            self._stats.fail_open("requests")
        if q.tpm and tl < 0:
            self._stats.fail_open("tokens")
        window = self._local_retries.setdefault(
            q.version, WindowCounts(self._cfg.retry_budget_window_s)
        )
        now_s = now_ms / 1000
        storm = in_retry_storm(*window.counts(now_s), self._cfg)
        inflight = local.inflight
        # KV·seconds fails closed: a conservative share of the cap, counted in-process.
        cap = q.kv_cap_milli * self._cfg.local_kv_fraction if q.kv_cap_milli else 0
        kv_ok = not cap or inflight == 0 or inflight + q.est_kv_milli <= cap
        shed = q.is_retry and not q.retry_exempt and storm
        admitted = kv_ok and not shed
        self._stats.fail_closed(admitted)
        grant = None
        if admitted:
            window.record(now_s, flagged=q.is_retry)
            local.leases[lease_id] = q.est_kv_milli
            grant = Grant.of(q, lease_id, local=True)
        else:  # nothing was consumed
            if q.rpm:
                local.rpm.give(1, now_ms)
            if q.tpm:
                local.tpm.give(q.est_tokens, now_ms)
        state = RateLimitState(
            q.rpm,
            int(max(rl, 0)),
            bucket_reset_ms(rl, q.rpm) if q.rpm else 0,
            q.tpm,
            int(max(tl, 0)),
            bucket_reset_ms(tl, q.tpm) if q.tpm else 0,
        )
        frees = int(self._cfg.lease_ttl_s * 1000) if not kv_ok else 0
        return QuotaDecision(
            admitted=admitted,
            layer=None if kv_ok else "kv_seconds",
            retry_storm=kv_ok and shed,
            frees_in_ms=frees,
            state=state,
            inflight_kv_milli=inflight,
            grant=grant,
            degraded=True,
        )

    # -- settle ------------------------------------------------------------------------
    async def settle(self, grant: Grant, *, actual_tokens: int, refund_request: bool) -> bool:
        """Release the lease and reconcile tokens, once. Never raises; True if Redis
        released a live lease (False: local grant, already settled, reclaimed, or down)."""
        if grant.settled:
            return False
        grant.settled = True
        entry = self._local.get((grant.tenant_id, grant.family))
        if entry is not None:
            entry.leases.pop(grant.lease_id, None)
            if grant.local:
                now_ms = int(time.time() * 1000)
                if grant.tpm:
                    entry.tpm.give(grant.est_tokens - actual_tokens, now_ms)
                if refund_request and grant.rpm:
                    entry.rpm.give(1, now_ms)
        if grant.local or not self._redis_usable():
            return False
        tag = tenant_tag(grant.tenant_id, grant.family)
        try:
            released = await self._eval(
                self._settle_lua,
                self._settle,
                (f"{tag}:b", f"{tag}:l", f"{tag}:e"),
                (
                    grant.lease_id,
                    grant.est_tokens,
                    actual_tokens,
                    int(refund_request),
                    grant.rpm,
                    grant.tpm,
                ),
            )
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            # The lease expires on its own within lease_ttl_s; tokens stay charged at the
            # estimate (pessimistic, and billing counts the actual anyway).
            self._mark(False, exc)
            return False
        except RedisError:
            log.exception("settle failed for lease %s", grant.lease_id)
            return False
        self._mark(True)
        return bool(released)

    # -- renew -------------------------------------------------------------------------
    async def renew(self, grants: Sequence[Grant]) -> tuple[int, int]:
        """Extend every live Redis lease of this process in ONE pipelined round trip.

        Returns (renewed, lost); a lost lease was reclaimed while we could not renew it
        (R4's partition caveat: over-admits by this gateway's share, bounded)."""
        live = [g for g in grants if not g.local and not g.settled]
        if not live or not self._redis_usable():
            return 0, 0
        lease_ms = int(self._cfg.lease_ttl_s * 1000)
        calls: list[tuple[list[str], list[Arg]]] = []
        for i in range(0, len(live), RENEW_CHUNK):
            chunk = live[i : i + RENEW_CHUNK]
            keys: list[str] = []
            for g in chunk:
                tag = tenant_tag(g.tenant_id, g.family)
                keys += [f"{tag}:e", f"{tag}:l"]
            calls.append((keys, [lease_ms, *(g.lease_id for g in chunk)]))
        try:
            if self._channel is not None:
                results = await self._channel.evalsha_many(self._renew_lua, calls)
            else:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for keys, args in calls:
                        await self._renew(keys=keys, args=args, client=pipe)
                    results = await pipe.execute()
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            self._mark(False, exc)
            return 0, 0
        self._mark(True)
        renewed = sum(int(r[0]) for r in results)
        lost = sum(int(r[1]) for r in results)
        if lost:
            self._stats.leases_lost(lost)
            log.warning("%d in-flight leases were reclaimed before renewal", lost)
        return renewed, lost


async def renew_forever(limiter: Limiter, grants: Any, interval_s: float) -> None:
    """The lease renewer task: every ``interval_s``, one pipelined call for all of this
    process's in-flight grants (``grants`` is a callable returning them)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await limiter.renew(list(grants()))
        except Exception:  # noqa: BLE001 - the renewer must outlive any one failure
            log.exception("lease renewal failed")
