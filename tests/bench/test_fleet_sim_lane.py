"""The fleet simulation's long-context ledger models the budget's two tiers as the gateway
keeps them (gateway/README.md, "Placement and long contexts"): a very long prompt takes one
of the very long slots, a shorter long context may also take one of the lane's
(``FleetConfig.lane_slots``, the gateway's ``short_long_prefill_slots_per_replica``), and a
lane prompt admitted beside a very long prefill is expected at its lane estimate. The tier
and the expected first token come from one function, ``long_context.long_context_tier``,
that the gateway's controller uses too; the ledger's decisions, waits, due-backs and waiting
entries are checked against the admit script itself (``lc_refusal`` in
gateway/admission/quota.py) on the same ledger state and clock."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bench import fleet_sim
from bench.fleet_sim import FleetConfig, FleetSim, SimRequest
from bench.sim import LongContextLedger, SimDue, SimLease, replica_records, sim_version, store_ms
from gateway.admission.config import VLLM_PRIORITY, AdmissionConfig
from gateway.admission.estimates import attention_share, prefill_expected_seconds
from gateway.admission.long_context import (
    is_very_long,
    lane_prefill_seconds,
    long_context_budget,
    long_context_lane_slots,
    long_context_tier,
    long_context_wait_ms,
)
from gateway.admission.quota import LEDGER_LUA
from gateway.admission.retry import long_context_retry_earliest_ms
from tests.bench.test_fleet_sim_lc_retry import KV, OUT, PROFILE, _ask

LONG = 128_000  # a very long prompt (~20 s of prefill)
SHORT = 20_000  # a shorter long context (~1.7 s alone, ~5.6 s beside a 128k prefill)


def _ledger(lane: int = 1, replicas: int = 4, window_s: float = 15.0) -> LongContextLedger:
    """The fleet simulation's version (the 70B profile at its threshold rate) on ``replicas``
    shared replicas (4: one designated, one very long slot) with ``lane`` lane slots per
    designated replica."""
    sim = FleetSim(
        FleetConfig(replicas=replicas, duration_s=10.0, warmup_s=0.0, gateways=1,
                    isolation=True, lane_slots=lane),
        PROFILE,
    )  # fmt: skip
    ledger = sim.ledger
    return replace(ledger, adm=replace(ledger.adm, long_context_demand_window_s=window_s))


# -- the tier: one function for the gateway and the simulation ---------------------------


def test_the_tier_on_the_simulated_version() -> None:
    """A 128k prompt is very long, a 20k one is not; the 20k one's lane estimate is its
    prefill beside a very long one (``lane_prefill_seconds``), later than alone, and its
    safety expiry covers it; without a lane it has none, and its expiry is as before."""
    on, off = _ledger(lane=1), _ledger(lane=0)
    version, adm = on.version, on.adm
    share = attention_share(version, adm.long_prefill_attention_share)
    for prompt in (LONG, SHORT):
        tier = on.tier(prompt)
        alone = prefill_expected_seconds(prompt, version, share)
        assert tier.prefill_ms == max(1, math.ceil(alone * 1000))
        assert tier.very_long == is_very_long(alone, version.ttft_target_ms, adm)
        assert tier == long_context_tier(prompt, version, adm)
    assert on.tier(LONG).very_long and not on.tier(SHORT).very_long
    assert on.tier(LONG).beside_ms == 0 and on.tier(LONG) == off.tier(LONG)
    short = on.tier(SHORT)
    assert short.beside_ms == math.ceil(lane_prefill_seconds(SHORT, version, adm) * 1000)
    assert short.prefill_ms < short.beside_ms <= short.hold_ms
    assert off.tier(SHORT).beside_ms == 0 and off.tier(SHORT).hold_ms < short.hold_ms
    # beside a running very long prefill a shorter ask expects its lane estimate
    assert short.first_token_ms(0) == short.prefill_ms
    assert short.first_token_ms(1) == short.beside_ms
    assert on.tier(LONG).first_token_ms(1) == on.tier(LONG).prefill_ms
    assert on.lane_slots == 1 and off.lane_slots == 0
    assert _ledger(lane=2, replicas=8).lane_slots == long_context_lane_slots(8, on.adm) * 2 == 4


def test_the_fleet_config_sets_the_gateways_lane() -> None:
    """``FleetConfig.lane_slots`` is the gateway's ``short_long_prefill_slots_per_replica``,
    its default the gateway's."""
    assert FleetConfig().lane_slots == AdmissionConfig().short_long_prefill_slots_per_replica
    cfg = FleetConfig(isolation=True, lane_slots=0)
    assert cfg.admission().short_long_prefill_slots_per_replica == 0


