"""The long-context budget's two tiers (vLLM's ``--max-long-partial-prefills`` within
``--max-num-partial-prefills``): a very long prompt takes one of the long prefill slots, a
shorter long context may also take one of the lane's. The pure rule
(``long_context.long_context_admits`` with ``very_long``/``lane_slots``) property-tested, the
admit script checked against it decision by decision, and the noisy-neighbour case through
the ``Limiter``: a neighbour's moderately long prompt runs while a 128k prefill holds the long
slot."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from emulator.profiles import LLAMA_70B_TP4_H100
from gateway.admission import long_context
from gateway.admission.config import AdmissionConfig
from gateway.admission.estimates import attention_share, prefill_expected_seconds
from gateway.admission.quota import LEDGER_LUA, Grant, Limiter, QuotaRequest, long_context_tag
from gateway.redis_client import connect
from tests.admission.test_long_context_budget import (
    BUDGET,
    GIB,
    LONG,
    T0,
    TENANTS,
    _admits_as_the_rule,
    _store_ms,
    _text,
    ask_ops,
    lease,
    q,
    settle_after,
)

TAG = long_context_tag("fam-v1")


def tq(
    tenant: str, *, very_long: bool, slots: int = 1, lane: int = 1, beside: int = 0, **kw: int
) -> QuotaRequest:
    """``q`` with its tier: the budget's ``slots`` very long slots and ``lane`` more
    (``beside``: its expected prefill beside a very long one, ms)."""
    req = q(tenant, prefill_slots=slots, **kw)
    assert req.long is not None
    ask = replace(req.long, very_long=very_long, lane_slots=lane, prefill_beside_ms=beside)
    return replace(req, long=ask)


# -- the pure rule -------------------------------------------------------------------------


@st.composite
def tiered_ledgers(draw: st.DrawFn) -> dict:
    """A ledger with both tiers: ``slots`` very long slots and ``lane_slots`` more, each
    tenant's running prefills (of them its very long ones), the waiting tenants (of them
    those whose last ask was shorter) and the ask's tier."""
    usage = draw(st.dictionaries(st.sampled_from(TENANTS), st.integers(1, 30), max_size=6))
    slots, lane = draw(st.integers(1, 5)), draw(st.integers(0, 4))
    prefills = {t: draw(st.integers(0, 3)) for t in usage}
    prefills = {t: n for t, n in prefills.items() if n}
    long_prefills = {t: draw(st.integers(0, n)) for t, n in prefills.items()}
    long_prefills = {t: n for t, n in long_prefills.items() if n}
    assume(sum(prefills.values()) <= slots + lane and sum(long_prefills.values()) <= slots)
    waiting = draw(st.sets(st.sampled_from(TENANTS)))
    return {
        "tenant": draw(st.sampled_from(TENANTS)),
        "need": draw(st.integers(1, 40)),
        "budget": draw(st.integers(1, 300)),
        "slots": slots,
        "lane_slots": lane,
        "usage": usage,
        "prefilling": sum(prefills.values()),
        "long_prefilling": sum(long_prefills.values()),
        "waiting": waiting,
        "short_waiters": draw(st.sets(st.sampled_from(sorted(waiting)))) if waiting else set(),
        "served": draw(st.dictionaries(st.sampled_from(TENANTS), st.integers(0, 20))),
        "prefills": prefills,
        "long_prefills": long_prefills,
        "very_long": draw(st.booleans()),
    }


@settings(max_examples=300)
@given(tiered_ledgers())
def test_no_lane_is_the_one_tier_rule(ledger: dict) -> None:
    """No lane slots and nobody waiting for a shorter prompt: an ask's tier changes
    nothing, and the rule is the one-tier rule (every running prefill very long)."""
    ledger = {**ledger, "lane_slots": 0, "short_waiters": set()}
    ledger |= {"long_prefilling": ledger["prefilling"], "long_prefills": ledger["prefills"]}
    one_tier = {k: v for k, v in ledger.items() if k not in ("very_long", "lane_slots")}
    one_tier = {k: v for k, v in one_tier.items() if not k.startswith(("long_", "short_"))}
    expect = long_context.long_context_admits(**one_tier)
    for very_long in (True, False):
        assert long_context.long_context_admits(**{**ledger, "very_long": very_long}) == expect


