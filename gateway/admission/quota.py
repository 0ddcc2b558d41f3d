"""Quota state in Redis: one atomic script to admit, one to settle, one to renew leases.

Key layout (all under ``fw:rl:``; the ``{...}`` hash tag keeps one tenant-model's keys in
one slot):

- ``fw:rl:{<tenant>:<family>}:b``  HASH  requests and tokens buckets: ``rl``/``rt`` (level,
  last ms) and ``tl``/``tt``. TTL = time until both are full again (an absent bucket is full).
- ``fw:rl:{<tenant>:<family>}:l``  HASH  in-flight leases: ``<lease_id>`` -> ``"<est_kv>:<end>"``
  (milli-GiB·s, expected end in ms; ``:<key_id>`` appended for a key's lease, see "Per-key
  limits") and ``#`` -> their sum. TTL lease + 60 s, refreshed.
- ``fw:rl:{<tenant>:<family>}:e``  ZSET  ``<lease_id>`` scored by lease deadline (ms).
- ``fw:rl:rb:{<version>}``         HASH  retry budget: six slots ``0``..``5`` of
  ``"<slot index>:<admitted>:<retries>"`` over a sliding minute. TTL two windows.
- ``fw:rl:lc:{<version>}:l|e|w``   the fleet's long-context ledger (leases and sums, lease
  deadlines, waiting tenants): in the retry budget's slot. With ``long_prefill_placement``
  also ``:r`` (HASH lease -> the replica it was dispatched to: ``Limiter.placed``, read with
  ``Limiter.placements``; entries of leases gone are dropped by the read, the hash expires
  with ``:l``). On a single Redis the admit,
  settle and renew scripts take its keys beside the tenant's (one round trip). On a
  cluster they would cross slots, so there ``LONG_CONTEXT_LUA`` runs the same ledger
  functions alone on the ledger's slot: a long-context request is admitted by its tenant's
  script first, then claims the ledger; a refused claim settles the tenant's lease with a
  full refund (so a tenant's own transient hold is the only one another request can see).
  Its settle releases the two leases in parallel and renewal extends both, each in its own
  slot. A short request reads the ledger's total for placement at most every
  ``LONG_READ_INTERVAL_S`` per version, beside its admit call (in parallel, not waited for
  longer than the admit). On either layout a long-context request's first token releases
  its prefill slot with ``LONG_CONTEXT_LUA``'s ``prefilled`` action (``prefill_done``: one
  call on the ledger's slot; the KV stays held until settle).

Redis Cluster: the key layout rule (every key the gateway or the control plane writes
follows it; add keys by it):

1. The keys of one Lua script call share one hash slot. A script touches one tenant-model,
   so its keys carry the hash tag ``{<tenant>:<family>}``; a key that is not about one
   tenant-model (the retry budget, per version: ``{<version>}``) is never passed to the
   same call as a tenant-model's keys. Renewal batches several tenants' leases: on a
   cluster it sends one call per slot (all in one round trip per node, nodes in parallel).
2. A key touched alone (``fw:cfg:*`` records and version, ``fw:idem:*``,
   ``fw:key_last_used``, ``fw:lock:cfg``) needs no tag: it lives wherever it hashes.
3. Several such keys written together (the control plane's read-model push) are written
   without ``MULTI`` on a cluster (a transaction cannot span slots): each record is one
   ``SET``, the version is bumped after them and the change announced last, which is the
   order gateways rely on (the announcement drops their caches).
4. Pub/sub is the classic ``PUBLISH``, which a cluster delivers to subscribers on every
   node: a gateway may subscribe through any node.

The admission on a cluster is still one atomic script per request: the retry budget lives
in another slot, so there ``ADMIT_LUA`` gets its counts as arguments instead of reading
them, and ``RETRY_BUDGET_LUA`` records the admission on the budget's node without a wait
(written before the next call to that node); a retry reads the counts first (one more
round trip, retries only). Concurrent retries may therefore overshoot the budget by the
retries in flight at once on a cluster; on a single Redis it stays exact. The single-node
layout and behaviour are unchanged: one ``EVALSHA`` with all four keys.

Per-key limits: an API key may carry its own requests/min, tokens/min (per family) and a
cap on its requests in flight, always inside its tenant's (both apply; the tighter binds).
They are enforced in the same admit call as the tenant's, after the tenant's checks:

- ``fw:rl:{<tenant>:<family>}:k:<key_id>``  HASH  the key's own buckets, laid out and
  expiring like ``:b``. Under the tenant-model's hash tag, so one call (one slot) holds both.
- ``#k:<key_id>`` in the tenant-model's ``:l``  the key's requests in flight. Each lease of a
  key names it (``"<est_kv>:<end>:<key_id>"``), so every way a lease ends gives the slot
  back: settle (success, failure, refusal after admission, client gone) and the reclaim of
  an unrenewed lease (a crashed gateway). Renewal needs no change.

The key's part of a call is its tail (last key, last ARGV, last values returned), so the
tenant's layout keeps its positions; a call without it counts nothing per key. Refusals
carry their own reasons (11 requests, 12 tokens, 13 concurrency) and become 429
``key_rate_limit_exceeded``. Without Redis the key's rates fail open like the tenant's and
its concurrency cap fails closed to ``local_kv_fraction`` of it (at least one request).

Every script reads the clock with Redis ``TIME``, so all gateways share one clock. The
admit script also reclaims leases unrenewed past their deadline (a crashed gateway's
capacity comes back on that tenant's next admission, within the 15 s lease: no sweeper
process to run or to fail; a tenant that sends nothing more has nothing to compete for).

Overshoot under any concurrency (scripts are atomic): requests/min 0 (admit iff a whole
request is left); KV·seconds 0 except one request admitted alone whose estimate exceeds
the cap (it could otherwise never run); tokens/min at most one request's estimate (admit
while the bucket is positive, then charge the estimate: a large request is not starved by
a stream of small ones, and the debt is repaid before the next admission).

On a cluster, reachability is tracked per master: a lost master sends only the tenants whose
slots it holds to the local fallback below.

docs/design.md §8: when Redis is unreachable, requests and tokens fail OPEN (shadow buckets only
feed the headers) and KV·seconds fails CLOSED to ``local_kv_fraction`` of each tenant's cap, counted
in this process; both are logged on the transition and counted in metrics.

A Redis that answers but refuses the writes a script needs is the same outage for admission:
out of memory (``OOM command not allowed``: maxmemory reached under ``noeviction``), still
loading its dataset, a script stuck (``BUSY``), writes stopped after a failed save
(``MISCONF``), a replica after a failover (``READONLY``). ``_eval`` turns those error replies
into :class:`StoreRefused` (a ``ConnectionError``), so every path that degrades on an
unreachable store degrades on them too, instead of the error reaching the request (a 503
for every tenant). Each is counted in ``fairway_admission_store_errors_total{kind}``; the
transition log lines are rate-limited (a store refusing only writes answers refusals, which
need none, so it can flap between "up" and "down" every probe).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.admission.config import AdmissionConfig, Layer
from gateway.admission.long_context import LongContextClause
from gateway.admission.ratelimit import LocalBucket, RateLimitState, bucket_reset_ms
from gateway.admission.retry import CAPPED_SPREAD_MS, WindowCounts, retry_shed
from gateway.admission.scriptchannel import Arg, ClusterScriptChannel, LuaScript, ScriptChannel
from gateway.errors import RETRY_AFTER_CAP_MS

log = logging.getLogger("fairway.gateway.limits")

PREFIX = "fw:rl:"
RECLAIM_PER_ADMIT = 64  # bounds the work one admission can do on behalf of a dead gateway
RENEW_CHUNK = 500  # leases per EVALSHA inside the one renewal pipeline

# Error replies of a Redis that is up but cannot serve admission's writes (module doc), by
# their first word; the metric's ``kind`` label is the word in lower case.
STORE_REFUSALS = ("OOM", "LOADING", "BUSY", "MISCONF", "READONLY", "MASTERDOWN", "NOREPLICAS")
# The reply itself (``OOM command not allowed ...``), or, from a Redis before 7, the script
# error that wraps a refused call (``ERR Error running script ...: -OOM command ...``).
_REFUSAL = re.compile(r"(?:^|: -)(" + "|".join(STORE_REFUSALS) + r")\b")
LOG_EVERY_S = 10.0  # at most one store up/down log line per node this often

_REASONS: dict[int, Layer | None] = {0: None, 1: "requests", 2: "tokens", 3: "kv_seconds"}
# Per-key limits: ADMIT_LUA's reasons for a refusal by the API key's own limits.
# Numbered apart from the tenant-level reasons (1..9 are theirs) so both can grow.
_KEY_REASONS: dict[int, Layer] = {11: "requests", 12: "tokens", 13: "concurrency"}
RETRY_BUDGET = 4
LONG_CONTEXT = 5
TENANT_RETRY_BUDGET = 6
# On a cluster a short request's read of the long-context ledger (for placement) is a call on
# another node: at most this often per version and process (the router keeps the figure for a
# lease's lifetime anyway).
LONG_READ_INTERVAL_S = 0.25

# The fleet's long-context ledger, as Lua functions over its three keys (``long_context_tag``:
# ``l`` the leases "<kv bytes>:<prefill end ms>:<expected end ms>:<tenant>" with their sum '#'
# (the prefill end is a safety expiry: ``lc_prefilled`` moves it to the first token's arrival,
# docs/design.md §7 "Long contexts"),
# each tenant's 'u:<tenant>' and its last admission 's:<tenant>' (ms), each lease's admission
# record 'p:<lease>' "<the tenant's admission before it>:<admitted ms>:<first token due ms>"
# (its expected first token: long_context.py's ``LeaseTimes``; ":s" appended when it is not
# very long, the lane's tier: none, as leases recorded before the tiers, is very long), each
# refused tenant's due-back 'd:<tenant>' "<refusal ms + the wait it was told>:<its ask's
# prefill ms>" (":s" likewise for the tier it asked for; the backfill in
# long_context.py's ``yields_to_waiting``; deleted when it is admitted, and when it is no longer
# waiting at the next ask), ``e`` the lease
# deadlines, ``w`` the tenants waiting: refused within the demand window, scored so that an
# entry counts until its score plus the window (``waiting_score``)). Prepended to the scripts
# that touch it: on a single Redis the admit and settle scripts take the ledger's keys beside
# the tenant's; on a cluster ``LONG_CONTEXT_LUA`` runs them alone on the ledger's slot.
LEDGER_LUA = (
    f"""
local RETRY_AFTER_CAP_MS, CAPPED_SPREAD_MS = {RETRY_AFTER_CAP_MS}, {CAPPED_SPREAD_MS}
"""
    # a refusal's clause (long_context.py's LongContextClause: LC_KV_FULL, LC_SLOTS_FULL, ...)
    + "".join(f"local LC_{c.name} = {c.value}\n" for c in LongContextClause)
    + """