# -- the ledger's tiers ----------------------------------------------------------------------


def test_a_shorter_long_context_runs_beside_a_very_long_prefill_only_with_the_lane() -> None:
    """a's 128k prompt holds the one very long slot; b's 20k prompt asks 2 s later: with the
    lane it is admitted, its lease expecting its first token at its lane estimate; without
    it, it is refused and told to wait for a's first token."""
    for lane in (1, 0):
        ledger = _ledger(lane=lane)
        assert _ask(ledger, "a", "l1", LONG, 1.0) is None
        wait = _ask(ledger, "b", "l2", SHORT, 3.0)
        if lane:
            assert wait is None
            lease = ledger.leases["l2"]
            assert not lease.very_long and ledger.leases["l1"].very_long
            assert lease.first_token_due_ms - lease.admitted_ms == ledger.tier(SHORT).beside_ms
        else:
            a = ledger.leases["l1"].times()
            assert wait == long_context_wait_ms([a], 3_000, slots_bound=True, kv_bound=False)
            assert wait == 1_000 + ledger.tier(LONG).prefill_ms - 3_000
            back = 3_000 + long_context_retry_earliest_ms(wait)
            assert ledger.due["b"] == SimDue(back, ledger.tier(SHORT).prefill_ms, short=True)


def test_a_very_long_prompt_never_takes_the_lane() -> None:
    """With the lane free and the very long slot busy, c's 128k prompt is refused and told
    when the very long prefill is due, not when the lane prompt's (earlier) first token is;
    once the 128k prefill is done it is admitted."""
    ledger = _ledger(lane=1)
    assert _ask(ledger, "a", "l1", LONG, 1.0) is None
    wait = _ask(ledger, "c", "l3", LONG, 2.0)
    assert wait == 1_000 + ledger.tier(LONG).prefill_ms - 2_000
    back = 2_000 + long_context_retry_earliest_ms(wait)
    assert ledger.due["c"] == SimDue(back, ledger.tier(LONG).prefill_ms)
    assert _ask(ledger, "b", "l2", SHORT, 3.0) is None  # the lane: b's first token due ~8.6 s
    wait = _ask(ledger, "c", "l3", LONG, 4.0)
    times = [x.times() for x in ledger.leases.values()]
    assert wait == long_context_wait_ms(times, 4_000, slots_bound=True, kv_bound=False,
                                        long_only=True)  # fmt: skip
    assert wait == 1_000 + ledger.tier(LONG).prefill_ms - 4_000  # a's, not b's
    ledger.prefilled("l1", 21.0)
    assert _ask(ledger, "c", "l3", LONG, 22.0) is None


def test_a_busy_lane_is_told_the_lane_prompts_first_token() -> None:
    """With a 128k prefill and a lane prompt beside it, d's 20k prompt finds every slot
    busy: told to wait for the first prefill due, the lane prompt's lane estimate."""
    ledger = _ledger(lane=1)
    assert _ask(ledger, "a", "l1", LONG, 1.0) is None
    assert _ask(ledger, "b", "l2", SHORT, 3.0) is None
    wait = _ask(ledger, "d", "l4", SHORT, 4.0)
    assert wait == 3_000 + ledger.tier(SHORT).beside_ms - 4_000


def test_without_the_lane_the_ledger_is_the_one_tier_ledger() -> None:
    """Lane 0: a shorter ask takes the one slot as a very long one would, and beside a very
    long prefill (two designated replicas, one slot each) its lease expects its lone
    estimate, as the gateway sends no lane estimate then; with the lane, its lane one."""
    ledger = _ledger(lane=0)
    assert _ask(ledger, "b", "l2", SHORT, 1.0) is None
    assert _ask(ledger, "a", "l1", LONG, 2.0) is not None  # the one slot is b's
    ledger.prefilled("l2", 2.5)
    assert _ask(ledger, "a", "l1", LONG, 3.0) is None
    for lane in (0, 1):
        ledger = _ledger(lane=lane, replicas=8)
        assert _ask(ledger, "a", "l1", LONG, 1.0) is None
        assert _ask(ledger, "b", "l2", SHORT, 2.0) is None
        lease = ledger.leases["l2"]
        tier = ledger.tier(SHORT)
        expect = tier.beside_ms if lane else tier.prefill_ms
        assert lease.first_token_due_ms - lease.admitted_ms == expect


# -- the ledger against the admit script ------------------------------------------------------

