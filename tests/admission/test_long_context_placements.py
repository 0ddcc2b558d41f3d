"""Where each long context runs, in the fleet's long-context ledger (gateway/admission/quota.py,
``Limiter.placed`` and ``Limiter.placements``, under ``long_prefill_placement``) against a real
Redis: the replica a lease's request was dispatched to, read back per replica by every gateway
process as the leases' KV, their long prefills running and of them the very long ones; a
first token ends a prefill, a settled lease leaves the record."""

from __future__ import annotations

from dataclasses import replace

import redis.asyncio as aioredis

from gateway.admission.config import AdmissionConfig
from gateway.admission.quota import Limiter, long_context_tag
from tests.admission.test_long_context_budget import GIB, q

VERSION = "fam-v1"  # the version of test_long_context_budget's requests


async def test_placements_per_replica_follow_dispatch_first_token_and_settle(
    aredis: aioredis.Redis,
) -> None:
    tag = long_context_tag(VERSION)
    await aredis.delete(*(f"{tag}:{s}" for s in "lewr"))
    lim, other = Limiter(aredis, AdmissionConfig()), Limiter(aredis, AdmissionConfig())
    hold = {"prefill_slots": 10, "prefill_ms": 60_000, "hold_ms": 600_000}
    a = await lim.admit(q("a", gib=1, **hold))
    shorter = q("b", gib=2, **hold)
    assert shorter.long is not None
    b = await lim.admit(replace(shorter, long=replace(shorter.long, very_long=False)))
    c = await other.admit(q("c", gib=4, **hold))
    unplaced = await other.admit(q("d", gib=8, **hold))
    assert all(d.admitted and d.grant is not None for d in (a, b, c, unplaced))
    assert a.grant and b.grant and c.grant
    assert await lim.placed(a.grant, "r1") and await lim.placed(b.grant, "r1")
    assert await other.placed(c.grant, "r2")
    # every process reads what all of them placed; the unplaced lease counts in the total only
    for limiter in (lim, other):
        got = await limiter.placements(VERSION)
        assert got is not None
        assert got.inflight_bytes == 15 * GIB
        assert got.by_replica == {"r1": (3 * GIB, 2, 1), "r2": (4 * GIB, 1, 1)}
    assert await lim.prefill_done(a.grant)  # a's first token: its KV stays, its prefill ends
    got = await other.placements(VERSION)
    assert got is not None and got.by_replica["r1"] == (3 * GIB, 1, 0)
    await lim.settle(b.grant, actual_tokens=0, refund_request=False)
    got = await other.placements(VERSION)
    assert got is not None and got.by_replica == {"r1": (1 * GIB, 0, 0), "r2": (4 * GIB, 1, 1)}
    assert await aredis.hget(f"{tag}:r", b.grant.lease_id) is None  # dropped by the read
    assert not await lim.placed(b.grant, "r3")  # settled: nothing to record
    assert await aredis.pttl(f"{tag}:r") > 0  # expires with the ledger