local function lc_drop(l, e, id)
  local n = 0
  local v = redis.call('HGET', l, id)
  if v then
    local kv, _, _, who = string.match(v, '^(%d+):(%d+):(%d+):(.*)$')
    redis.call('HINCRBY', l, '#', -tonumber(kv))
    if redis.call('HINCRBY', l, 'u:' .. who, -tonumber(kv)) <= 0 then
      redis.call('HDEL', l, 'u:' .. who)
    end
    redis.call('HDEL', l, id)
    n = 1
  end
  redis.call('HDEL', l, 'p:' .. id)
  redis.call('ZREM', e, id)
  return n
end
-- A lease that never ran (refused for capacity after the budget admitted it, or failed
-- before producing anything): its tenant was not served. Its last admission goes back to
-- what it was before this one (unless a later admission replaced it) and it counts as
-- waiting, so the least-recently-served order sees what the tenant actually got.
local function lc_unserve(l, w, id, now)
  local v = redis.call('HGET', l, id)
  local p = redis.call('HGET', l, 'p:' .. id)
  if not v or not p then return end
  local who = string.match(v, '^%d+:%d+:%d+:(.*)$')
  local prev, at = string.match(p, '^(-?%d+):(%d+)')
  if redis.call('HGET', l, 's:' .. who) == at then
    if tonumber(prev) < 0 then
      redis.call('HDEL', l, 's:' .. who)
    else
      redis.call('HSET', l, 's:' .. who, prev)
    end
  end
  redis.call('ZADD', w, now, who)
end
-- The request's first token arrived: its prefill is over, so it stops holding a prefill
-- slot now (its KV stays until settle). A lease already past its prefill end, or gone
-- (settled, reclaimed), is left as it is. Returns 1 when it released a slot.
local function lc_prefilled(l, id, now)
  local v = redis.call('HGET', l, id)
  if not v then return 0 end
  local kv, pe, rest = string.match(v, '^(%d+):(%d+):(.*)$')
  if not pe or tonumber(pe) <= now then return 0 end
  redis.call('HSET', l, id, kv .. ':' .. now .. ':' .. rest)
  return 1
end
local function lc_reclaim(l, e, now, limit)
  local n = 0
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', e, '-inf', now, 'LIMIT', 0, limit)) do
    n = n + lc_drop(l, e, id)
  end
  return n