_REFUSAL_LUA = LEDGER_LUA + (
    "local w, pf, c = lc_refusal(KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[1]), ARGV[2],"
    " tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]),"
    " tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[10] ~= '0',"
    " tonumber(ARGV[11]))\n"
    "if w then return {0, math.ceil(w), c} end\n"
    "return {1, pf, 0}"
)
_L, _E, _W = "lane-sim-parity:l", "lane-sim-parity:e", "lane-sim-parity:w"


def _write_ledger(
    rdb: redis.Redis, ledger: LongContextLedger, prev: dict[str, int], now: float
) -> None:
    """The simulated ledger as the script's keys hold it at ``now``: each lease, its
    admission record (with its tier) and its expiry as renewed by then
    (``LongContextLedger.lease_expiry``), each tenant's KV and last admission, the due-backs
    (with their tier) and the waiting tenants (``prev``: each lease's tenant's admission
    before it, for the admission record; the script does not read it in a decision)."""
    rdb.delete(_L, _E, _W)
    fields: dict[str, str] = {"#": str(sum(x.kv for x in ledger.leases.values()))}
    for lease, x in ledger.leases.items():
        t = x.times()
        fields[lease] = f"{x.kv}:{t.prefill_end}:{t.expected_end}:{x.tenant}"
        fields[f"p:{lease}"] = f"{prev.get(lease, -1)}:{t.admitted}:{t.first_token_due}" + (
            "" if x.very_long else ":s"
        )
        fields[f"u:{x.tenant}"] = str(int(fields.get(f"u:{x.tenant}", "0")) + x.kv)
    for who, at in ledger.served.items():
        fields[f"s:{who}"] = str(store_ms(at))
    for who, d in ledger.due.items():
        fields[f"d:{who}"] = f"{d.at}:{d.prefill_ms}" + (":s" if d.short else "")
    pipe = rdb.pipeline()
    for f, v in fields.items():
        pipe.hset(_L, f, v)
    for lease, x in ledger.leases.items():
        pipe.zadd(_E, {lease: ledger.lease_expiry(x, store_ms(now))})
    for who, at in ledger.waiting.items():
        pipe.zadd(_W, {who: _score_ms(at)})
    pipe.execute()


def _score_ms(at: float) -> int:
    """A waiting entry's score (s, the script's ms over 1,000 or a time on the tests' grid) as
    the script's ms."""
    return round(at * 1000)


def _script_asks(
    rdb: redis.Redis, ledger: LongContextLedger, tenant: str, prompt: int, now: float
) -> tuple[bool, int, int]:
    """The script's ``lc_refusal`` on the simulated ledger's state at ``now``: (admitted,
    the expected first token it records if admitted, else the wait it tells, the clause
    that refused it or 0)."""
    budget, slots = long_context_budget(ledger.version, ledger.shared_replicas, "standard",
                                        ledger.adm)  # fmt: skip
    tier = ledger.tier(prompt)
    total = sum(x.kv for x in ledger.leases.values())
    window = store_ms(ledger.adm.long_context_demand_window_s)
    args: list[str | int] = [store_ms(now), tenant, (prompt + OUT) * KV, budget, slots, window,
                             total, tier.prefill_ms, ledger.lane_slots, int(tier.very_long),
                             tier.beside_ms]  # fmt: skip
    admitted, ms, clause = rdb.eval(_REFUSAL_LUA, 3, _L, _E, _W, *args)
    return bool(admitted), int(ms), int(clause)


@st.composite
def _ops(draw: st.DrawFn) -> list[tuple[str, int, str, float]]:
    """Asks: (tenant, prompt, what happens after it: nothing, the oldest prefilling lease's
    first token, or the oldest lease's release, halfway to the next ask; the time to it,
    ``_STEPS``)."""
    return draw(
        st.lists(
            st.tuples(
                st.sampled_from("abcd"),
                st.sampled_from((LONG, 60_000, SHORT, 13_000)),
                st.sampled_from(("", "", "first", "release")),
                st.sampled_from(_STEPS),
            ),
            min_size=1,
            max_size=20,
        )
    )


# the time from one ask to the next (s): mostly short, sometimes past the leases' expected
# ends (5 s of decode here) and far past them (the overrun guess capped by the expiry)
_STEPS = (0.5, 0.5, 0.5, 6.0, 40.0)


