"""Which clause of the long-context budget refused an ask (``LongContextClause``): each one
produced by a ledger built for it, reported the same by the admit script (through the
``Limiter``), by the ledger's own script (``LONG_CONTEXT_LUA``, what a Redis Cluster runs),
by the pure rule (``long_context_refusal``), and by the local fallback for its share.
The property tests of test_long_context_budget.py and test_long_context_tiers.py check the
script's clause against the pure rule's decision by decision (``_admits_as_the_rule``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.admission import long_context
from gateway.admission.config import AdmissionConfig
from gateway.admission.long_context import LongContextClause as C
from gateway.admission.quota import (
    LEDGER_LUA,
    LONG_CONTEXT_LUA,
    RECLAIM_PER_ADMIT,
    Limiter,
    QuotaDecision,
    QuotaRequest,
    long_context_tag,
)
from gateway.redis_client import connect
from tests.admission.test_long_context_budget import GIB
from tests.admission.test_long_context_tiers import tq

TAG = long_context_tag("fam-v1")
HOLD = 600_000  # every prefill here runs past the test


def ask(tenant: str, gib: int, *, slots: int = 100, lane: int = 0, very_long: bool = True,
        prefill_ms: int = HOLD) -> QuotaRequest:  # fmt: skip
    return tq(tenant, very_long=very_long, slots=slots, lane=lane, gib=gib,
              prefill_ms=prefill_ms, hold_ms=HOLD)  # fmt: skip


async def admitted(lim: Limiter, req: QuotaRequest) -> QuotaDecision:
    d = await lim.admit(req)
    assert d.admitted and d.long_context_clause is None, d
    return d


async def refused(lim: Limiter, req: QuotaRequest) -> C | None:
    d = await lim.admit(req)
    assert not d.admitted and d.long_context_full, d
    return d.long_context_clause


async def ledger_clause(aredis: aioredis.Redis, req: QuotaRequest) -> C | None:
    """The same ask through ``LONG_CONTEXT_LUA``'s claim (refused: its 5th value)."""
    a = req.long
    assert a is not None
    args = ("claim", "lease-x", req.tenant_id, a.kv_bytes, a.budget_bytes, a.prefill_slots,
            a.prefill_ms, a.demand_window_ms, 600_000, req.expected_ms, RECLAIM_PER_ADMIT,
            a.hold_ms, a.lane_slots, int(a.very_long), a.prefill_beside_ms)  # fmt: skip
    res = await aredis.eval(LONG_CONTEXT_LUA, 3, f"{TAG}:l", f"{TAG}:e", f"{TAG}:w", *args)
    assert int(res[0]) == 0, res
    return C(int(res[4]))


@pytest.fixture
async def lim(aredis: aioredis.Redis) -> Limiter:
    await aredis.delete(*(f"{TAG}:{s}" for s in "lew"))
    return Limiter(aredis, AdmissionConfig())


async def both(aredis: aioredis.Redis, lim: Limiter, req: QuotaRequest) -> tuple[C | None, ...]:
    """The ask's clause from the ledger's script, then from the admit script."""
    return await ledger_clause(aredis, req), await refused(lim, req)


async def test_kv_full(aredis: aioredis.Redis, lim: Limiter) -> None:
    await admitted(lim, ask("a", 95))
    assert await both(aredis, lim, ask("b", 10)) == (C.KV_FULL, C.KV_FULL)


async def test_slots_full_the_lane_too(aredis: aioredis.Redis, lim: Limiter) -> None:
    """One very long slot and the lane, both running: a shorter ask finds no slot."""
    await admitted(lim, ask("a", 1, slots=1, lane=1, very_long=True))
    await admitted(lim, ask("b", 1, slots=1, lane=1, very_long=False))
    shorter = ask("c", 1, slots=1, lane=1, very_long=False)
    assert await both(aredis, lim, shorter) == (C.SLOTS_FULL, C.SLOTS_FULL)