@settings(max_examples=300)
@given(tiered_ledgers())
def test_a_very_long_prompt_never_takes_the_lane(ledger: dict) -> None:
    """Admitted: a prefill slot of all is free, and for a very long ask a very long one
    (the lane is only for shorter ones)."""
    if long_context.long_context_admits(**ledger):
        assert ledger["prefilling"] < ledger["slots"] + ledger["lane_slots"]
        assert not ledger["very_long"] or ledger["long_prefilling"] < ledger["slots"]


@settings(max_examples=300)
@given(tiered_ledgers())
def test_shorter_asks_and_waiters_share_all_slots_as_one_tier(ledger: dict) -> None:
    """A shorter ask while every waiter waits for a shorter prompt: decided as the one-tier
    rule over all the slots (its turn order and slot share count only the total)."""
    ledger = {**ledger, "very_long": False, "short_waiters": set(ledger["waiting"])}
    all_slots = ledger["slots"] + ledger["lane_slots"]
    one_tier = {
        k: v
        for k, v in ledger.items()
        if k not in ("very_long", "lane_slots") and not k.startswith(("long_", "short_"))
    }
    assert long_context.long_context_admits(**ledger) == long_context.long_context_admits(
        **{**one_tier, "slots": all_slots}
    )


@st.composite
def flooded_ledgers(draw: st.DrawFn) -> dict:
    """The very long slots all run (``f`` runs 128k prompts), a lane slot is free, and
    tenants waiting for very long prompts were served before the asker ``a``, which holds
    and runs nothing; the KV covers everyone."""
    slots, lane = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    lane_running = draw(st.integers(0, lane - 1))
    waiters = set(draw(st.sets(st.sampled_from("bcde"), min_size=1)))
    need = draw(st.integers(1, 40))
    usage = {"f": slots * 40} | ({"g": lane_running * 40} if lane_running else {})
    return {
        "tenant": "a",
        "need": need,
        "budget": sum(usage.values()) + need * (len(waiters) + 2),
        "slots": slots,
        "lane_slots": lane,
        "usage": usage,
        "prefilling": slots + lane_running,
        "long_prefilling": slots,
        "waiting": waiters | {"f"},
        "short_waiters": set(),
        "served": {"a": 30, "f": 40} | {w: draw(st.integers(-1, 29)) for w in waiters},
        "prefills": {"f": slots} | ({"g": lane_running} if lane_running else {}),
        "long_prefills": {"f": slots},
    }


@given(flooded_ledgers())
def test_a_shorter_prompt_runs_while_128k_prompts_hold_the_long_slots(ledger: dict) -> None:
    """The noisy-neighbour case: a shorter ask is admitted to the free lane slot although
    very long waiters are ahead of it (they could not run there); a very long ask, from
    the flooder or a waiter, is refused; with one tier (no lane) the shorter one is too."""
    assert long_context.waiting_ahead("a", ledger["waiting"], ledger["served"], ledger["usage"])
    assert long_context.long_context_admits(**ledger, very_long=False)
    assert not long_context.long_context_admits(**ledger, very_long=True)
    for who in ("f", *sorted(ledger["waiting"])):
        assert not long_context.long_context_admits(**{**ledger, "tenant": who})
    no_lane = {**ledger, "lane_slots": 0}
    assert not long_context.long_context_admits(**no_lane, very_long=False)


def test_a_very_long_ask_leaves_the_last_slot_to_a_shorter_waiter() -> None:
    """Two slots (one very long, one lane) free; b, served before a, waits for a shorter
    prompt and is due now: a's very long ask takes the very long slot and leaves the lane
    to b; the next ask (shorter, from c) would take b's last slot and yields."""
    ledger: dict[str, Any] = {
        "tenant": "a",
        "need": 1,
        "budget": 100,
        "slots": 1,
        "lane_slots": 1,
        "usage": {},
        "prefilling": 0,
        "waiting": {"b"},
        "short_waiters": {"b"},
        "served": {"a": 5, "b": 1, "c": 6},
    }
    assert long_context.long_context_admits(**ledger, very_long=True)
    after: dict[str, Any] = {
        **ledger,
        "usage": {"a": 1},
        "prefilling": 1,
        "long_prefilling": 1,
        "prefills": {"a": 1},
        "long_prefills": {"a": 1},
    }
    assert not long_context.long_context_admits(**{**after, "tenant": "c"}, very_long=False)
    assert long_context.long_context_admits(**{**after, "tenant": "b"}, very_long=False)