def _shift_lease_ends(rdb: redis.Redis, ledger: LongContextLedger, by: int) -> None:
    """Moves every lease's expected end and expiry in the script's keys by ``by`` ms (at
    least the store's 0), the times only the wait reads."""
    for lease, x in ledger.leases.items():
        en = max(0, x.expected_end_ms + by)
        rdb.hset(_L, lease, f"{x.kv}:{store_ms(x.prefill_end)}:{en}:{x.tenant}")
        rdb.zadd(_E, {lease: max(0, (rdb.zscore(_E, lease) or 0) - by)})


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(_ops(), st.sampled_from((0, 1, 2)), st.sampled_from((4, 8)), st.integers(-60_000, 60_000))
# b, refused for a shorter prompt with both slots busy, is waiting ahead of a when a's first
# token frees the lane: a's 128k ask (the very long slot busy) leaves that last slot to b
# (``seatable``) and is told to wait until b is back and through its prefill
@example(
    [("a", SHORT, "", 0.5), ("a", 60_000, "", 0.5), ("b", SHORT, "first", 0.5),
     ("a", LONG, "", 0.5)], 1, 4, 0,
)  # fmt: skip
# the KV full (three 128k leases and a 20k one, all decoding): c's 128k ask is told when
# the first 128k one is expected to end (3 s); 6 s on, every lease past its expected end, when
# the first is expected to by the overrun rule (a quarter of its life so far: 1.6 s, not the
# 1 s floor); 100 s on, that guess (~27 s) capped by the lease's renewed expiry (12 s)
@example(
    [("a", LONG, "first", 0.5), ("b", LONG, "first", 0.5), ("d", SHORT, "first", 0.5),
     ("a", LONG, "first", 0.5), ("c", LONG, "", 6.0), ("c", LONG, "", 100.0),
     ("c", LONG, "", 0.5)], 1, 4, 30_000,
)  # fmt: skip
def test_the_ledger_decides_and_answers_as_the_admit_script(
    rdb: redis.Redis,
    ops: list[tuple[str, int, str, float]],
    lane: int,
    replicas: int,
    shift: int,
) -> None:
    """Any sequence of very long and shorter asks, first tokens and releases, with no lane,
    one or two per designated replica, some seconds apart or far past the leases' expected
    ends: at each ask the admit script's ``lc_refusal``, run on the simulated ledger's state
    at the same clock (the leases' renewed expiries included), admits exactly when the
    ledger does, records the same expected first token (a shorter one beside a very long
    prefill: its lane estimate) or tells the same wait (for KV: when enough leases are
    expected to have ended, each past its expected end by the overrun rule); and the ledger
    records the due-back and the waiting entry the script writes. The script's decision and
    clause are the same with every lease's expected end and expiry moved by ``shift``: the
    times the KV wait reads decide nothing."""
    ledger = _ledger(lane=lane, replicas=replicas, window_s=600.0)
    prev: dict[str, int] = {}
    now = 1.0
    for i, (tenant, prompt, after, step) in enumerate(ops):
        _write_ledger(rdb, ledger, prev, now)
        _shift_lease_ends(rdb, ledger, shift)
        shifted = _script_asks(rdb, ledger, tenant, prompt, now)
        _write_ledger(rdb, ledger, prev, now)
        script = _script_asks(rdb, ledger, tenant, prompt, now)
        assert (shifted[0], shifted[2]) == (script[0], script[2])
        before = store_ms(ledger.served[tenant]) if tenant in ledger.served else -1
        lease = f"l{i}"
        wait = _ask(ledger, tenant, lease, prompt, now)
        if wait is None:
            prev[lease] = before
            x = ledger.leases[lease]
            assert script == (True, x.first_token_due_ms - x.admitted_ms, 0)
        else:
            assert script[:2] == (False, wait)
            told = rdb.hget(_L, f"d:{tenant}")
            d = ledger.due[tenant]
            assert told == f"{d.at}:{d.prefill_ms}{':s' if d.short else ''}".encode()
            assert rdb.zscore(_W, tenant) == _score_ms(ledger.waiting[tenant])
        now += step / 2
        prefilling = [k for k, x in ledger.leases.items() if x.prefill_end > now]
        if after == "first" and prefilling:
            ledger.prefilled(prefilling[0], now)
        elif after == "release" and ledger.leases:
            ledger.release(next(iter(ledger.leases)))
        now += step / 2
    rdb.delete(_L, _E, _W)


# -- the simulation ---------------------------------------------------------------------------