end
-- How long a refused ask waits (ms) before asking again, from the ledger's fields ``all``
-- (long_context.py's long_context_wait_ms): until a prefill slot frees (slots_bound) — the
-- first running prefill's expected first token, or once past it a quarter of the time it
-- has run so far again (OVERRUN_DIVISOR), never after its safety expiry; long_only: of the
-- very long prefills only — and/or until KV frees (kv_bound), when enough leases are
-- expected to have ended for the kv_short bytes the ask lacks (<= 0: the first lease's
-- end; kv_frees_at), a lease past its expected end a quarter of its life so far again,
-- never past its lease expiry (``e``, the expiry set; lease_ends_at); both: the later;
-- >= 1 s.
local function lc_wait(all, now, slots_bound, kv_bound, long_only, kv_short, e)
  local leases, times, lane = {}, {}, {}
  for i = 1, #all, 2 do
    local f, v = all[i], all[i + 1]
    local kind = string.sub(f, 1, 2)
    if kind == 'p:' then
      local at, due, tier = string.match(v, '^%-?%d+:(%d+):(%d+)(.*)$')
      if due then times[string.sub(f, 3)] = {tonumber(at), tonumber(due)} end
      if tier == ':s' then lane[string.sub(f, 3)] = true end
    elseif f ~= '#' and kind ~= 'u:' and kind ~= 's:' and kind ~= 'd:' then
      local kv, pe, en = string.match(v, '^(%d+):(%d+):(%d+):')
      leases[f] = {tonumber(pe), tonumber(en), tonumber(kv)}
    end
  end
  local expires, kv_read = {}, kv_bound or not slots_bound
  if kv_read and e then
    local ex = redis.call('ZRANGE', e, 0, -1, 'WITHSCORES')
    for i = 1, #ex, 2 do expires[ex[i]] = tonumber(ex[i + 1]) end
  end
  local slot_at, kv_at, ends = nil, nil, {}
  for id, x in pairs(leases) do
    local pe, en = x[1], x[2]
    if kv_read then
      local at, t, ex = en, times[id], expires[id]
      if en <= now then
        if t then
          at = now + math.floor((now - t[1]) / 4)
          if ex then at = math.min(at, ex) end
        elseif ex then
          at = ex
        end
      end
      table.insert(ends, {at, x[3]})
    end
    if pe > now and not (long_only and lane[id]) then
      local at, t = pe, times[id]
      if t and t[2] > now then
        at = t[2]
      elseif t then
        at = now + math.floor((now - t[1]) / 4)
      end
      at = math.min(at, pe)
      if not slot_at or at < slot_at then slot_at = at end
    end
  end
  table.sort(ends, function(a, b) return a[1] < b[1] end)
  local got = 0
  kv_short = kv_short or 0
  for _, x in ipairs(ends) do
    got, kv_at = got + x[2], x[1]
    if got >= kv_short then break end
  end
  slot_at, kv_at = slot_at or (now + 1000), kv_at or (now + 1000)
  local at = kv_at
  if slots_bound and kv_bound then
    at = math.max(slot_at, kv_at)
  elseif slots_bound then
    at = slot_at
  end
  return math.max(1000, at - now)
end
-- The range a long-context 503's retry-after is drawn from when the budget says ``wait``:
-- earliest and latest (retry.py's long_context_retry_earliest_ms / _latest_ms: from the wait
-- plus up to half of it, or, past RETRY_AFTER_CAP_MS, ending at the cap, told_range).
local function lc_told(wait)
  local base, width = math.max(wait, 1000), math.max(1000, math.ceil(wait / 2))
  local high = math.min(base + width, RETRY_AFTER_CAP_MS)
  return math.ceil(math.min(base, high - math.min(width, CAPPED_SPREAD_MS))), high
end
local function lc_told_latest(wait)
  local _, high = lc_told(wait)
  return high
end
-- max-min fair level of ``budget`` for ``tenant`` (long_context.py's fair_level): the
-- requester and every waiting tenant want more; the others want what they hold (``held``:
-- KV bytes, or long prefills running). Water-fill the budget over those demands.
local function lc_level(held, waiting, tenant, budget)
  local fixed, open = {}, 1
  for who, u in pairs(held) do
    if who ~= tenant then
      if waiting[who] then open = open + 1 else table.insert(fixed, u) end
    end
  end
  for who, _ in pairs(waiting) do
    if who ~= tenant and not held[who] then open = open + 1 end
  end
  table.sort(fixed)
  local left, level = budget, 0
  local n = #fixed
  local i = 1
  while true do
    level = left / (open + n - i + 1)
    if i > n or fixed[i] > level then break end
    left = left - fixed[i]
    i = i + 1
  end
  return level
end
-- KV in flight and concurrent long prefills, shared max-min fairly among the tenants that
-- asked within the demand window. nil: admit; otherwise the wait (ms) before asking again
-- (``lc_wait``), the ask's prefill ms and the clause that refused it (LC_*, long_context.py's
-- long_context_refusal). ``prefill_ms``: the ask's expected prefill (its first token's estimate).
local function lc_refusal(l, e, w, now, tenant, need, budget, slots, window, total,
                          prefill_ms, lane, very_long, beside_ms)
  local all = redis.call('HGETALL', l)
  local usage, served, prefilling = {}, {}, 0
  local prefills, due, running, lane_lease = {}, {}, {}, {}
  for i = 1, #all, 2 do
    local f, v = all[i], all[i + 1]
    local kind = string.sub(f, 1, 2)
    if kind == 'u:' then
      usage[string.sub(f, 3)] = tonumber(v)
    elseif kind == 's:' then
      served[string.sub(f, 3)] = tonumber(v)
    elseif kind == 'd:' then
      local at, pf, tier = string.match(v, '^(%-?%d+):(%d+)(.*)$')
      if at then due[string.sub(f, 3)] = {tonumber(at), tonumber(pf), tier == ':s'} end
    elseif kind == 'p:' then
      if string.sub(v, -2) == ':s' then lane_lease[string.sub(f, 3)] = true end
    elseif f ~= '#' then
      local _, pe = string.match(v, '^(%d+):(%d+):')
      if tonumber(pe) > now then
        prefilling = prefilling + 1
        local who = string.match(v, '^%d+:%d+:%d+:(.*)$')  -- its long prefills (slot share)
        prefills[who] = (prefills[who] or 0) + 1
        table.insert(running, {f, who})
      end
    end
  end
  -- the very long prefills among them (a lease without a tier recorded is very long)
  local long_prefilling, long_prefills = 0, {}
  for _, r in ipairs(running) do
    if not lane_lease[r[1]] then
      long_prefilling = long_prefilling + 1
      long_prefills[r[2]] = (long_prefills[r[2]] or 0) + 1
    end
  end
  redis.call('ZREMRANGEBYSCORE', w, '-inf', now - window)
  local waiting = {}
  for _, who in ipairs(redis.call('ZRANGE', w, 0, -1)) do waiting[who] = true end
  for who, _ in pairs(due) do  -- a due-back outlives its waiting entry by one ask at most
    if not waiting[who] then redis.call('HDEL', l, 'd:' .. who); due[who] = nil end
  end
  local mine = usage[tenant] or 0
  local refuse, share, clause = false, false, nil
  -- room left scarce goes to the waiting tenants served longest ago (long_context.py's
  -- yields_to_waiting): ahead = those refused within the window that hold no more than the
  -- tenant does and whose last admission is older than its own; the tenant yields when
  -- admitting it would leave fewer free prefill slots than them, or less KV than that many
  -- requests of its size. Backfill: the slot clause counts only those due back ('d:') no
  -- later than the ask's expected first token (absent: due now); its slot is free again by
  -- then. ``back``: when the last of them is due back and through its prefill (yield_wait_ms)
  -- Tiers: ``lane`` more slots in all for asks that are not very long; the slot clause
  -- yields when taking a slot lowers how many of those ahead the free slots could run
  -- (long_context.py's seatable: the very long ones only in the very long slots).
  -- a shorter ask beside a running very long prefill: its first token is expected later
  -- (LongContextAsk.prefill_beside_ms), for the backfill, its due-back and its lease
  if not very_long and long_prefilling > 0 then
    prefill_ms = math.max(prefill_ms, beside_ms or 0)
  end
  local last = served[tenant] or -1
  local ahead, early, early_short, back = 0, 0, 0, now
  local first_token = now + prefill_ms
  local long_waiting = {}  -- the waiters for a very long prompt (for its slot share)
  for who, _ in pairs(waiting) do
    local d = due[who]
    if not (d and d[3]) then long_waiting[who] = true end
    if who ~= tenant and (served[who] or -1) < last and (usage[who] or 0) <= mine then
      ahead = ahead + 1
      if not d or d[1] <= first_token then
        early = early + 1
        if d and d[3] then early_short = early_short + 1 end
      end
      if d then back = math.max(back, d[1] + d[2]) end
    end
  end
  local all_slots = slots + lane
  local vl = very_long and 1 or 0
  local function seatable(long_free, free)
    return math.max(0, math.min(free, early_short
                                      + math.min(early - early_short, math.max(0, long_free))))
  end
  local slots_left, long_left = all_slots - prefilling - 1, slots - long_prefilling - vl
  local slot_yield = seatable(long_left, slots_left) < seatable(long_left + vl, slots_left + 1)
  local yields = ahead > 0 and (slot_yield or budget - total - need < ahead * need)
  local long_full = very_long and long_prefilling >= slots
  if total + need > budget or prefilling >= all_slots or long_full then
    refuse = total > 0  -- an empty budget runs any one request, alone
    if total + need > budget then
      clause = LC_KV_FULL
    elseif prefilling >= all_slots then
      clause = LC_SLOTS_FULL
    else
      clause = LC_LONG_SLOTS_FULL
    end
  elseif yields then
    refuse, clause = true, slot_yield and LC_YIELD_SLOT or LC_YIELD_KV
  elseif (prefills[tenant] or 0) > 0
         and prefills[tenant] + 1 > lc_level(prefills, waiting, tenant, all_slots) then
    refuse, share = true, true  -- past its max-min share of the prefill slots
                                -- (slot_share_reached)
    clause = LC_SLOT_SHARE
  elseif very_long and (long_prefills[tenant] or 0) > 0
         and long_prefills[tenant] + 1 > lc_level(long_prefills, long_waiting, tenant, slots) then
    refuse, share = true, true  -- past its share of the very long slots
    clause = LC_LONG_SLOT_SHARE
  elseif mine > 0 then
    refuse, clause = mine + need > lc_level(usage, waiting, tenant, budget), LC_KV_SHARE
  end
  if not refuse then return nil, prefill_ms end
  -- a slot refusal (every slot busy, the one left goes to a tenant waiting ahead, or the
  -- tenant runs its share of them) waits for a prefill to end, not for some lease's
  -- decode; any other for KV to free
  local slots_bound = prefilling >= all_slots or long_full or share or (yields and slot_yield)
  local wait = lc_wait(all, now, slots_bound, not slots_bound or total + need > budget,
                       long_full, total + need - budget, e)
  -- a yield: when the room is expected for it (long_context.py's yield_wait_ms)
  if yields then wait = math.max(wait, back - now) end
  -- waiting (long_context.py's waiting_score): a tenant holding none of the budget until
  -- the latest retry it is told plus 2 s of grace (WAITING_GRACE_MS) when that is past the
  -- window; an entry is never shortened
  local score = now
  if mine <= 0 then score = math.max(now, now + lc_told_latest(wait) + 2000 - window) end
  redis.call('ZADD', w, 'GT', score, tenant)
  local ttl = score - now + window + 60000
  if redis.call('PTTL', w) < ttl then redis.call('PEXPIRE', w, ttl) end
  -- when it is due back at the earliest (the earliest retry it is told, lc_told), for the backfill;
  -- the ledger lives at least as long as the waiting entry
  redis.call('HSET', l, 'd:' .. tenant, (now + lc_told(wait)) .. ':' .. math.floor(prefill_ms)
                                        .. (very_long and '' or ':s'))
  if redis.call('PTTL', l) < ttl then redis.call('PEXPIRE', l, ttl) end
  return wait, prefill_ms, clause
end
local function lc_charge(l, e, w, now, rid, tenant, need, hold_ms, expected_ms, lease_ms,
                         prefill_ms, very_long)
  redis.call('HSET', l, rid,
             need .. ':' .. (now + hold_ms) .. ':' .. (now + expected_ms) .. ':' .. tenant)
  redis.call('HINCRBY', l, '#', need)
  redis.call('HINCRBY', l, 'u:' .. tenant, need)
  -- its last admission (yields_to_waiting), and the one before for lc_unserve
  local prev = redis.call('HGET', l, 's:' .. tenant) or '-1'
  redis.call('HSET', l, 's:' .. tenant, now)
  redis.call('HSET', l, 'p:' .. rid, prev .. ':' .. now .. ':' .. (now + prefill_ms)
                                     .. (very_long and '' or ':s'))  -- its tier
  redis.call('ZADD', e, now + lease_ms, rid)
  redis.call('ZREM', w, tenant)
  redis.call('HDEL', l, 'd:' .. tenant)
  if redis.call('PTTL', l) < lease_ms + 60000 then redis.call('PEXPIRE', l, lease_ms + 60000) end
  redis.call('PEXPIRE', e, lease_ms + 60000)
end
"""
)

# The long-context ledger alone, on its own slot (Redis Cluster; see the module doc).
# ARGV: 'claim', lease id, tenant, need (0: only read the total), budget, prefill slots,
# prefill ms (its expected first token, LongContextAsk.prefill_ms), demand window ms, lease
# ms, expected ms, reclaim limit, prefill hold ms (the safety expiry; absent: prefill ms),
# lane slots (absent: 0), very long (1/0; absent: 1), prefill ms beside a very long prefill
# (LongContextAsk.prefill_beside_ms; absent: 0)
# -> {admitted, wait ms, KV in flight after the call, reclaimed, the refusal's clause (0: none;
# LongContextClause)}; or 'release', lease id,
# never ran (1/0: see lc_unserve) -> released (0/1); or 'prefilled', lease id (its first
# token arrived: lc_prefilled) -> released a slot (0/1); or, with the ledger's ``:r`` as
# KEYS[4] (``long_prefill_placement``), 'placed', lease id, replica id -> recorded (0/1); or
# 'placements', '' -> {KV in flight, then per replica: id, leased KV, long prefills running,
# of them very long} (``Limiter.placements``).
LONG_CONTEXT_LUA = (
    LEDGER_LUA
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid = ARGV[2]
if ARGV[1] == 'release' then
  if ARGV[3] == '1' then lc_unserve(KEYS[1], KEYS[3], rid, now) end
  return lc_drop(KEYS[1], KEYS[2], rid)
end
if ARGV[1] == 'prefilled' then return lc_prefilled(KEYS[1], rid, now) end
-- KEYS[4] (the ledger's ``:r``): each placed lease's replica. 'placed': the lease's request
-- was dispatched to replica ARGV[3] (recorded only while the lease lives).
if ARGV[1] == 'placed' then
  if not redis.call('HGET', KEYS[1], rid) then return 0 end
  redis.call('HSET', KEYS[4], rid, ARGV[3])
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl > 0 and redis.call('PTTL', KEYS[4]) < ttl then redis.call('PEXPIRE', KEYS[4], ttl) end
  return 1
end
-- 'placements': the KV in flight, then per replica its leases' KV, their long prefills
-- running (prefill end still ahead: no first token yet) and of them the very long ones
-- (no ':s' tier on the admission record); the records of leases gone are dropped here.
if ARGV[1] == 'placements' then
  local out, by, order = {tonumber(redis.call('HGET', KEYS[1], '#') or '0')}, {}, {}
  local all = redis.call('HGETALL', KEYS[4])
  for i = 1, #all, 2 do
    local id, rep = all[i], all[i + 1]
    local v = redis.call('HGET', KEYS[1], id)
    if not v then
      redis.call('HDEL', KEYS[4], id)
    else
      local kv, pe = string.match(v, '^(%d+):(%d+):')
      local x = by[rep]
      if not x then
        x = {0, 0, 0}
        by[rep] = x
        table.insert(order, rep)
      end
      x[1] = x[1] + tonumber(kv)
      if tonumber(pe) > now then
        x[2] = x[2] + 1
        local p = redis.call('HGET', KEYS[1], 'p:' .. id)
        if not (p and string.sub(p, -2) == ':s') then x[3] = x[3] + 1 end
      end
    end
  end
  for _, rep in ipairs(order) do
    local x = by[rep]
    table.insert(out, rep)
    table.insert(out, x[1])
    table.insert(out, x[2])
    table.insert(out, x[3])
  end
  return out
end
local tenant, need, budget = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local slots, prefill_ms, window = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local lease_ms, expected_ms, limit = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local hold_ms = tonumber(ARGV[12] or ARGV[7])
local lane, very_long = tonumber(ARGV[13] or '0'), ARGV[14] ~= '0'
local beside_ms = tonumber(ARGV[15] or '0')
local reclaimed = lc_reclaim(KEYS[1], KEYS[2], now, limit)
local total = tonumber(redis.call('HGET', KEYS[1], '#') or '0')
if need > 0 then
  local wait, eff_ms, clause = lc_refusal(KEYS[1], KEYS[2], KEYS[3], now, tenant, need, budget,
                                          slots, window, total, prefill_ms, lane, very_long,
                                          beside_ms)
  if wait then return {0, math.ceil(wait), total, reclaimed, clause} end
  lc_charge(KEYS[1], KEYS[2], KEYS[3], now, rid, tenant, need, hold_ms, expected_ms, lease_ms,
            eff_ms, very_long)
  total = total + need
end
return {1, 0, total, reclaimed, 0}
"""
)

ADMIT_LUA = (
    LEDGER_LUA
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid = ARGV[1]
local rpm, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
local est_tok, est_kv, kv_cap = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local lease_ms, expected_ms = tonumber(ARGV[7]), tonumber(ARGV[8])
local is_retry, retry_check = tonumber(ARGV[9]), tonumber(ARGV[10])
local rb_ratio, rb_min, rb_window = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local reclaim_limit = tonumber(ARGV[14])
-- the long-context budget (KEYS[5..7]; absent for a request under the threshold)
local tenant = ARGV[15]
local lc_need, lc_budget, lc_slots = tonumber(ARGV[16] or '0'), tonumber(ARGV[17] or '0'),
  tonumber(ARGV[18] or '0')
local lc_prefill_ms, lc_window = tonumber(ARGV[19] or '0'), tonumber(ARGV[20] or '0')
-- the prefill slot's safety expiry (held until the first token: LONG_CONTEXT_LUA 'prefilled')
local lc_hold_ms = tonumber(ARGV[21] or ARGV[19] or '0')
-- its tier: the lane's extra prefill slots, and whether it is very long (1/0)
local lc_lane, lc_very_long = tonumber(ARGV[22] or '0') or 0, ARGV[23] ~= '0'
local lc_beside_ms = tonumber(ARGV[24] or '0') or 0

-- == per-key limits: the section's header (see the module doc, "Per-key limits") =========
-- The API key's own section is always the TAIL of the call, so the layout above keeps its
-- positions: the key's bucket is the last key, and ARGV ends with
-- 'key', key_id, rpm, tpm, max_concurrency. Without it nothing below counts per key.
local nkeys, kb, kid, krpm, ktpm, kconc = #KEYS, nil, '', 0, 0, 0
if ARGV[#ARGV - 4] == 'key' then
  kb, nkeys = KEYS[#KEYS], #KEYS - 1
  kid = ARGV[#ARGV - 3]
  krpm, ktpm, kconc = tonumber(ARGV[#ARGV - 2]), tonumber(ARGV[#ARGV - 1]), tonumber(ARGV[#ARGV])
end
-- A lease of a key carries its id ("<est_kv>:<end>:<key_id>") so that whoever ends it
-- (settle, or the reclaim below) also gives back its slot in the key's in-flight count,
-- kept beside the leases as the field '#k:<key_id>'.
local function release_key_slot(v)
  local id = string.match(v, '^%d+:%d+:(.+)$')
  if id and redis.call('HINCRBY', KEYS[2], '#k:' .. id, -1) <= 0 then
    redis.call('HDEL', KEYS[2], '#k:' .. id)
  end
end
-- == end of the per-key header ============================================================
local lc = nkeys >= 7

-- 1. reclaim leases nobody renewed (docs/design.md R4)
local reclaimed = 0
local dead = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, reclaim_limit)
if #dead > 0 then
  local freed = 0
  for _, id in ipairs(dead) do
    local v = redis.call('HGET', KEYS[2], id)
    if v then
      freed = freed + tonumber(string.match(v, '^(%d+)'))
      release_key_slot(v)  -- per-key
      redis.call('HDEL', KEYS[2], id)
      reclaimed = reclaimed + 1
    end
    redis.call('ZREM', KEYS[3], id)
  end
  if freed > 0 then redis.call('HINCRBY', KEYS[2], '#', -freed) end
end
local inflight = tonumber(redis.call('HGET', KEYS[2], '#') or '0')

-- the long-context budget's ledger (LEDGER_LUA's functions)
local lc_total = 0
if lc then
  reclaimed = reclaimed + lc_reclaim(KEYS[5], KEYS[6], now, reclaim_limit)
  lc_total = tonumber(redis.call('HGET', KEYS[5], '#') or '0')
end

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
-- (on a Redis Cluster the budget lives in another slot: its counts come in ARGV[15..16]
-- and it is recorded by RETRY_BUDGET_LUA, see the module doc)
local width = rb_window / 6
local idx = math.floor(now / width)
-- (admitted, retries) summed over the slots still in the window
local function window(raw)
  local a, r = 0, 0
  for _, s in ipairs(raw) do
    if s then
      local si, sa, sr = string.match(s, '^(%d+):(%d+):(%d+)$')
      if si and tonumber(si) > idx - 6 then a = a + tonumber(sa); r = r + tonumber(sr) end
    end
  end
  return a, r
end
-- the current slot's value after this admission
local function counted(raw)
  local cur, ca, cr = raw[(idx % 6) + 1], 0, 0
  if cur then
    local si, sa, sr = string.match(cur, '^(%d+):(%d+):(%d+)$')
    if si and tonumber(si) == idx then ca = tonumber(sa); cr = tonumber(sr) end
  end
  return idx .. ':' .. (ca + 1) .. ':' .. (cr + is_retry)
end
local slots = {}
local adm, ret = 0, 0
if nkeys >= 4 then
  slots = redis.call('HMGET', KEYS[4], '0', '1', '2', '3', '4', '5')
  adm, ret = window(slots)
else
  adm, ret = tonumber(ARGV[15]), tonumber(ARGV[16])
end
-- 3a. the tenant's own retry window: the same six slots, fields '#r0'..'#r5' of its leases
-- hash (in its slot: one call on a cluster too; fields starting '#' are not leases)
local tslots = redis.call('HMGET', KEYS[2], '#r0', '#r1', '#r2', '#r3', '#r4', '#r5')
local tadm, tret = window(tslots)

-- per-key: the key's own buckets and in-flight count (reported after the tenant's fields)
local krl, ktl, kinflight = 0, 0, 0
if kb then
  local k = redis.call('HMGET', kb, 'rl', 'rt', 'tl', 'tt')
  if krpm > 0 then krl = level(k[1], k[2], krpm) end
  if ktpm > 0 then ktl = level(k[3], k[4], ktpm) end
  kinflight = tonumber(redis.call('HGET', KEYS[2], '#k:' .. kid) or '0')
end
local function key_tail(r)
  if kb then
    for _, x in ipairs({math.floor(krl), reset(krl, krpm), math.floor(ktl), reset(ktl, ktpm),
                        kinflight}) do
      table.insert(r, x)
    end
  end
  return r
end

local function deny(reason, wait, clause)
  return key_tail({0, reason, math.ceil(wait), math.floor(rl), reset(rl, rpm), math.floor(tl),
          reset(tl, tpm), inflight, reclaimed, adm, ret, now, lc_total, clause or 0})
end

if rpm > 0 and rl < 1 then return deny(1, (1 - rl) * 60000 / rpm) end
if tpm > 0 and tl <= 0 then return deny(2, (-tl) * 60000 / tpm + 1) end
if kv_cap > 0 and inflight > 0 and inflight + est_kv > kv_cap then
  -- when will enough of the in-flight leases end (their expected ends) for this to fit?
  local need = inflight + est_kv - kv_cap
  local ends = {}
  local all = redis.call('HGETALL', KEYS[2])
  for i = 1, #all, 2 do
    -- not leases: '#' the sum, '#k:<id>' a key's count, '#r<n>' the retry window
    if string.sub(all[i], 1, 1) ~= '#' then
      local e, en = string.match(all[i + 1], '^(%d+):(%d+)')
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
-- a tenant's retries past the ratio of its own admissions are shed (6); the fleet's budget
-- (4) is the second line: in a storm it sheds only a retry that would take its tenant past
-- the ratio (retry.retry_shed is the same rule)
if is_retry == 1 and retry_check == 1 then
  if tadm >= rb_min and tret > rb_ratio * tadm then return deny(6, 0) end
  if adm >= rb_min and ret > rb_ratio * adm and tret + 1 > rb_ratio * (tadm + 1) then
    return deny(4, 0)
  end
end

-- 3b. the fleet's long-context budget (a request with no claim, lc_need 0, only reads the
-- ledger's total for placement)
if lc and lc_need > 0 then
  local wait, eff_ms, clause = lc_refusal(KEYS[5], KEYS[6], KEYS[7], now, tenant, lc_need,
                                          lc_budget, lc_slots, lc_window, lc_total, lc_prefill_ms,
                                          lc_lane, lc_very_long, lc_beside_ms)
  lc_prefill_ms = eff_ms
  if wait then return deny(5, wait, clause) end
end

-- == per-key limits: the key's own checks, after the tenant's (see the module doc) ======
-- 11: its requests/min, 12: its tokens/min, 13: its concurrency cap (reasons the Limiter maps
-- to the key's 429). Nothing is charged before all of them pass.
if kb then
  if krpm > 0 and krl < 1 then return deny(11, (1 - krl) * 60000 / krpm) end
  if ktpm > 0 and ktl <= 0 then return deny(12, (-ktl) * 60000 / ktpm + 1) end
  if kconc > 0 and kinflight >= kconc then
    -- frees when the first of the key's leases is expected to end
    local first = nil
    local all = redis.call('HGETALL', KEYS[2])
    for i = 1, #all, 2 do
      local en, id = string.match(all[i + 1], '^%d+:(%d+):(.+)$')
      if id == kid and string.sub(all[i], 1, 1) ~= '#' then
        en = tonumber(en)
        if not first or en < first then first = en end
      end
    end
    return deny(13, math.max(0, (first or (now + lease_ms)) - now))
  end
end
-- == end of the per-key checks =============================================================

-- 4. charge: bucket, lease, budget
local ttl = 1000
if rpm > 0 then rl = rl - 1; ttl = math.max(ttl, reset(rl, rpm) + 1000) end
if tpm > 0 then tl = tl - est_tok; ttl = math.max(ttl, reset(tl, tpm) + 1000) end
if rpm > 0 or tpm > 0 then
  redis.call('HSET', KEYS[1], 'rl', string.format('%.17g', rl), 'rt', now,
             'tl', string.format('%.17g', tl), 'tt', now)
  redis.call('PEXPIRE', KEYS[1], ttl)
end
local key_suffix = ''  -- per-key: the lease names its key, whose in-flight count it holds
if kb then key_suffix = ':' .. kid end
redis.call('HSET', KEYS[2], rid, est_kv .. ':' .. (now + expected_ms) .. key_suffix)
redis.call('HINCRBY', KEYS[2], '#', est_kv)
redis.call('ZADD', KEYS[3], now + lease_ms, rid)
redis.call('PEXPIRE', KEYS[2], lease_ms + 60000)
redis.call('PEXPIRE', KEYS[3], lease_ms + 60000)
if nkeys >= 4 then
  redis.call('HSET', KEYS[4], tostring(idx % 6), counted(slots))
  redis.call('PEXPIRE', KEYS[4], rb_window * 2)
end
redis.call('HSET', KEYS[2], '#r' .. (idx % 6), counted(tslots))
if lc and lc_need > 0 then
  lc_charge(KEYS[5], KEYS[6], KEYS[7], now, rid, tenant, lc_need, lc_hold_ms, expected_ms,
            lease_ms, lc_prefill_ms, lc_very_long)
  lc_total = lc_total + lc_need
end
-- == per-key limits: charge the key's bucket and take a slot of its in-flight count =======
if kb then
  local kttl = 1000
  if krpm > 0 then krl = krl - 1; kttl = math.max(kttl, reset(krl, krpm) + 1000) end
  if ktpm > 0 then ktl = ktl - est_tok; kttl = math.max(kttl, reset(ktl, ktpm) + 1000) end
  if krpm > 0 or ktpm > 0 then
    redis.call('HSET', kb, 'rl', string.format('%.17g', krl), 'rt', now,
               'tl', string.format('%.17g', ktl), 'tt', now)
    redis.call('PEXPIRE', kb, kttl)
  end
  kinflight = kinflight + 1
  redis.call('HINCRBY', KEYS[2], '#k:' .. kid, 1)
end
-- == end of the per-key charge =============================================================
return key_tail({1, 0, 0, math.floor(rl), reset(rl, rpm), math.floor(tl), reset(tl, tpm),
        inflight, reclaimed, adm + 1, ret + is_retry, now, lc_total, 0})
"""
)

SETTLE_LUA = (
    LEDGER_LUA
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid = ARGV[1]
local est_tok, actual, refund_req = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local rpm, tpm = tonumber(ARGV[5]), tonumber(ARGV[6])
-- per-key limits: as in ADMIT_LUA, the key's section is the tail (the key's bucket last in
-- KEYS, ARGV ending with 'key', rpm, tpm); its in-flight slot is named by the lease itself.
local nkeys, kb, krpm, ktpm = #KEYS, nil, 0, 0
if ARGV[#ARGV - 2] == 'key' then
  kb, nkeys = KEYS[#KEYS], #KEYS - 1
  krpm, ktpm = tonumber(ARGV[#ARGV - 1]), tonumber(ARGV[#ARGV])
end
local released = 0
local v = redis.call('HGET', KEYS[2], rid)
if v then
  local kid = string.match(v, '^%d+:%d+:(.+)$')  -- per-key: give the key's slot back
  if kid and redis.call('HINCRBY', KEYS[2], '#k:' .. kid, -1) <= 0 then
    redis.call('HDEL', KEYS[2], '#k:' .. kid)
  end
  redis.call('HDEL', KEYS[2], rid)
  redis.call('HINCRBY', KEYS[2], '#', -tonumber(string.match(v, '^(%d+)')))
  released = 1
end
redis.call('ZREM', KEYS[3], rid)
if nkeys >= 5 then  -- the long-context budget's lease (its waiting set KEYS[6])
  if refund_req == 1 and nkeys >= 6 then lc_unserve(KEYS[4], KEYS[6], rid, now) end
  lc_drop(KEYS[4], KEYS[5], rid)
end
-- One bucket hash (the tenant's, or per key the key's): reconcile tokens, refund a request.
local function reconcile(bucket, rpm, tpm)
  if rpm <= 0 and tpm <= 0 then return end
  local b = redis.call('HMGET', bucket, 'rl', 'rt', 'tl', 'tt')
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
  redis.call('HSET', bucket, 'rl', string.format('%.17g', rl), 'rt', now,
             'tl', string.format('%.17g', tl), 'tt', now)
  redis.call('PEXPIRE', bucket, ttl)
end
reconcile(KEYS[1], rpm, tpm)
if kb then reconcile(kb, krpm, ktpm) end  -- per-key: the key's own bucket alike
return released
"""
)

# The retry budget on its own (Redis Cluster only): returns the window's
# {admitted, retries} before this call, and with ARGV[1] = 1 records one admission
# (ARGV[2] = 1: a retry). The same window arithmetic as ADMIT_LUA's step 3 and 4.
RETRY_BUDGET_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local record, is_retry, rb_window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local width = rb_window / 6
local idx = math.floor(now / width)
local slots = redis.call('HMGET', KEYS[1], '0', '1', '2', '3', '4', '5')
local adm, ret = 0, 0
for _, s in ipairs(slots) do
  if s then
    local si, sa, sr = string.match(s, '^(%d+):(%d+):(%d+)$')
    if si and tonumber(si) > idx - 6 then adm = adm + tonumber(sa); ret = ret + tonumber(sr) end
  end
end
if record == 1 then
  local cur = slots[(idx % 6) + 1]
  local ca, cr = 0, 0
  if cur then
    local si, sa, sr = string.match(cur, '^(%d+):(%d+):(%d+)$')
    if si and tonumber(si) == idx then ca = tonumber(sa); cr = tonumber(sr) end
  end
  redis.call('HSET', KEYS[1], tostring(idx % 6), idx .. ':' .. (ca + 1) .. ':' .. (cr + is_retry))
  redis.call('PEXPIRE', KEYS[1], rb_window * 2)
end
return {adm, ret}
"""

# One request from each requests/min bucket in KEYS (the tenant-model's, its API key's when
# the key has its own) and nothing else (no tokens, no lease, no retry budget): what an
# idempotent replay costs. ARGV: per key, its rpm and the reason that names it in a refusal
# (ADMIT_LUA's: 1 the tenant's, 11 the key's). Returns {ok, wait ms, remaining, reset ms,
# reason} (remaining and reset of the first bucket); ADMIT_LUA's bucket arithmetic (an
# absent field is a full bucket, so the tokens buckets are left as they are).
REQUEST_ONLY_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function level(key, rpm)
  local b = redis.call('HMGET', key, 'rl', 'rt')
  if not b[1] then return rpm end
  return math.min(rpm, tonumber(b[1]) + math.max(0, now - tonumber(b[2])) * rpm / 60000)
end
local function reset(l, rpm) return math.ceil((rpm - l) * 60000 / rpm) end
local levels = {}
for i = 1, #KEYS do
  local rpm = tonumber(ARGV[2 * i - 1])
  levels[i] = level(KEYS[i], rpm)
  if levels[i] < 1 then
    return {0, math.ceil((1 - levels[i]) * 60000 / rpm), 0, reset(levels[i], rpm),
            tonumber(ARGV[2 * i])}
  end
end
for i = 1, #KEYS do
  local rpm, l = tonumber(ARGV[2 * i - 1]), levels[i] - 1
  redis.call('HSET', KEYS[i], 'rl', string.format('%.17g', l), 'rt', now)
  local ttl = reset(l, rpm) + 1000
  if redis.call('PTTL', KEYS[i]) < ttl then redis.call('PEXPIRE', KEYS[i], ttl) end
end
local rpm = tonumber(ARGV[1])
return {1, 0, math.floor(levels[1] - 1), reset(levels[1] - 1, rpm), 0}
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


def tenant_tag(tenant_id: str, family: str) -> str:
    return f"{PREFIX}{{{tenant_id}:{family}}}"


def key_tag(tenant_id: str, family: str, key_id: str) -> str:
    """An API key's own buckets for one family: under its tenant-model's hash tag, so the
    admit and settle scripts take them in the same call (and slot) as the tenant's."""
    return f"{tenant_tag(tenant_id, family)}:k:{key_id}"


def retry_key(version: str) -> str:
    return f"{PREFIX}rb:{{{version}}}"


@dataclass(frozen=True, slots=True)
class Placements:
    """``Limiter.placements``: the ledger's long-context KV in flight, and per replica
    (``by_replica``) its recorded leases' KV, long prefills running and very long ones."""

    inflight_bytes: int
    by_replica: dict[str, tuple[int, int, int]]


def long_context_tag(version: str) -> str:
    """The fleet's long-context ledger of one version: ``:l`` leases and sums, ``:e`` lease
    deadlines, ``:w`` tenants refused within the demand window, ``:r`` each dispatched
    lease's replica (written only under ``long_prefill_placement``). One ledger for the shared
    pool, each class admitted against its own budget (its ceiling's share of the same
    replicas), since every class's long contexts land on the same designated replicas."""
    return f"{PREFIX}lc:{{{version}}}"


def prefilling(holds: dict[str, float], now: float) -> int:
    """How many of ``holds`` (lease id -> when its prefill slot lapses at the latest) still
    hold a prefill slot at ``now``; lapsed ones are dropped. The local ledger's count of
    what ``lc_refusal`` counts in Redis (a prefill end still in the future)."""
    for lease_id in [k for k, until in holds.items() if until <= now]:
        del holds[lease_id]
    return len(holds)


Node = tuple[str, int] | None  # a store node's address; None: the single Redis


def slot_of(tag: str) -> int:
    """The hash slot of every key under ``tag`` (``tenant_tag`` or ``retry_key``)."""
    return key_slot(tag.encode())


class StoreRefused(RedisConnectionError):
    """Redis answered with one of ``STORE_REFUSALS``: for admission, the store is down."""

    def __init__(self, kind: str, reply: ResponseError) -> None:
        super().__init__(f"limits store refuses writes ({kind}): {reply}")
        self.kind = kind


def store_refusal(exc: BaseException) -> StoreRefused | None:
    """``exc`` as a :class:`StoreRefused` when it is one of ``STORE_REFUSALS``, else None.
    (redis-py names some of them, e.g. ``OutOfMemoryError``, and strips the first word from
    the message; the script channel passes the reply as it came.)"""
    if isinstance(exc, StoreRefused):
        return exc
    if not isinstance(exc, ResponseError):
        return None
    name = type(exc).__name__
    if name == "OutOfMemoryError":
        return StoreRefused("oom", exc)
    if name in ("BusyLoadingError", "ReadOnlyError"):
        return StoreRefused("loading" if name == "BusyLoadingError" else "readonly", exc)
    found = _REFUSAL.search(str(exc))
    return StoreRefused(found.group(1).lower(), exc) if found else None


def _error_kind(exc: BaseException | None) -> str:
    if isinstance(exc, StoreRefused):
        return exc.kind
    if isinstance(exc, RedisTimeoutError | TimeoutError):
        return "timeout"
    return "unreachable"


class LimiterStats(Protocol):
    """What the limiter reports; the admission controller backs it with Prometheus."""

    def redis_up(self, up: bool) -> None: ...
    def fail_open(self, layer: str) -> None: ...
    def fail_closed(self, admitted: bool) -> None: ...
    def leases_reclaimed(self, n: int) -> None: ...
    def leases_lost(self, n: int) -> None: ...
    def store_error(self, kind: str) -> None: ...


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

    def store_error(self, kind: str) -> None:
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
    long: LongContextAsk | None = None  # a request above the long-context threshold
    read_long: bool = False  # no claim, but report the ledger's KV in flight (placement)
    # Per-key limits: the API key's own, checked in the same call as the tenant's. With a
    # key id its in-flight requests are always counted (so a cap set later is exact at
    # once); 0 = no limit of that kind.
    key_id: str = ""
    key_rpm: int = 0
    key_tpm: int = 0
    key_concurrency: int = 0


@dataclass(frozen=True, slots=True)
class LongContextAsk:
    """A long-context request's claim on its version-and-class budget."""

    cls: str  # the effective class whose budget it draws on
    kv_bytes: int  # its prompt's KV
    budget_bytes: int  # the budget's KV (gateway.admission.long_context.long_context_budget)
    prefill_slots: int  # concurrent long prefills the budget allows
    # when its first token is expected, from admission (attention included:
    # estimates.prefill_expected_seconds); its lease records it, and a refusal for a full
    # prefill slot is told to wait until the first running prefill's is due
    prefill_ms: int
    demand_window_ms: int
    # How long its prefill slot is held at most: the slot is released when the first token
    # arrives (``Limiter.prefill_done``); this expiry only bounds a release that never
    # comes (a failed call). 0: ``prefill_ms``.
    prefill_hold_ms: int = 0
    # Its tier (long_context.py's ``long_context_admits``): a very long prompt takes one of
    # ``prefill_slots``; a shorter one may also take one of ``lane_slots`` more.
    very_long: bool = True
    lane_slots: int = 0
    # A shorter ask admitted while a very long prefill runs: its expected first token then
    # (long_context.lane_prefill_seconds; 0: ``prefill_ms``), what its lease records and
    # its backfill counts with.
    prefill_beside_ms: int = 0

    @property
    def hold_ms(self) -> int:
        return self.prefill_hold_ms or self.prefill_ms


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
    long_tag: str | None = None  # the long-context budget it holds a lease on
    version: str = ""
    long_kv_bytes: int = 0
    key_id: str = ""  # per-key limits: the key whose buckets and in-flight slot it holds
    key_rpm: int = 0
    key_tpm: int = 0
    # Redis Cluster: its long-context lease was claimed in-process (the ledger's node was
    # down), so there is nothing to release on the ledger's slot
    long_local: bool = False

    @classmethod
    def of(cls, q: QuotaRequest, lease_id: str, *, local: bool) -> Grant:
        return cls(
            lease_id,
            q.tenant_id,
            q.family,
            q.rpm,
            q.tpm,
            q.est_tokens,
            q.est_kv_milli,
            local,
            long_tag=long_context_tag(q.version) if q.long else None,
            version=q.version,
            long_kv_bytes=q.long.kv_bytes if q.long else 0,
            key_id=q.key_id,
            key_rpm=q.key_rpm,
            key_tpm=q.key_tpm,
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
    degraded: bool  # decided without Redis (docs/design.md §8)
    store_ms: int = 0  # the store's clock at the decision (0 when decided locally)
    long_context_full: bool = False  # refused by the fleet's long-context budget (503)
    # which of the budget's clauses refused it (None when it did not; the local fallback's
    # KV_FULL / SLOTS_FULL for its share of the budget)
    long_context_clause: LongContextClause | None = None
    long_inflight_bytes: int = -1  # the budget's KV in flight after the decision (-1: n/a)
    retry_scope: str = ""  # which retry budget shed it: "tenant" (its own) or "fleet"
    # Per-key limits: ``key_limited`` when the key's own limit refused (``layer`` names
    # which); ``key_state`` its buckets (None when it has no rpm/tpm of its own or the
    # decision was local); ``key_inflight`` its requests in flight, this one included.
    key_limited: bool = False
    key_state: RateLimitState | None = None
    key_inflight: int = 0


@dataclass(slots=True)
class _LocalTenant:
    """In-process view of one tenant-model: fail-closed KV ledger and header shadows."""

    rpm: LocalBucket
    tpm: LocalBucket
    leases: dict[str, int] = field(default_factory=dict)
    retries: WindowCounts = field(default_factory=WindowCounts)  # its own retry budget

    @property
    def inflight(self) -> int:
        return sum(self.leases.values())


class Limiter:
    """Admits, settles and renews quota holds; degrades as docs/design.md §8 says when Redis
    is unreachable."""

    def __init__(
        self,
        client: aioredis.Redis,
        cfg: AdmissionConfig,
        *,
        stats: LimiterStats | None = None,
        probe_interval_s: float = 1.0,
    ) -> None:
        self._cfg = cfg
        self._stats: LimiterStats = stats or NullStats()
        # Every script call (admit, settle, renewal, the budget and the long-context
        # ledger) goes through one multiplexed connection (gateway.admission.scriptchannel),
        # TLS included, on a single Redis and on a cluster: one path, no redis-py script
        # objects beside it. A client whose connection class the channel does not know is
        # refused here (no redis://, rediss:// or unix:// URL makes one).
        self._cluster = isinstance(client, RedisCluster)
        self._channel: ScriptChannel | ClusterScriptChannel = (
            ClusterScriptChannel.for_cluster(client)
            if self._cluster
            else ScriptChannel.for_client(client)
        )
        self._admit_lua = LuaScript.of(ADMIT_LUA)
        self._settle_lua = LuaScript.of(SETTLE_LUA)
        self._renew_lua = LuaScript.of(RENEW_LUA)
        self._budget_lua = LuaScript.of(RETRY_BUDGET_LUA)
        self._long_lua = LuaScript.of(LONG_CONTEXT_LUA)
        self._request_only_lua = LuaScript.of(REQUEST_ONLY_LUA)
        # Lease ids: the request id (clients' ids may repeat, ours are unique per process)
        # plus this limiter's random tag and a counter — no uuid4 (an os.urandom syscall)
        # per request.
        self._lease_tag = os.urandom(4).hex()
        self._lease_seq = itertools.count()
        self._probe_interval_s = probe_interval_s
        # Store node -> monotonic time until which it is not asked (its calls are decided
        # locally meanwhile). One entry, None, on a single Redis; on a cluster one per
        # master that failed, so a lost master degrades only the tenants whose slots it
        # holds.
        self._down: dict[Node, float] = {}
        self._up = True
        self._answered_at = float("-inf")  # monotonic time of the store's last answer
        self._logged_at: dict[Node, float] = {}
        self._unlogged: dict[Node, int] = {}
        self._local: dict[tuple[str, str], _LocalTenant] = {}
        self._local_retries: dict[str, WindowCounts] = {}
        # version -> monotonic time of this process's last ledger read (cluster only)
        self._long_read: dict[str, float] = {}
        # long-context budget tag -> {lease id: kv bytes} admitted by this process locally,
        # and {lease id: monotonic safety expiry} of those still prefilling
        self._local_long: dict[str, dict[str, int]] = {}
        self._local_prefill: dict[str, dict[str, float]] = {}
        # Per-key limits: (key id, family) -> lease ids of its requests in flight from this
        # process, so that without Redis a key's concurrency cap still fails closed.
        self._local_keys: dict[tuple[str, str], set[str]] = {}

    @property
    def redis_up(self) -> bool:
        return self._up

    async def aclose(self) -> None:
        """Close the script channel (the redis-py client belongs to the caller)."""
        await self._channel.aclose()

    async def _eval(self, lua: LuaScript, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        try:
            return await self._channel.evalsha(lua, keys, args)
        except ResponseError as exc:
            raise store_refusal(exc) or exc from exc

    # -- health ------------------------------------------------------------------------
    def _node_of(self, tenant_id: str, family: str) -> Node:
        """The store node holding a tenant-model's keys (None: a single Redis)."""
        if isinstance(self._channel, ClusterScriptChannel):
            return self._channel.owner_of(tenant_tag(tenant_id, family))
        return None

    def _redis_usable(self, node: Node = None) -> bool:
        until = self._down.get(node)
        return until is None or time.monotonic() >= until

    def _mark(self, up: bool, exc: BaseException | None = None, node: Node = None) -> None:
        was_down = node in self._down
        now = time.monotonic()
        if up:
            self._down.pop(node, None)
            self._answered_at = now
        else:
            self._down[node] = now + self._probe_interval_s
            self._stats.store_error(_error_kind(exc))
        if up == was_down and self._may_log(node, now):
            where = "" if node is None else f" (node {node[0]}:{node[1]})"
            if up:
                log.warning(
                    "limits store reachable again%s: requests/tokens enforced, KV·seconds "
                    "back on the shared ledger",
                    where,
                )
            else:
                log.error(
                    "limits store unavailable%s (%s): requests/min and tokens/min FAIL OPEN, "
                    "KV·seconds FAILS CLOSED to %.0f%% of each tenant's cap in-process",
                    where,
                    exc,
                    self._cfg.local_kv_fraction * 100,
                )
        all_up = not self._down
        if all_up != self._up:
            self._up = all_up
            self._stats.redis_up(all_up)

    def _may_log(self, node: Node, now: float) -> bool:
        """At most one up/down line per node every ``LOG_EVERY_S``; the first change after a
        quiet spell says how many were not logged."""
        if now - self._logged_at.get(node, -LOG_EVERY_S) < LOG_EVERY_S:
            self._unlogged[node] = self._unlogged.get(node, 0) + 1
            return False
        self._logged_at[node] = now
        skipped = self._unlogged.pop(node, 0)
        if skipped:
            log.warning("limits store: %d up/down changes were not logged", skipped)
        return True

    def answered_within(self, seconds: float) -> bool:
        """True when the store answered this process within ``seconds`` and is not known
        to be down since: what a decision taken without asking it may rely on."""
        return self._up and time.monotonic() - self._answered_at <= seconds

    def _local_for(self, q_tenant: str, family: str, rpm: int, tpm: int) -> _LocalTenant:
        key = (q_tenant, family)
        entry = self._local.get(key)
        if entry is None or entry.rpm.capacity != rpm or entry.tpm.capacity != tpm:
            leases = entry.leases if entry else {}
            retries = entry.retries if entry else WindowCounts(self._cfg.retry_budget_window_s)
            entry = _LocalTenant(LocalBucket(rpm), LocalBucket(tpm), leases, retries)
            self._local[key] = entry
        return entry

    # -- admit -------------------------------------------------------------------------
    async def admit(self, q: QuotaRequest) -> QuotaDecision:
        lease_id = f"{q.request_id}:{self._lease_tag}{next(self._lease_seq):x}"
        local = self._local_for(q.tenant_id, q.family, q.rpm, q.tpm)
        node = self._node_of(q.tenant_id, q.family)
        if self._redis_usable(node):
            try:
                if self._cluster and (q.long is not None or q.read_long):
                    decision = await self._admit_cluster_long(q, lease_id)
                else:
                    decision = await self._admit_redis(q, lease_id)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                self._mark(False, exc, node)
            else:
                self._mark(True, node=node)
                if decision.grant is not None:
                    local.leases[lease_id] = q.est_kv_milli
                    self._hold_key(q, lease_id)
                return decision
        return self._admit_local(q, lease_id, local)

    def _hold_key(self, q: QuotaRequest, lease_id: str) -> None:
        if q.key_id:
            self._local_keys.setdefault((q.key_id, q.family), set()).add(lease_id)

    async def _admit_redis(self, q: QuotaRequest, lease_id: str) -> QuotaDecision:
        tag = tenant_tag(q.tenant_id, q.family)
        cfg = self._cfg
        keys: list[Arg] = [f"{tag}:b", f"{tag}:l", f"{tag}:e", retry_key(q.version)]
        budget: tuple[int, ...] = ()
        window_ms = int(cfg.retry_budget_window_s * 1000)
        if self._cluster:
            # The budget is in another slot (module doc): read it first for a retry that
            # it may shed; a first attempt is never shed, so it does not wait for it.
            keys = keys[:3]
            counts: Any = (0, 0)
            if q.is_retry and not q.retry_exempt:
                try:
                    counts = await self._eval(
                        self._budget_lua, (retry_key(q.version),), (0, 0, window_ms)
                    )
                except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                    # The budget's node is not the tenant's: without it, no retry is shed
                    # (the quota itself is still enforced).
                    log.warning("retry budget of %s unreadable: %r", q.version, exc)
            budget = (int(counts[0]), int(counts[1]))
        args: list[Arg] = [
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
            window_ms,
            RECLAIM_PER_ADMIT,
            *budget,
        ]
        # The long-context ledger (single Redis only: on a cluster it is in another slot
        # than the tenant's keys; ``admit`` drops the claim there, see the module doc).
        if q.long is not None:
            lc = long_context_tag(q.version)
            keys += [f"{lc}:l", f"{lc}:e", f"{lc}:w"]
            args += [
                q.tenant_id,
                q.long.kv_bytes,
                q.long.budget_bytes,
                q.long.prefill_slots,
                q.long.prefill_ms,
                q.long.demand_window_ms,
                q.long.hold_ms,
                q.long.lane_slots,
                int(q.long.very_long),
                q.long.prefill_beside_ms,
            ]
        elif q.read_long:
            lc = long_context_tag(q.version)
            keys += [f"{lc}:l", f"{lc}:e", f"{lc}:w"]
            args += [q.tenant_id, 0, 0, 0, 0, 0, 0, 0, 1, 0]
        # Per-key limits: the key's section goes last (ADMIT_LUA reads it from the tail).
        if q.key_id:
            keys.append(key_tag(q.tenant_id, q.family, q.key_id))
            args += ["key", q.key_id, q.key_rpm, q.key_tpm, q.key_concurrency]
        res: list[Any] = await self._eval(self._admit_lua, keys, args)
        key_res = [int(x) for x in res[-5:]] if q.key_id else []
        if q.key_id:
            res = res[:-5]
        (
            ok,
            reason,
            wait,
            rrem,
            rreset,
            trem,
            treset,
            inflight,
            reclaimed,
            _adm,
            _ret,
            now_ms,
            lc_total,
            lc_clause,
        ) = (int(x) for x in res)
        key_state, key_inflight = self._key_state(q, key_res)
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
            if self._cluster:
                self._record_budget(q.version, q.is_retry, window_ms)
        return QuotaDecision(
            admitted=bool(ok),
            layer=_KEY_REASONS[reason] if reason in _KEY_REASONS else _REASONS.get(reason),
            retry_storm=reason in (RETRY_BUDGET, TENANT_RETRY_BUDGET),
            retry_scope={RETRY_BUDGET: "fleet", TENANT_RETRY_BUDGET: "tenant"}.get(reason, ""),
            frees_in_ms=wait,
            state=state,
            inflight_kv_milli=inflight,
            grant=grant,
            degraded=False,
            store_ms=now_ms,
            long_context_full=reason == LONG_CONTEXT,
            long_context_clause=LongContextClause(lc_clause) if reason == LONG_CONTEXT else None,
            long_inflight_bytes=lc_total if q.long is not None or q.read_long else -1,
            key_limited=reason in _KEY_REASONS,
            key_state=key_state,
            key_inflight=key_inflight,
        )

    async def _admit_cluster_long(self, q: QuotaRequest, lease_id: str) -> QuotaDecision:
        """A Redis Cluster admission that touches the long-context ledger (in another slot
        than the tenant's keys, see the module doc): the tenant's script, then the claim on
        the ledger's slot; a short request's throttled read of the ledger runs beside it."""
        tenant_q = replace(q, long=None, read_long=False)
        if q.long is None:
            now = time.monotonic()
            if now - self._long_read.get(q.version, -1e9) < LONG_READ_INTERVAL_S:
                return await self._admit_redis(tenant_q, lease_id)
            self._long_read[q.version] = now
            decision, total = await asyncio.gather(
                self._admit_redis(tenant_q, lease_id), self._read_long(q.version)
            )
            return replace(decision, long_inflight_bytes=total)
        decision = await self._admit_redis(tenant_q, lease_id)
        if decision.grant is None:
            return decision
        grant = decision.grant
        try:
            ok, wait, total, clause = await self._claim_long(q, lease_id)
        except BaseException:
            await self.settle(grant, actual_tokens=0, refund_request=True)
            raise
        if not ok:
            await self.settle(grant, actual_tokens=0, refund_request=True)
            return replace(
                decision,
                admitted=False,
                grant=None,
                frees_in_ms=wait,
                long_context_full=True,
                long_context_clause=clause,
                long_inflight_bytes=total,
            )
        grant.long_tag = long_context_tag(q.version)
        grant.long_kv_bytes = q.long.kv_bytes
        grant.long_local = lease_id in self._local_long.get(grant.long_tag, {})
        return replace(decision, long_inflight_bytes=total)

    async def _claim_long(
        self, q: QuotaRequest, lease_id: str
    ) -> tuple[bool, int, int, LongContextClause | None]:
        """``LONG_CONTEXT_LUA``'s claim: (admitted, wait ms, KV in flight after it, the clause
        that refused it). Without the ledger's node it fails closed like the local fallback
        (this process's share)."""
        ask = q.long
        assert ask is not None
        lc = long_context_tag(q.version)
        node = self._ledger_node(q.version)
        if self._redis_usable(node):
            args: tuple[Arg, ...] = (
                "claim",
                lease_id,
                q.tenant_id,
                ask.kv_bytes,
                ask.budget_bytes,
                ask.prefill_slots,
                ask.prefill_ms,
                ask.demand_window_ms,
                int(self._cfg.lease_ttl_s * 1000),
                q.expected_ms,
                RECLAIM_PER_ADMIT,
                ask.hold_ms,
                ask.lane_slots,
                int(ask.very_long),
                ask.prefill_beside_ms,
            )
            try:
                res = await self._eval(self._long_lua, (f"{lc}:l", f"{lc}:e", f"{lc}:w"), args)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                self._mark(False, exc, node)
            else:
                self._mark(True, node=node)
                ok, wait, total, reclaimed, clause = (int(x) for x in res)
                if reclaimed:
                    self._stats.leases_reclaimed(reclaimed)
                return bool(ok), wait, total, LongContextClause(clause) if not ok else None
        held = self._local_long.setdefault(lc, {})
        local_clause = self._long_full_locally(q)
        if local_clause is not None:
            return False, int(self._cfg.lease_ttl_s * 1000), sum(held.values()), local_clause
        self._hold_long_locally(q, lease_id)
        return True, 0, sum(held.values()), None

    async def _read_long(self, version: str) -> int:
        """The ledger's KV in flight (-1 when its node cannot be read: placement then goes
        by what this process placed)."""
        lc = long_context_tag(version)
        node = self._ledger_node(version)
        if not self._redis_usable(node):
            return -1
        args: tuple[Arg, ...] = ("claim", "", "", 0, 0, 0, 0, 0, 0, 0, RECLAIM_PER_ADMIT)
        try:
            res = await self._eval(self._long_lua, (f"{lc}:l", f"{lc}:e", f"{lc}:w"), args)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            self._mark(False, exc, node)
            return -1
        self._mark(True, node=node)
        return int(res[2])

    async def _release_long(self, grant: Grant, never_ran: bool = False) -> None:
        """Settle's half on the ledger's slot (cluster only); never raises. Without the
        ledger's node the lease expires on its own within lease_ttl_s."""
        await self._on_ledger(grant, "release", "1" if never_ran else "0")

    async def _on_ledger(self, grant: Grant, action: str, *args: Arg) -> int:
        """One ``LONG_CONTEXT_LUA`` action on the grant's own ledger lease: its answer, or
        0 when the lease was claimed in-process or the ledger's node cannot be asked.
        Never raises."""
        assert grant.long_tag is not None
        if grant.local or grant.long_local:
            return 0
        res = await self._ledger_eval(
            grant.version, (action, grant.lease_id, *args), f"{action} of lease {grant.lease_id}"
        )
        return 0 if res is None else int(res)

    async def _ledger_eval(self, version: str, args: Sequence[Arg], what: str) -> Any:
        """One ``LONG_CONTEXT_LUA`` call on ``version``'s ledger: its answer, or None when
        the ledger's node cannot be asked (marked down) or the script failed. Never raises."""
        node = self._ledger_node(version)
        if not self._redis_usable(node):
            return None
        lc = long_context_tag(version)
        keys = (f"{lc}:l", f"{lc}:e", f"{lc}:w", f"{lc}:r")
        try:
            res = await self._eval(self._long_lua, keys, args)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            self._mark(False, exc, node)
            return None
        except RedisError:
            log.exception("long-context %s failed for %s", what, version)
            return None
        self._mark(True, node=node)
        return res

    def _ledger_node(self, version: str) -> Node:
        if isinstance(self._channel, ClusterScriptChannel):
            return self._channel.owner_of(long_context_tag(version))
        return None

    def _long_full_locally(self, q: QuotaRequest) -> LongContextClause | None:
        """Without the ledger's store this process may hold ``local_kv_fraction`` of the
        budget and of its prefill slots (one request, one prefill at a time when that is
        less than one); a prefill holds its slot until its first token, as in the ledger.
        The tiers are not told apart here: every prefill counts against the very long
        slots, and an ask that is not very long may also use the lane's (fails closed).
        The clause that refuses the ask (KV_FULL or SLOTS_FULL: this process's share of
        them), None when it fits."""
        assert q.long is not None
        tag = long_context_tag(q.version)
        held = self._local_long.get(tag, {})
        share = q.long.budget_bytes * self._cfg.local_kv_fraction
        if held and sum(held.values()) + q.long.kv_bytes > share:
            return LongContextClause.KV_FULL
        lane = 0 if q.long.very_long else q.long.lane_slots
        slots = max(1, int((q.long.prefill_slots + lane) * self._cfg.local_kv_fraction))
        if prefilling(self._local_prefill.get(tag, {}), time.monotonic()) >= slots:
            return LongContextClause.SLOTS_FULL
        return None

    def _hold_long_locally(self, q: QuotaRequest, lease_id: str) -> None:
        """Charge a long-context lease to this process's own ledger: its KV, and its
        prefill slot until the first token (or the safety expiry)."""
        assert q.long is not None
        tag = long_context_tag(q.version)
        self._local_long.setdefault(tag, {})[lease_id] = q.long.kv_bytes
        until = time.monotonic() + q.long.hold_ms / 1000
        self._local_prefill.setdefault(tag, {})[lease_id] = until

    @staticmethod
    def _key_state(q: QuotaRequest, key_res: list[int]) -> tuple[RateLimitState | None, int]:
        """The key's buckets and in-flight count from ADMIT_LUA's tail (per-key limits)."""
        if not key_res:
            return None, 0
        krem, kreset, ktrem, ktreset, kinflight = key_res
        if not q.key_rpm and not q.key_tpm:
            return None, kinflight
        state = RateLimitState(q.key_rpm, max(0, krem), kreset, q.key_tpm, max(0, ktrem), ktreset)
        return state, kinflight

    def _record_budget(self, version: str, is_retry: bool, window_ms: int) -> None:
        """Count an admission in the version's retry budget (cluster only). Not waited
        for: written on the budget node's connection before any later call to it."""
        keys, args = (retry_key(version),), (1, int(is_retry), window_ms)
        assert isinstance(self._channel, ClusterScriptChannel)
        self._channel.send_nowait(self._budget_lua, keys, args)

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
        scope = None
        if q.is_retry and not q.retry_exempt:
            scope = retry_shed(local.retries.counts(now_s), window.counts(now_s), self._cfg)
        inflight = local.inflight
        # KV·seconds fails closed: a conservative share of the cap, counted in-process.
        cap = q.kv_cap_milli * self._cfg.local_kv_fraction if q.kv_cap_milli else 0
        kv_ok = not cap or inflight == 0 or inflight + q.est_kv_milli <= cap
        shed = scope is not None
        # The long-context budget fails closed like KV·seconds: this process may hold
        # ``local_kv_fraction`` of it (one request at a time when that is less than one).
        long_clause = None
        if q.long is not None and kv_ok and not shed:
            long_clause = self._long_full_locally(q)
        long_full = long_clause is not None
        # Per-key limits: a key's concurrency cap fails closed like KV·seconds (its share of
        # the cap, at least one request, counted in this process); its rates fail open.
        key_full = False
        if q.key_id and q.key_concurrency and kv_ok and not shed and not long_full:
            held_k = self._local_keys.get((q.key_id, q.family), ())
            key_full = len(held_k) >= max(1, int(q.key_concurrency * self._cfg.local_kv_fraction))
        admitted = kv_ok and not shed and not long_full and not key_full
        self._stats.fail_closed(admitted)
        grant = None
        if admitted:
            window.record(now_s, flagged=q.is_retry)
            local.retries.record(now_s, flagged=q.is_retry)
            local.leases[lease_id] = q.est_kv_milli
            self._hold_key(q, lease_id)
            grant = Grant.of(q, lease_id, local=True)
            if q.long is not None:
                self._hold_long_locally(q, lease_id)
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
        frees = int(self._cfg.lease_ttl_s * 1000) if not kv_ok or long_full or key_full else 0
        return QuotaDecision(
            admitted=admitted,
            layer="concurrency" if key_full else None if kv_ok else "kv_seconds",
            retry_storm=kv_ok and shed,
            retry_scope=(scope or "") if kv_ok else "",
            frees_in_ms=frees,
            state=state,
            inflight_kv_milli=inflight,
            grant=grant,
            degraded=True,
            long_context_full=long_full,
            long_context_clause=long_clause,
            key_limited=key_full,
            key_inflight=len(self._local_keys.get((q.key_id, q.family), ())),
        )

    async def charge_request(
        self, tenant_id: str, family: str, rpm: int, *, key_id: str = "", key_rpm: int = 0
    ) -> QuotaDecision:
        """Take one request of requests/min, the tenant's and (with ``key_id`` and
        ``key_rpm``) its API key's, and nothing else: the cost of an idempotent replay (a
        stored response: no tokens generated, no KV held). Refused like an admission on
        that layer; with the store unavailable it fails open, as admission's requests/min
        does (§8)."""
        node = self._node_of(tenant_id, family)
        keys: list[Arg] = []
        args: list[Arg] = []
        if rpm > 0:
            keys, args = [f"{tenant_tag(tenant_id, family)}:b"], [rpm, 1]
        if key_id and key_rpm > 0:
            keys.append(key_tag(tenant_id, family, key_id))
            args += [key_rpm, 11]
        if keys and self._redis_usable(node):
            try:
                res = await self._eval(self._request_only_lua, keys, args)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                self._mark(False, exc, node)
            else:
                self._mark(True, node=node)
                ok, wait, remaining, reset, which = (int(x) for x in res)
                # The tenant's state when its bucket was charged (the key's alone otherwise).
                state = RateLimitState(rpm, remaining, reset, 0, 0, 0) if rpm > 0 else None
                return QuotaDecision(
                    admitted=bool(ok),
                    layer=None if ok else "requests",
                    retry_storm=False,
                    frees_in_ms=wait,
                    state=state or RateLimitState(0, 0, 0, 0, 0, 0),
                    inflight_kv_milli=0,
                    grant=None,
                    degraded=False,
                    key_limited=which == 11,
                    key_state=RateLimitState(key_rpm, 0, reset, 0, 0, 0) if which == 11 else None,
                )
        now_ms = int(time.time() * 1000)
        level = self._local_for(tenant_id, family, rpm, 0).rpm.take(1, now_ms) if rpm else 0.0
        if rpm and level < 0:
            self._stats.fail_open("requests")
        reset = bucket_reset_ms(level, rpm) if rpm else 0
        return QuotaDecision(
            admitted=True,
            layer=None,
            retry_storm=False,
            frees_in_ms=0,
            state=RateLimitState(rpm, int(max(level, 0)), reset, 0, 0, 0),
            inflight_kv_milli=0,
            grant=None,
            degraded=bool(keys),
        )

    # -- settle ------------------------------------------------------------------------
    async def settle(self, grant: Grant, *, actual_tokens: int, refund_request: bool) -> bool:
        """Release the lease and reconcile tokens, once. Never raises; True if Redis
        released a live lease (False: local grant, already settled, reclaimed, or down)."""
        if grant.settled:
            return False
        grant.settled = True
        if grant.long_tag is not None:
            held = self._local_long.get(grant.long_tag)
            if held is not None:
                held.pop(grant.lease_id, None)
            self._local_prefill.get(grant.long_tag, {}).pop(grant.lease_id, None)
        entry = self._local.get((grant.tenant_id, grant.family))
        if entry is not None:
            entry.leases.pop(grant.lease_id, None)
            if grant.local:
                now_ms = int(time.time() * 1000)
                if grant.tpm:
                    entry.tpm.give(grant.est_tokens - actual_tokens, now_ms)
                if refund_request and grant.rpm:
                    entry.rpm.give(1, now_ms)
        if grant.key_id:  # per-key limits: this process's count of the key's requests
            held_k = self._local_keys.get((grant.key_id, grant.family))
            if held_k is not None:
                held_k.discard(grant.lease_id)
                if not held_k:
                    del self._local_keys[(grant.key_id, grant.family)]
        node = self._node_of(grant.tenant_id, grant.family)
        if grant.local or not self._redis_usable(node):
            return False
        tag = tenant_tag(grant.tenant_id, grant.family)
        keys: tuple[str, ...] = (f"{tag}:b", f"{tag}:l", f"{tag}:e")
        cluster_long = self._cluster and grant.long_tag is not None
        if grant.long_tag is not None and not cluster_long:
            keys += (f"{grant.long_tag}:l", f"{grant.long_tag}:e", f"{grant.long_tag}:w")
        args: tuple[Arg, ...] = (
            grant.lease_id,
            grant.est_tokens,
            actual_tokens,
            int(refund_request),
            grant.rpm,
            grant.tpm,
        )
        if grant.key_id and (grant.key_rpm or grant.key_tpm):
            # Per-key limits: the key's bucket, reconciled alike (its in-flight slot is
            # released by the lease itself, which names the key).
            keys += (key_tag(grant.tenant_id, grant.family, grant.key_id),)
            args += ("key", grant.key_rpm, grant.key_tpm)
        try:
            if cluster_long:  # the ledger's lease is in another slot: released beside it
                released, _ = await asyncio.gather(
                    self._eval(self._settle_lua, keys, args),
                    self._release_long(grant, refund_request),
                )
            else:
                released = await self._eval(self._settle_lua, keys, args)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            # The lease expires on its own within lease_ttl_s; tokens stay charged at the
            # estimate (pessimistic, and billing counts the actual anyway).
            self._mark(False, exc, node)
            return False
        except RedisError:
            log.exception("settle failed for lease %s", grant.lease_id)
            return False
        self._mark(True, node=node)
        return bool(released)

    # -- first token -------------------------------------------------------------------
    async def prefill_done(self, grant: Grant) -> bool:
        """A long-context request's first token arrived: release its prefill slot now (one
        round trip to the ledger, 'prefilled' in ``LONG_CONTEXT_LUA``); its KV stays held
        until ``settle``. Never raises; True when the ledger released a slot. A lease
        claimed in this process (no store) releases its local slot; without the store the
        ledger's slot lapses at its safety expiry (``LongContextAsk.prefill_hold_ms``)."""
        tag = grant.long_tag
        if tag is None or grant.settled:
            return False
        self._local_prefill.get(tag, {}).pop(grant.lease_id, None)
        return bool(await self._on_ledger(grant, "prefilled"))

    # -- where long contexts run (long_prefill_placement) ------------------------------
    async def placed(self, grant: Grant, replica_id: str) -> bool:
        """A long-context request was dispatched to ``replica_id``: record it on its lease
        in the ledger (``:r``, 'placed' in ``LONG_CONTEXT_LUA``; one write, long contexts
        only), for every gateway process's ``placements``. Never raises; True when
        recorded (the lease still lives in the store)."""
        if grant.long_tag is None or grant.settled:
            return False
        return bool(await self._on_ledger(grant, "placed", replica_id))

    async def placements(self, version: str) -> Placements | None:
        """The ledger's KV in flight and, per replica, what the leases recorded there
        (``placed``) hold: their KV, their long prefills running (no first token yet) and
        of them the very long ones. None when the ledger's node cannot be read."""
        res = await self._ledger_eval(version, ("placements", ""), "placements read")
        if res is None:
            return None
        by: dict[str, tuple[int, int, int]] = {}
        for i in range(1, len(res) - 3, 4):
            rep = res[i].decode() if isinstance(res[i], bytes) else str(res[i])
            by[rep] = (int(res[i + 1]), int(res[i + 2]), int(res[i + 3]))
        return Placements(int(res[0]), by)

    # -- renew -------------------------------------------------------------------------
    async def renew(self, grants: Sequence[Grant]) -> tuple[int, int]:
        """Extend every live Redis lease of this process in ONE pipelined round trip.

        Returns (renewed, lost); a lost lease was reclaimed while we could not renew it
        (docs/design.md R4's partition caveat: over-admits by this gateway's share, bounded)."""
        # (key tag, lease id) per lease: the tenant's, and its long-context lease's (on a
        # cluster in the ledger's own slot and maybe on another node)
        by_node: dict[Node, list[tuple[str, str]]] = {}
        for g in grants:
            if g.local or g.settled:
                continue
            tag = tenant_tag(g.tenant_id, g.family)
            by_node.setdefault(self._node_of(g.tenant_id, g.family), []).append((tag, g.lease_id))
            if g.long_tag is not None and not g.long_local:
                node = self._ledger_node(g.version) if self._cluster else None
                by_node.setdefault(node, []).append((g.long_tag, g.lease_id))
        usable = {n: ls for n, ls in by_node.items() if self._redis_usable(n)}
        if not usable:
            return 0, 0
        outcomes = await asyncio.gather(*(self._renew_node(n, ls) for n, ls in usable.items()))
        renewed = sum(r for r, _ in outcomes)
        lost = sum(lost for _, lost in outcomes)
        if lost:
            self._stats.leases_lost(lost)
            log.warning("%d in-flight leases were reclaimed before renewal", lost)
        return renewed, lost

    async def _renew_node(self, node: Node, leases: list[tuple[str, str]]) -> tuple[int, int]:
        """One store node's leases: one pipelined round trip."""
        lease_ms = int(self._cfg.lease_ttl_s * 1000)
        groups = [leases]
        if self._cluster:
            # One call's keys must share a slot (module doc): chunk per slot.
            by_slot: dict[int, list[tuple[str, str]]] = {}
            for lease in leases:
                by_slot.setdefault(slot_of(lease[0]), []).append(lease)
            groups = list(by_slot.values())
        calls: list[tuple[list[str], list[Arg]]] = []
        for group in groups:
            for i in range(0, len(group), RENEW_CHUNK):
                keys: list[str] = []
                ids: list[Arg] = []
                for tag, lease_id in group[i : i + RENEW_CHUNK]:
                    keys += [f"{tag}:e", f"{tag}:l"]
                    ids.append(lease_id)
                calls.append((keys, [lease_ms, *ids]))
        try:
            try:
                results = await self._channel.evalsha_many(self._renew_lua, calls)
            except ResponseError as exc:
                raise store_refusal(exc) or exc from exc
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            self._mark(False, exc, node)
            return 0, 0
        self._mark(True, node=node)
        return sum(int(r[0]) for r in results), sum(int(r[1]) for r in results)