def test_a_very_long_refusal_waits_for_a_very_long_prefill() -> None:
    """Refused for the very long slots (``long_only``): told when the running 128k prefill
    is due, not the lane prompt's earlier first token; a shorter ask refused for all the
    slots is told the first of them."""
    now = T0
    big = lease(now + 60_000, now + 90_000, at=now - 1_000, due=now + 13_000)
    lane = replace(lease(now + 9_000, now + 30_000, at=now - 500, due=now + 2_000), very_long=False)
    wait = long_context.long_context_wait_ms
    assert wait([big, lane], now, slots_bound=True, kv_bound=False, long_only=True) == 13_000
    assert wait([big, lane], now, slots_bound=True, kv_bound=False) == 2_000


def test_the_tier_boundary_on_the_70b_profile() -> None:
    """Four TTFT targets of expected prefill (~41k prompt tokens on the 70B profile at its
    1 s target): the noisy-neighbour bench's standard long prompts (13k-30k) are shorter,
    its 128k prompts very long, in the bench's own scaled version as in the real one."""
    from bench.noisy_neighbour import NNConfig, catalog, coarse_profile
    from tests.admission.test_long_context_budget import threshold_version

    cfg = AdmissionConfig()
    real = threshold_version(LLAMA_70B_TP4_H100)
    nn = replace(NNConfig(), speed=1.5)
    profile = coarse_profile(LLAMA_70B_TP4_H100, nn.k, nn.chunk_tokens)
    scaled = next(iter(catalog(nn, profile, [], "v", "c").versions.values()))
    for version, k in ((real, 1), (scaled, nn.k)):
        tier = [
            long_context.is_very_long(
                prefill_expected_seconds(
                    n // k, version, attention_share(version, cfg.long_prefill_attention_share)
                ),
                version.ttft_target_ms,
                cfg,
            )
            for n in (13_000, 30_000, 38_000, 45_000, 131_000)
        ]
        assert tier == [False, False, False, True, True]
    assert not long_context.is_very_long(4.0, 1000, cfg)
    assert long_context.is_very_long(4.001, 1000, cfg)


def test_the_lane_is_validated() -> None:
    assert AdmissionConfig(short_long_prefill_slots_per_replica=0)
    with pytest.raises(ValueError):
        AdmissionConfig(short_long_prefill_slots_per_replica=-1)
    with pytest.raises(ValueError):
        AdmissionConfig(very_long_prefill_ttft_factor=0.5)


def test_the_lane_is_per_designated_replica() -> None:
    cfg = AdmissionConfig(long_context_replica_share=0.5, short_long_prefill_slots_per_replica=2)
    assert long_context.long_context_lane_slots(4, cfg) == 4  # 2 designated x 2
    assert long_context.long_context_lane_slots(4, AdmissionConfig()) == 1
    assert long_context.long_context_lane_slots(0, AdmissionConfig()) == 0


# -- the admit script against Redis ----------------------------------------------------------


