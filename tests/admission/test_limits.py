"""The Redis scripts of gateway/limits.py against a real Redis."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from dataclasses import replace

import pytest
import redis
import redis.asyncio as aioredis

from gateway import policy
from gateway.limits import Limiter, QuotaRequest, connect, tenant_tag
from gateway.policy import AdmissionConfig
from tests.admission.hammer import Record, Scenario, hammer

BASE = QuotaRequest(
    "r",
    "t1",
    "fam",
    "fam-v1",
    rpm=0,
    tpm=0,
    est_tokens=100,
    est_kv_milli=1000,
    kv_cap_milli=0,
    expected_ms=1000,
    is_retry=False,
    retry_exempt=False,
)


def q(**kw: object) -> QuotaRequest:
    return replace(BASE, **kw)  # type: ignore[arg-type]


async def test_requests_limit_refuses_the_next_request_and_says_when(
    aredis: aioredis.Redis,
) -> None:
    lim = Limiter(aredis, AdmissionConfig())
    seen = [await lim.admit(q(rpm=3)) for _ in range(4)]
    assert [d.admitted for d in seen] == [True, True, True, False]
    assert [d.state.remaining_requests for d in seen[:3]] == [2, 1, 0]
    refused = seen[3]
    assert refused.layer == "requests" and not refused.retry_storm
    # one request refills in 60 s / 3 = 20 s
    assert 19_000 <= refused.frees_in_ms <= 20_000
    assert refused.state.reset_requests_ms == pytest.approx(60_000, abs=1000)


async def test_tokens_charge_estimate_then_refund_unused_at_settle(aredis: aioredis.Redis) -> None:
    lim = Limiter(aredis, AdmissionConfig())
    first = await lim.admit(q(tpm=10_000, est_tokens=4_000))
    assert first.state.remaining_tokens == 6_000
    second = await lim.admit(q(tpm=10_000, est_tokens=4_000))
    assert second.state.remaining_tokens == pytest.approx(2_000, abs=5)
    assert first.grant is not None and second.grant is not None
    # asked for 4,000, used 90 -> 3,910 back at once
    assert await lim.settle(first.grant, actual_tokens=90, refund_request=False)
    third = await lim.admit(q(tpm=10_000, est_tokens=100))
    assert third.state.remaining_tokens == pytest.approx(2_000 + 3_910 - 100, abs=10)
    # settle is idempotent: a second call changes nothing
    assert not await lim.settle(first.grant, actual_tokens=90, refund_request=False)
    fourth = await lim.admit(q(tpm=10_000, est_tokens=100))
    assert fourth.state.remaining_tokens == pytest.approx(
        third.state.remaining_tokens - 100, abs=10
    )


async def test_tokens_admit_while_positive_then_refuse_until_repaid(aredis: aioredis.Redis) -> None:
    lim = Limiter(aredis, AdmissionConfig())
    big = await lim.admit(q(tpm=6_000, est_tokens=5_000))
    over = await lim.admit(q(tpm=6_000, est_tokens=5_000))  # 1,000 left: admitted, debt
    assert big.admitted and over.admitted and over.state.remaining_tokens == 0
    refused = await lim.admit(q(tpm=6_000, est_tokens=1))
    assert not refused.admitted and refused.layer == "tokens"
    # 4,000 of debt at 100 tokens/s: frees in ~40 s
    assert refused.frees_in_ms == pytest.approx(40_000, abs=500)


async def test_rejected_request_is_refunded_entirely(aredis: aioredis.Redis) -> None:
    lim = Limiter(aredis, AdmissionConfig())
    d = await lim.admit(q(rpm=2, tpm=1000, est_tokens=500, kv_cap_milli=1500))
    assert d.grant is not None
    await lim.settle(d.grant, actual_tokens=0, refund_request=True)
    again = await lim.admit(q(rpm=2, tpm=1000, est_tokens=500, kv_cap_milli=1500))
    assert again.state.remaining_requests == 1 and again.state.remaining_tokens >= 499
    assert again.inflight_kv_milli == 0


async def test_kv_cap_is_strict_except_for_a_lone_oversized_request(aredis: aioredis.Redis) -> None:
    lim = Limiter(aredis, AdmissionConfig())
    a = await lim.admit(q(kv_cap_milli=2500, est_kv_milli=1000, expected_ms=3000))
    b = await lim.admit(q(kv_cap_milli=2500, est_kv_milli=1000, expected_ms=8000))
    c = await lim.admit(q(kv_cap_milli=2500, est_kv_milli=1000))
    assert a.admitted and b.admitted and not c.admitted
    assert c.layer == "kv_seconds" and c.inflight_kv_milli == 2000
    # frees when the first lease is expected to end (~3 s), not at the lease deadline
    assert 2_000 <= c.frees_in_ms <= 3_000
    assert a.grant and b.grant
    await lim.settle(a.grant, actual_tokens=0, refund_request=False)
    await lim.settle(b.grant, actual_tokens=0, refund_request=False)
    alone = await lim.admit(q(kv_cap_milli=2500, est_kv_milli=9000))
    assert alone.admitted  # bigger than the cap, but alone: it could otherwise never run
    assert not (await lim.admit(q(kv_cap_milli=2500, est_kv_milli=1))).admitted


async def test_unrenewed_leases_are_reclaimed_and_renewed_ones_are_not(
    aredis: aioredis.Redis,
) -> None:
    cfg = AdmissionConfig(lease_ttl_s=1.0, lease_renew_s=0.3)
    lim = Limiter(aredis, cfg)
    kept = await lim.admit(q(tenant_id="keep", kv_cap_milli=1000))
    dead = await lim.admit(q(tenant_id="crash", kv_cap_milli=1000))
    assert kept.grant and dead.grant
    deadline = time.monotonic() + 1.6
    while time.monotonic() < deadline:  # only "keep" is renewed, as a live gateway does
        assert await lim.renew([kept.grant]) == (1, 0)
        await asyncio.sleep(0.3)
    crash_retry = await lim.admit(q(tenant_id="crash", kv_cap_milli=1000))
    assert crash_retry.admitted and crash_retry.inflight_kv_milli == 0
    keep_retry = await lim.admit(q(tenant_id="keep", kv_cap_milli=1000))
    assert not keep_retry.admitted and keep_retry.inflight_kv_milli == 1000
    # the reclaimed lease is lost to its (late) owner, and never resurrected by renewal
    assert await lim.renew([dead.grant]) == (0, 1)
    assert not await lim.settle(dead.grant, actual_tokens=0, refund_request=False)


async def test_retry_budget_in_redis_matches_the_pure_rule(aredis: aioredis.Redis) -> None:
    cfg = AdmissionConfig()
    lim = Limiter(aredis, cfg)
    admitted = retries = 0
    for i in range(20):
        assert (await lim.admit(q(request_id=f"f{i}"))).admitted
        admitted += 1
    outcomes = []
    for i in range(12):
        expect_shed = policy.sheds_retry(
            True, "standard", policy.in_retry_storm(admitted, retries, cfg)
        )
        d = await lim.admit(q(request_id=f"r{i}", is_retry=True))
        assert d.retry_storm is expect_shed and d.admitted is not expect_shed
        assert d.layer is None
        if d.admitted:
            admitted, retries = admitted + 1, retries + 1
        outcomes.append(d.admitted)
    assert outcomes[:6] == [True] * 6 and not any(outcomes[6:])  # 6/26 > 20 % -> shed
    # reserved retries are never shed; first attempts are never shed
    assert (await lim.admit(q(request_id="x", is_retry=True, retry_exempt=True))).admitted
    assert (await lim.admit(q(request_id="y"))).admitted


async def test_every_key_is_namespaced_and_expires(aredis: aioredis.Redis) -> None:
    lim = Limiter(aredis, AdmissionConfig())
    d = await lim.admit(q(rpm=10, tpm=1000, kv_cap_milli=5000, is_retry=True))
    assert d.grant
    await lim.renew([d.grant])
    await lim.settle(d.grant, actual_tokens=10, refund_request=False)
    keys = await aredis.keys("*")
    assert keys and all(k.startswith(b"fw:rl:") for k in keys)
    for k in keys:
        ttl = await aredis.pttl(k)
        assert 0 < ttl <= 120_000, (k, ttl)


async def test_redis_unreachable_fails_open_for_rates_and_closed_for_kv() -> None:
    dead = connect("redis://127.0.0.1:1/0", timeout_s=0.2)
    events: list[tuple[str, object]] = []

    class Stats:
        def redis_up(self, up: bool) -> None:
            events.append(("up", up))

        def fail_open(self, layer: str) -> None:
            events.append(("open", layer))

        def fail_closed(self, admitted: bool) -> None:
            events.append(("closed", admitted))

        def leases_reclaimed(self, n: int) -> None:
            pass

        def leases_lost(self, n: int) -> None:
            pass

    lim = Limiter(dead, AdmissionConfig(local_kv_fraction=0.25), stats=Stats())
    # rpm 1 would refuse the second request: failing open, all five pass
    ds = [
        await lim.admit(q(rpm=1, tpm=100, est_tokens=100, kv_cap_milli=8000, est_kv_milli=1000))
        for _ in range(2)
    ]
    assert all(d.admitted and d.degraded for d in ds)
    assert ("up", False) in events and ("open", "requests") in events
    # KV fails closed at 25 % of 8000 = 2000 milli in this process
    third = await lim.admit(q(rpm=1, kv_cap_milli=8000, est_kv_milli=1000))
    assert not third.admitted and third.layer == "kv_seconds" and third.degraded
    assert ("closed", False) in events
    assert ds[0].grant is not None
    await lim.settle(ds[0].grant, actual_tokens=5, refund_request=False)
    assert (await lim.admit(q(kv_cap_milli=8000, est_kv_milli=1000))).admitted
    assert not lim.redis_up
    await dead.aclose()


# -- the overshoot proof: several processes, hundreds of concurrent clients ---------------


def _run_processes(scenarios: list[Scenario]) -> list[Record]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(len(scenarios)) as pool:
        parts = pool.map(hammer, scenarios, chunksize=1)
    return [r for part in parts for r in part]


def _scenarios(redis_url: str, **kw: object) -> list[Scenario]:
    base = Scenario(
        redis_url=redis_url,
        tenant="hammered",
        rpm=0,
        tpm=0,
        kv_cap=0,
        est_tokens=(1, 1),
        est_kv=(1, 1),
        hold_ms=None,
        clients=100,
        duration_s=2.0,
        seed=0,
    )
    return [replace(base, seed=i, **kw) for i in range(4)]  # type: ignore[arg-type]


@pytest.mark.slow
def test_overshoot_bounds_under_400_concurrent_clients_in_4_processes(
    redis_url: str, redis_sync: redis.Redis
) -> None:
    # requests/min: overshoot 0 beyond what the bucket refilled while the test ran
    # (figures are printed for the record: run with -s)
    recs = _run_processes(_scenarios(redis_url, tenant="rpm", rpm=300))
    ok = [r for r in recs if r[0]]
    assert len(recs) > 1000 and len(ok) < len(recs)
    t0, t1 = min(r[1] for r in ok), max(r[1] for r in ok)
    refill = 300 * (t1 - t0) / 60_000
    assert 300 <= len(ok) <= 300 + refill, (len(ok), refill)
    print(f"\nrpm: {len(recs)} attempts, {len(ok)} admitted, bound 300 + {refill:.2f} refill")

    # tokens/min: at most one request's estimate beyond capacity + refill
    redis_sync.flushdb()
    recs = _run_processes(_scenarios(redis_url, tenant="tpm", tpm=50_000, est_tokens=(100, 3000)))
    ok = [r for r in recs if r[0]]
    t0, t1 = min(r[1] for r in ok), max(r[1] for r in ok)
    charged = sum(r[2] for r in ok)
    bound = 50_000 + 50_000 * (t1 - t0) / 60_000
    assert charged >= 50_000  # it really ran the budget out
    assert charged < bound + max(r[2] for r in ok), (charged, bound)
    print(
        f"tpm: {len(recs)} attempts, {charged} tokens admitted, capacity+refill {bound:.0f},"
        f" overshoot {charged - bound:.0f} <= largest estimate {max(r[2] for r in ok)}"
    )

    # KV·seconds, held and released concurrently: never over the cap at admission
    redis_sync.flushdb()
    cap = 20_000
    recs = _run_processes(
        _scenarios(redis_url, tenant="kv", kv_cap=cap, est_kv=(500, 3000), hold_ms=(5, 60))
    )
    ok = [r for r in recs if r[0]]
    assert len(ok) > 100 and len(ok) < len(recs)
    assert all(r[4] == 0 or r[4] + r[3] <= cap for r in ok)
    peak = max(r[4] + r[3] for r in ok)
    print(
        f"kv (held+released): {len(recs)} attempts, {len(ok)} admitted, peak in-flight "
        f"{peak} <= cap {cap}"
    )
    # ... and after every release the ledger is exactly empty: no leak, no double count
    lease = redis_sync.hgetall(f"{tenant_tag('kv', 'fam')}:l")
    assert lease == {b"#": b"0"}
    assert redis_sync.zcard(f"{tenant_tag('kv', 'fam')}:e") == 0

    # KV·seconds held (never released): the sum admitted stays within the cap exactly
    redis_sync.flushdb()
    recs = _run_processes(
        _scenarios(redis_url, tenant="kvh", kv_cap=cap, est_kv=(500, 3000), duration_s=1.0)
    )
    ok = [r for r in recs if r[0]]
    assert sum(r[3] for r in ok) <= cap and len(ok) >= 6
    print(f"kv (held): {len(recs)} attempts, {sum(r[3] for r in ok)} admitted <= cap {cap}")
    assert int(redis_sync.hget(f"{tenant_tag('kvh', 'fam')}:l", "#") or 0) == sum(r[3] for r in ok)