def _sim(lane: int) -> tuple[FleetSim, SimRequest, SimRequest, SimRequest]:
    """Four replicas (one designated), almost no other traffic: heavy-1's 128k prompt at
    1 s, then b's 20k prompt at 3 s and c's 128k one at 4 s, run for 60 model-s."""
    cfg = FleetConfig(replicas=4, rate_rps=0.01, duration_s=60.0, warmup_s=0.0, gateways=1,
                      isolation=True, lane_slots=lane, long_prefill_tokens=5_242)  # fmt: skip
    sim = FleetSim(cfg, PROFILE)
    std = VLLM_PRIORITY["standard"]
    heavy = SimRequest(rid=900_001, tenant_class="standard", prompt=LONG, output=OUT,
                       arrival=1.0, priority=std, tenant="heavy-1", heavy=True)  # fmt: skip
    short = SimRequest(rid=900_002, tenant_class="standard", prompt=SHORT, output=OUT,
                       arrival=3.0, priority=std, tenant="b")  # fmt: skip
    other = SimRequest(rid=900_003, tenant_class="standard", prompt=LONG, output=OUT,
                       arrival=4.0, priority=std, tenant="c", heavy=True)  # fmt: skip
    for r in (heavy, short, other):
        sim._add(r)
    return sim, heavy, short, other


@pytest.mark.parametrize("lane", [1, 0])
def test_in_the_simulation_a_shorter_prompt_runs_beside_a_128k_prefill_only_with_the_lane(
    lane: int,
) -> None:
    """Through the simulated gateways and replicas: with the lane, b's 20k prompt is admitted
    at once and has its first token while heavy-1's 128k prefill still runs; without it, it
    is refused until that prefill is done. c's second 128k prompt is refused either way (it
    never takes the lane), and runs after the first."""
    sim, heavy, short, other = _sim(lane)
    asks: list[tuple[int, int]] = []  # after each ask: long prefills running, very long ones
    admit = sim._long_admit

    def counting(r: SimRequest, lease: str, now: float) -> int | None:
        got = admit(r, lease, now)
        running = [x for x in sim.ledger.leases.values() if x.prefill_end > now]
        asks.append((len(running), sum(1 for x in running if x.very_long)))
        return got

    sim._long_admit = counting  # type: ignore[method-assign]
    sim.run()
    assert heavy.status == short.status == other.status == "ok"
    assert heavy.first_token is not None and short.first_token is not None
    assert other.first_token is not None and other.first_token > heavy.first_token
    assert other.rejections >= 1 and heavy.rejections == 0
    if lane:
        assert short.rejections == 0 and short.first_token < heavy.first_token
    else:
        assert short.rejections >= 1 and short.first_token > heavy.first_token
    _, slots = long_context_budget(sim.ledger.version, 4, "standard", sim.adm)
    # never more very long prefills than the very long slots, nor more in all than both tiers
    assert max(n for _, n in asks) <= slots
    assert max(n for n, _ in asks) <= slots + lane
    assert any(n > slots for n, _ in asks) == bool(lane)


def test_the_lane_off_arm() -> None:
    """``--lane-off`` adds the new policy without the lane, the same runs otherwise."""
    scale = fleet_sim.Scale.quick()
    arms = fleet_sim.isolation_experiments(scale, 1, 2, (0.5, 1.0), lane_off=True)
    off = arms["new, lane off, 2 heavy tenants"]
    new = arms["new (isolation), 2 heavy tenants"]
    assert off.lane_slots == 0 and new.lane_slots == 1
    assert replace(off, lane_slots=1) == new
    assert "new, lane off, 2 heavy tenants" not in fleet_sim.isolation_experiments(scale, 1, 2)


def test_a_lane_lease_is_recorded_with_its_tier() -> None:
    """``SimLease.times`` carries its tier to ``long_context_wait_ms`` (the script's ':s')."""
    lease = SimLease("a", KV, 10.0, admitted_ms=0, first_token_due_ms=5_000,
                     expected_end_ms=60_000, very_long=False)  # fmt: skip
    assert not lease.times().very_long
    assert SimLease("a", KV, 10.0).times().very_long


def test_the_ledger_on_a_version_of_its_own() -> None:
    """``long_context_tier`` takes whatever version the ledger holds (here: a slower
    replica, where a 20k prompt is very long), as the gateway's controller does."""
    version = sim_version("v", "llama-70b", PROFILE, replica_records(4),
                          kv_capacity_tokens=PROFILE.kv_capacity_tokens,
                          prefill_tokens_per_s=1_000.0)  # fmt: skip
    ledger = LongContextLedger(version, 4, AdmissionConfig())
    assert ledger.tier(SHORT).very_long and ledger.tier(SHORT).beside_ms == 0
    assert _ask(ledger, "a", "l1", SHORT, 1.0) is None
    assert _ask(ledger, "b", "l2", SHORT, 2.0) is not None  # no lane for it