async def test_a_shorter_long_prompt_runs_beside_a_128k_prefill(aredis: aioredis.Redis) -> None:
    """One very long slot and one lane slot: the flooder's 128k prefill takes the long
    slot; its second 128k prompt is refused until that one's first token, and so is another
    tenant's; a neighbour's 20k prompt takes the lane; a second shorter one is refused until
    the first of the two prefills is due; after the lane prompt's first token it runs."""
    lim = Limiter(aredis, AdmissionConfig())
    hold = {"gib": 1, "hold_ms": 600_000}
    flood = await lim.admit(tq("noisy", very_long=True, prefill_ms=13_000, **hold))
    assert flood.admitted
    again = await lim.admit(tq("noisy", very_long=True, prefill_ms=13_000, **hold))
    assert not again.admitted and again.long_context_full
    assert 11_000 <= again.frees_in_ms <= 13_000
    neighbour = await lim.admit(tq("std-1", very_long=False, prefill_ms=2_000, **hold))
    assert neighbour.admitted and neighbour.grant is not None
    record = _text(await aredis.hget(f"{TAG}:l", f"p:{neighbour.grant.lease_id}") or b"")
    assert record.endswith(":s")  # its tier, recorded with its lease
    other_128k = await lim.admit(tq("std-3", very_long=True, prefill_ms=13_000, **hold))
    assert not other_128k.admitted
    assert 11_000 <= other_128k.frees_in_ms <= 13_000  # the 128k prefill's, not the lane's
    second = await lim.admit(tq("std-2", very_long=False, prefill_ms=2_000, **hold))
    assert not second.admitted and 1_000 <= second.frees_in_ms <= 2_000
    assert await lim.prefill_done(neighbour.grant)
    assert (await lim.admit(tq("std-2", very_long=False, prefill_ms=2_000, **hold))).admitted
    assert not (await lim.admit(tq("noisy", very_long=True, prefill_ms=13_000, **hold))).admitted
    await lim.aclose()


async def test_a_lease_recorded_without_a_tier_counts_as_very_long(
    aredis: aioredis.Redis,
) -> None:
    """A ledger written before the tiers (a lease and an admission record without one): its
    running prefill holds the very long slot, so a very long ask is refused and a shorter
    one takes the lane."""
    now = await _store_ms(aredis)
    lease_id = "legacy-lease"
    legacy = {
        lease_id: f"{GIB}:{now + 60_000}:{now + 90_000}:old",
        "#": str(GIB),
        "u:old": str(GIB),
        "s:old": str(now - 1_000),
        f"p:{lease_id}": f"-1:{now - 1_000}:{now + 12_000}",
    }
    for f, v in legacy.items():
        await aredis.hset(f"{TAG}:l", f, v)
    await aredis.zadd(f"{TAG}:e", {lease_id: now + 120_000})
    lim = Limiter(aredis, AdmissionConfig())
    hold = {"gib": 1, "hold_ms": 600_000}
    refused = await lim.admit(tq("a", very_long=True, prefill_ms=13_000, **hold))
    assert not refused.admitted and 9_000 <= refused.frees_in_ms <= 12_000
    assert (await lim.admit(tq("b", very_long=False, prefill_ms=2_000, **hold))).admitted
    await lim.aclose()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ask_ops(st.booleans()), st.integers(1, 3), st.integers(0, 2))
# c is served; a's 128k prompt takes the only very long slot; b's is refused (b, never
# served, is ahead of c and due back before c's first token); c's shorter prompt takes the
# lane. The one-tier script refused it (every slot busy), as would a lane whose turn order
# counted b; the lane full, d's shorter prompt is refused
@example(
    [
        ("c", 1, "own", LONG, False),
        ("a", 1, "", LONG, True),
        ("b", 1, "", LONG, True),
        ("c", 1, "", LONG, False),
        ("b", 1, "", LONG, True),
        ("d", 1, "", 1, False),
    ],
    1,
    1,
)
async def test_script_decides_both_tiers_as_the_pure_rule(
    aredis: aioredis.Redis,
    ops: list[tuple[str, int, str, int, bool]],
    slots: int,
    lane: int,
) -> None:
    """Any sequence of very long and shorter asks and settles, with few very long slots
    and a lane or none: the script admits exactly what ``long_context_admits`` admits on
    the same ledger with the tiers (each lease's, and each waiter's last ask's)."""
    await aredis.delete(*(f"{TAG}:{s}" for s in "lew"))
    lim = Limiter(aredis, AdmissionConfig())
    usage: dict[str, int] = {}
    waiting: set[str] = set()
    short_waiters: set[str] = set()
    grants: list[tuple[str, int, Grant, bool]] = []
    for tenant, gib, settle, prefill, very_long in ops:
        # a shorter ask beside a very long prefill is expected to take 3 x as long
        beside = sum(1 for g in grants if g[3]) > 0 and not very_long
        req = tq(
            tenant,
            very_long=very_long,
            slots=slots,
            lane=lane,
            beside=3 * prefill,
            gib=gib,
            prefill_ms=prefill,
            hold_ms=600_000,
        )
        d = await _admits_as_the_rule(
            aredis,
            lim,
            req,
            prefill_ms=3 * prefill if beside else prefill,
            tenant=tenant,
            need=gib * GIB,
            budget=BUDGET,
            slots=slots,
            lane_slots=lane,
            very_long=very_long,
            usage=usage,
            prefilling=len(grants),
            long_prefilling=sum(1 for g in grants if g[3]),
            waiting=waiting,
            short_waiters=short_waiters,
            prefills=Counter(g[0] for g in grants),
            long_prefills=Counter(g[0] for g in grants if g[3]),
        )
        if d.admitted:
            assert d.grant is not None
            grants.append((tenant, gib, d.grant, very_long))
            usage[tenant] = usage.get(tenant, 0) + gib * GIB
            waiting.discard(tenant)
            short_waiters.discard(tenant)
        else:
            waiting.add(tenant)
            if very_long:
                short_waiters.discard(tenant)
            else:
                short_waiters.add(tenant)
        await settle_after(lim, grants, usage, tenant, settle)
    await lim.aclose()