async def test_long_slots_full_while_the_lane_is_free(aredis: aioredis.Redis, lim: Limiter) -> None:
    await admitted(lim, ask("a", 1, slots=1, lane=1, very_long=True))
    very_long = ask("b", 1, slots=1, lane=1, very_long=True)
    assert await both(aredis, lim, very_long) == (C.LONG_SLOTS_FULL, C.LONG_SLOTS_FULL)
    # a shorter one takes the lane
    await admitted(lim, ask("b", 1, slots=1, lane=1, very_long=False))


async def test_kv_full_for_the_whole_context_budget(aredis: aioredis.Redis, lim: Limiter) -> None:
    """``long_context_fit``: the ask carries the budget its own size is judged against
    (``fit_budget``, here 2 designated replicas: 100 GiB less one ask and a byte), and both
    scripts and the pure rule refuse the fourth 20 GiB ask, which the whole pool would
    admit, for the budget's KV."""

    def fit(tenant: str) -> QuotaRequest:
        req = ask(tenant, 20)
        assert req.long is not None
        budget = long_context.fit_budget(req.long.budget_bytes, req.long.kv_bytes, 2)
        return replace(req, long=replace(req.long, budget_bytes=budget))

    for t in "abc":
        await admitted(lim, fit(t))
    d = fit("d")
    assert d.long is not None
    assert long_context.long_context_refusal(
        tenant="d", need=20 * GIB, budget=d.long.budget_bytes, slots=100,
        usage={t: 20 * GIB for t in "abc"}, prefilling=3, waiting=set(),
    ) == C.KV_FULL  # fmt: skip
    assert await both(aredis, lim, d) == (C.KV_FULL, C.KV_FULL)
    await admitted(lim, ask("d", 20))  # the pool's budget: 80 of 100 GiB


async def test_yield_slot_to_a_waiter_ahead(aredis: aioredis.Redis, lim: Limiter) -> None:
    """w was refused while both slots ran; one ends; a (served before, and w never) would
    take the last slot w is due back for."""
    await admitted(lim, ask("a", 1, slots=2))
    c = await admitted(lim, ask("c", 1, slots=2))
    assert await refused(lim, ask("w", 1, slots=2)) == C.SLOTS_FULL
    assert c.grant is not None
    await lim.settle(c.grant, actual_tokens=0, refund_request=False)
    assert await both(aredis, lim, ask("a", 1, slots=2)) == (C.YIELD_SLOT, C.YIELD_SLOT)


async def test_yield_kv_to_a_waiter_ahead(aredis: aioredis.Redis, lim: Limiter) -> None:
    await admitted(lim, ask("a", 50))
    b = await admitted(lim, ask("b", 45))
    assert await refused(lim, ask("w", 10)) == C.KV_FULL
    assert b.grant is not None
    await lim.settle(b.grant, actual_tokens=0, refund_request=False)
    # 30 GiB would leave 20 GiB, less than one request of its size for w
    assert await both(aredis, lim, ask("a", 30)) == (C.YIELD_KV, C.YIELD_KV)
    await admitted(lim, ask("w", 10))


async def test_slot_share(aredis: aioredis.Redis, lim: Limiter) -> None:
    """w runs a prefill and waits (holding more KV than a, so not ahead of it): a already
    runs one of the three slots, its max-min share with w wanting more is 1.5."""
    await admitted(lim, ask("a", 1, slots=3))
    await admitted(lim, ask("w", 20, slots=3))
    assert await refused(lim, ask("w", 90, slots=3)) == C.KV_FULL
    assert await both(aredis, lim, ask("a", 1, slots=3)) == (C.SLOT_SHARE, C.SLOT_SHARE)


async def test_long_slot_share(aredis: aioredis.Redis, lim: Limiter) -> None:
    """Two very long slots and two lane slots: a runs one very long prefill, w (not ahead:
    it holds more) waits for a very long one; a's share of all four slots allows a second,
    its share of the very long ones (one each) does not."""
    tiers = {"slots": 2, "lane": 2}
    await admitted(lim, ask("a", 1, very_long=True, **tiers))
    await admitted(lim, ask("w", 20, very_long=False, **tiers))
    assert await refused(lim, ask("w", 90, very_long=True, **tiers)) == C.KV_FULL
    again = ask("a", 1, very_long=True, **tiers)
    assert await both(aredis, lim, again) == (C.LONG_SLOT_SHARE, C.LONG_SLOT_SHARE)


