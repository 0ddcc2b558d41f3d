"""The retry budget is kept per tenant, with the fleet's as a second line: one tenant's
retries (its failing traffic retried) spend its own budget, never every other tenant's.
Which requests are retries: tests/hardening/test_retry_identity.py. The admit script
against a real Redis, checked against the pure rule, and the same rule when the store is
unreachable."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import redis.asyncio as aioredis

from gateway.admission.config import AdmissionConfig
from gateway.admission.quota import Limiter, QuotaRequest
from gateway.admission.retry import retry_shed
from gateway.redis_client import connect

BASE = QuotaRequest(
    "r",
    "t-a",
    "fam",
    "fam-v1",
    rpm=0,
    tpm=0,
    est_tokens=1,
    est_kv_milli=1,
    kv_cap_milli=0,
    expected_ms=1000,
    is_retry=False,
    retry_exempt=False,
)


def q(tenant: str, *, retry: bool = False) -> QuotaRequest:
    return replace(BASE, tenant_id=tenant, is_retry=retry)


async def _one_tenant_floods_retries(lim: Limiter) -> None:
    for _ in range(30):
        assert (await lim.admit(q("t-b"))).admitted
    for _ in range(20):
        assert (await lim.admit(q("t-a"))).admitted
    flood = [await lim.admit(q("t-a", retry=True)) for _ in range(100)]
    # t-a's retries stop at 20 % of its own admissions: 6 of them (6 > 0.2 x 26 sheds).
    assert sum(d.admitted for d in flood) == 6
    assert {d.retry_scope for d in flood if not d.admitted} == {"tenant"}
    assert all(d.retry_storm for d in flood if not d.admitted)
    # t-b's retries, within its own budget, all pass: t-a spent only its own.
    others = [await lim.admit(q("t-b", retry=True)) for _ in range(6)]
    assert all(d.admitted for d in others), [(d.retry_scope, d.degraded) for d in others]
    # And t-a's first attempts are never shed.
    assert (await lim.admit(q("t-a"))).admitted


async def test_one_tenants_retries_do_not_spend_the_fleets_budget(aredis: aioredis.Redis) -> None:
    await _one_tenant_floods_retries(Limiter(aredis, AdmissionConfig()))


async def test_the_same_holds_when_the_store_is_unreachable() -> None:
    dead = connect("redis://127.0.0.1:1/0", timeout_s=0.2)
    await _one_tenant_floods_retries(Limiter(dead, AdmissionConfig()))
    await dead.aclose()


async def test_the_fleet_budget_is_the_second_line_for_many_small_tenants(
    aredis: aioredis.Redis,
) -> None:
    lim = Limiter(aredis, AdmissionConfig())
    for _ in range(40):
        assert (await lim.admit(q("t-big"))).admitted
    # Twenty small tenants, under the per-tenant minimum volume, retry a lot: each one's
    # own budget cannot judge them, the fleet's does.
    shed = Counter[str]()
    for i in range(20):
        for _ in range(3):
            d = await lim.admit(q(f"t-small-{i}", retry=True))
            if not d.admitted:
                shed[d.retry_scope] += 1
    assert shed["fleet"] > 0 and shed["tenant"] == 0
    # A tenant within its own budget still retries during the storm.
    assert (await lim.admit(q("t-big", retry=True))).admitted


async def test_the_admit_script_follows_the_pure_rule(aredis: aioredis.Redis) -> None:
    cfg = AdmissionConfig()
    lim = Limiter(aredis, cfg)
    rng = random.Random(13)
    tenants: dict[str, tuple[int, int]] = {}
    fleet = (0, 0)
    for step in range(400):
        tenant = rng.choice(["t-1", "t-2", "t-3", f"t-rare-{step % 40}"])
        retry = rng.random() < 0.35
        counts = tenants.get(tenant, (0, 0))
        expected = retry_shed(counts, fleet, cfg) if retry else None
        d = await lim.admit(q(tenant, retry=retry))
        assert d.admitted is (expected is None), (step, tenant, counts, fleet)
        assert d.retry_scope == (expected or "")
        if d.admitted:
            tenants[tenant] = (counts[0] + 1, counts[1] + int(retry))
            fleet = (fleet[0] + 1, fleet[1] + int(retry))