_WAIT_LUA = LEDGER_LUA + (
    "return lc_wait(redis.call('HGETALL', KEYS[1]), tonumber(ARGV[1]), true, ARGV[2] == '1',"
    " ARGV[3] == '1')"
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.integers(0, 200_000), st.integers(1, 150_000), st.booleans()), max_size=5
    ),
    st.booleans(),
    st.booleans(),
)
async def test_script_waits_for_the_tier_as_the_pure_rule(
    aredis: aioredis.Redis,
    leases: list[tuple[int, int, bool]],
    kv_bound: bool,
    long_only: bool,
) -> None:
    """``lc_wait`` on leases of both tiers (a lane lease's admission record ends in ':s')
    says what ``long_context_wait_ms`` says, for a very long refusal (``long_only``) and
    any other."""
    key = "lc-wait-tier-test:l"
    await aredis.delete(key)
    fields = {"#": "7", "u:a": "7"}
    times = []
    for i, (ago, due, very_long) in enumerate(leases):
        at = T0 - ago
        x = replace(lease(at + 300_000, at + 400_000, at=at, due=at + due), very_long=very_long)
        times.append(x)
        fields[f"r{i}"] = f"1:{x.prefill_end}:{x.expected_end}:a"
        fields[f"p:r{i}"] = f"-1:{at}:{at + due}" + ("" if very_long else ":s")
    for f, v in fields.items():
        await aredis.hset(key, f, v)
    got = await aredis.eval(_WAIT_LUA, 1, key, T0, int(kv_bound), int(long_only))
    expect = long_context.long_context_wait_ms(
        times, T0, slots_bound=True, kv_bound=kv_bound, long_only=long_only
    )
    assert int(got) == expect
    await aredis.delete(key)


async def test_without_the_store_a_shorter_prompt_may_use_the_lane() -> None:
    """The local fallback's share of the slots (0.25): of 4 very long slots one, of those
    and 4 lane slots two; it does not tell the tiers of the running prefills apart (each
    counts against the very long slots), so it never admits more than the ledger would."""
    dead = connect("redis://127.0.0.1:1/0", timeout_s=0.2)
    lim = Limiter(dead, AdmissionConfig(local_kv_fraction=0.25))
    ask = {"slots": 4, "lane": 4, "gib": 1, "prefill_ms": 1, "hold_ms": 600_000}
    assert (await lim.admit(tq("a", very_long=True, **ask))).admitted
    refused = await lim.admit(tq("b", very_long=True, **ask))
    assert not refused.admitted and refused.degraded and refused.long_context_full
    assert (await lim.admit(tq("b", very_long=False, **ask))).admitted
    assert not (await lim.admit(tq("c", very_long=False, **ask))).admitted
    await dead.aclose()