async def test_kv_share(aredis: aioredis.Redis, lim: Limiter) -> None:
    await admitted(lim, ask("a", 60))
    assert await refused(lim, ask("w", 50)) == C.KV_FULL
    # w waits: a's fair level is half the budget
    assert await both(aredis, lim, ask("a", 10)) == (C.KV_SHARE, C.KV_SHARE)


def test_the_pure_rule_names_each_clause() -> None:
    """``long_context_refusal`` on ledgers like the ones above (its parity with the script,
    clause included, is property-tested in test_long_context_budget.py and
    test_long_context_tiers.py)."""
    base: dict[str, Any] = {
        "need": GIB,
        "budget": 100 * GIB,
        "slots": 1,
        "waiting": set(),
        "prefilling": 0,
    }
    rule = long_context.long_context_refusal
    assert rule(tenant="b", **{**base, "need": 10 * GIB}, usage={"a": 95 * GIB}) == C.KV_FULL
    assert rule(tenant="c", **{**base, "prefilling": 2}, usage={"a": GIB, "b": GIB},
                lane_slots=1, long_prefilling=1, very_long=False) == C.SLOTS_FULL  # fmt: skip
    assert rule(tenant="b", **{**base, "prefilling": 1}, usage={"a": GIB}, lane_slots=1,
                long_prefilling=1) == C.LONG_SLOTS_FULL  # fmt: skip
    two: dict[str, Any] = {
        **base,
        "slots": 2,
        "prefilling": 1,
        "waiting": {"w"},
        "usage": {"a": GIB},
    }
    assert rule(tenant="a", **two, served={"a": 5}) == C.YIELD_SLOT
    kv: dict[str, Any] = {**base, "slots": 100, "waiting": {"w"}, "usage": {"a": 50 * GIB}}
    assert rule(tenant="a", **{**kv, "need": 30 * GIB}, served={"a": 5}) == C.YIELD_KV
    three: dict[str, Any] = {**base, "slots": 3, "prefilling": 2, "waiting": {"w"}}
    assert rule(tenant="a", **three, usage={"a": GIB, "w": 20 * GIB},
                prefills={"a": 1, "w": 1}) == C.SLOT_SHARE  # fmt: skip
    assert rule(tenant="a", **{**three, "slots": 2}, usage={"a": GIB, "w": 20 * GIB},
                lane_slots=2, prefills={"a": 1, "w": 1}, long_prefilling=1,
                long_prefills={"a": 1}) == C.LONG_SLOT_SHARE  # fmt: skip
    assert rule(tenant="a", **{**kv, "need": 10 * GIB, "usage": {"a": 60 * GIB}},
                served={"a": 5, "w": 1}) == C.KV_SHARE  # fmt: skip
    assert rule(tenant="a", **base, usage={}) is None


def test_the_script_numbers_are_the_enum() -> None:
    """The Lua locals are made from the enum (one definition), the labels are stable."""
    for c in C:
        assert f"local LC_{c.name} = {c.value}\n" in LEDGER_LUA
    assert [c.label for c in C] == [
        "kv_full", "slots_full", "long_slots_full", "yield_slot", "yield_kv", "slot_share",
        "long_slot_share", "kv_share",
    ]  # fmt: skip


async def test_the_local_fallback_reports_its_clauses() -> None:
    """Without the store this process holds ``local_kv_fraction`` of the budget and its
    slots: refused for its share of the KV (KV_FULL) or of the slots (SLOTS_FULL)."""
    dead = connect("redis://127.0.0.1:1/0", timeout_s=0.2)
    lim = Limiter(dead, AdmissionConfig(local_kv_fraction=0.25))
    await admitted(lim, ask("a", 20, slots=4))
    kv = await lim.admit(ask("b", 10, slots=4))  # 30 GiB > 25 GiB
    assert kv.degraded and not kv.admitted and kv.long_context_clause == C.KV_FULL
    slot = await lim.admit(ask("b", 1, slots=4))  # one slot of four, a holds it
    assert slot.degraded and not slot.admitted and slot.long_context_clause == C.SLOTS_FULL
    await dead.aclose()