async def test_a_lane_prompt_beside_a_128k_prefill_is_expected_later(
    aredis: aioredis.Redis,
) -> None:
    """A shorter ask admitted while a very long prefill runs records its first token as
    expected beside it (``prefill_beside_ms``), so a refusal for the busy lane is told to
    wait that long; admitted alone it records its lone estimate."""
    lim = Limiter(aredis, AdmissionConfig())
    hold = {"gib": 1, "hold_ms": 600_000}
    alone = await lim.admit(tq("a", very_long=False, prefill_ms=2_000, beside=8_000, **hold))
    assert alone.admitted and alone.grant is not None
    _, at, due = _text(await aredis.hget(f"{TAG}:l", f"p:{alone.grant.lease_id}") or b"").split(
        ":"
    )[:3]
    assert int(due) - int(at) == 2_000
    await lim.settle(alone.grant, actual_tokens=0, refund_request=False)
    assert (await lim.admit(tq("noisy", very_long=True, prefill_ms=13_000, **hold))).admitted
    lane = await lim.admit(tq("a", very_long=False, prefill_ms=2_000, beside=8_000, **hold))
    assert lane.admitted and lane.grant is not None
    _, at, due = _text(await aredis.hget(f"{TAG}:l", f"p:{lane.grant.lease_id}") or b"").split(":")[
        :3
    ]
    assert int(due) - int(at) == 8_000
    refused = await lim.admit(tq("b", very_long=False, prefill_ms=2_000, beside=8_000, **hold))
    assert not refused.admitted and 7_000 <= refused.frees_in_ms <= 8_000
    await lim.aclose()


def test_a_lane_prompt_beside_a_128k_prefill_gets_the_rest_of_each_step() -> None:
    """The noisy-neighbour bench's version: a 20k prompt beside a 128k prefill is expected
    after ~3.7 s of wall time (1.1 s alone; measured 4-7 s there), in the rest (0.36) of each
    step the 128k chunk (0.64) sets the length of."""
    from bench.noisy_neighbour import NNConfig, catalog, coarse_profile

    cfg = AdmissionConfig()
    nn = replace(NNConfig(), speed=1.5)
    profile = coarse_profile(LLAMA_70B_TP4_H100, nn.k, nn.chunk_tokens)
    version = next(iter(catalog(nn, profile, [], "v", "c").versions.values()))
    n = 20_000 // nn.k
    alone = prefill_expected_seconds(
        n, version, attention_share(version, cfg.long_prefill_attention_share)
    )
    beside = long_context.lane_prefill_seconds(n, version, cfg)
    assert 1.0 < alone < 1.3 and 3.3 < beside < 4.1
    with pytest.raises(ValueError):
        AdmissionConfig(long_prefill_step_share=1.0)


@pytest.mark.parametrize("lane", [1, 0])
async def test_the_controllers_ask_carries_the_tier(
    redis_url: str, aredis: aioredis.Redis, lane: int
) -> None:
    """The controller's long-context ask carries what ``long_context_tier`` computes (the
    fleet simulation's ledger asks the same function): its tier, expected first token,
    lane estimate and safety expiry. Without a lane it sends no lane estimate
    (``prefill_beside_ms`` 0), so a shorter ask beside a very long prefill records its lone
    estimate: the one-tier ask exactly."""
    from tests.admission.test_controller import VERSION, StubRegistry, request, started_controller
    from tests.admission.test_long_context_budget import threshold_version

    cfg = AdmissionConfig(short_long_prefill_slots_per_replica=lane)
    version = replace(threshold_version(LLAMA_70B_TP4_H100), replicas=VERSION.replicas)
    controller = await started_controller(redis_url, aredis, StubRegistry(), cfg)
    try:
        for n in (20_000, 128_000):
            req = replace(request("standard", prompt=n, rid=f"r{n}"), version=version)
            ask = controller.long_context_ask(req)
            assert ask is not None
            tier = long_context.long_context_tier(n, version, cfg)
            assert (ask.very_long, ask.prefill_ms, ask.prefill_beside_ms, ask.prefill_hold_ms) == (
                tier.very_long,
                tier.prefill_ms,
                tier.beside_ms,
                tier.hold_ms,
            )
            assert ask.very_long == (n == 128_000)
            assert ask.lane_slots == lane
            assert (ask.prefill_beside_ms > ask.prefill_ms) == (lane == 1 and n == 20_000)
    finally:
        await controller.stop()
