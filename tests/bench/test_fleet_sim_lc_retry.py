"""The fleet simulation's long-context ledger answers a refusal as the gateway does: the wait
the admit script computes (``long_context_wait_ms``, ``yield_wait_ms``) jittered into the
503's retry-after (``long_context_retry_after_ms``), each refused tenant's due-back recorded
and used by the turn order's backfill, and a waiting entry kept per ``waiting_score``. With
``tells_waits`` off it is the ledger before (the comparison arm). One tier here (the lane
off, ``short_long_prefill_slots_per_replica`` 0): the lane's own tests are in
test_fleet_sim_lane.py."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from bench import fleet_sim
from bench.fleet_sim import FleetConfig, FleetSim, SimRequest
from bench.sim import LongContextLedger, SimDue, SimLease, replica_records, sim_version
from emulator.profiles import get_profile
from gateway.admission.config import AdmissionConfig
from gateway.admission.estimates import expected_duration_ms, prefill_bound_seconds
from gateway.admission.long_context import (
    WAITING_GRACE_MS,
    LeaseTimes,
    long_context_budget,
    long_context_wait_ms,
    waiting_score,
    yield_wait_ms,
)
from gateway.admission.retry import (
    capacity_retry_after_ms,
    long_context_retry_after_ms,
    long_context_retry_earliest_ms,
    long_context_retry_latest_ms,
)

PROFILE = get_profile(fleet_sim.PROFILE)
KV = PROFILE.kv_bytes_per_token
OUT = 100  # every ask's output tokens


def _ledger(
    tells_waits: bool = True, window_s: float = 15.0, rate: float = 10_000.0
) -> LongContextLedger:
    """4 shared replicas (one designated: one prefill slot, ~480k tokens of KV) prefilling
    10,000 tokens/s, a tenth of the threshold prompt's time attention: a 100k prompt is
    expected to take 19 s, a 20k one 2.2 s. No lane: every long prefill takes the one slot."""
    version = sim_version("v", "llama-70b", PROFILE, replica_records(4),
                          kv_capacity_tokens=PROFILE.kv_capacity_tokens,
                          prefill_tokens_per_s=rate)  # fmt: skip
    version = replace(version, prefill_attention_share=0.10)
    adm = AdmissionConfig(long_context_demand_window_s=window_s,
                          short_long_prefill_slots_per_replica=0)  # fmt: skip
    ledger = LongContextLedger(version, 4, adm, tells_waits=tells_waits)
    assert long_context_budget(version, 4, "standard", adm)[1] == 1
    if rate == 10_000.0:
        assert ledger.prefill_ms(100_000) == 19_000 and ledger.prefill_ms(20_000) == 2_200
    return ledger


def _ask(ledger: LongContextLedger, tenant: str, lease: str, prompt: int, now: float) -> int | None:
    return ledger.ask(tenant, lease, (prompt + OUT) * KV, prompt, now, output=OUT)


def _scene(ledger: LongContextLedger) -> int | None:
    """c was served at 0 s (its 10k prompt done and gone by 0.6 s); a's 100k prompt takes the
    slot at 1 s (first token expected at 20 s); b asks at 2 s: the answer to b."""
    assert _ask(ledger, "c", "l0", 10_000, 0.0) is None
    ledger.prefilled("l0", 0.5)
    ledger.release("l0")
    assert _ask(ledger, "a", "l1", 100_000, 1.0) is None
    return _ask(ledger, "b", "l2", 20_000, 2.0)


def test_a_full_slot_is_told_the_running_prefills_first_token_as_the_gateway_tells_it() -> None:
    ledger = _ledger()
    wait = _scene(ledger)
    # the gateway's pure function on the same ledger state: a's lease as the script records
    # it (safety expiry, expected end, admitted, first token due), every slot busy
    bound = prefill_bound_seconds(100_000, ledger.version)  # its safety expiry's bound
    hold_ms = math.ceil(ledger.adm.long_prefill_hold_factor * bound * 1000)
    end = 1_000 + expected_duration_ms(OUT, 0.05)  # its decode at the TPOT target
    a = LeaseTimes(prefill_end=1_000 + hold_ms, expected_end=end, admitted=1_000,
                   first_token_due=20_000, kv=(100_000 + OUT) * KV)  # fmt: skip
    assert ledger.leases["l1"].times() == a
    expect = long_context_wait_ms([a], 2_000, slots_bound=True, kv_bound=False)
    assert wait == expect == 18_000  # until a's first token is due, not ~1 s nor the expiry


def test_the_client_is_told_the_gateways_jittered_retry_after() -> None:
    """Through the simulated gateway: a long prompt refused for the one busy slot (another
    tenant's prefill, its first token due at 7 s) comes back at the retry-after the gateway's
    ``long_context_retry_after_ms`` draws from the same generator; the arm before drew the
    fleet-full retry-after instead."""
    for told in (True, False):
        cfg = FleetConfig(replicas=4, duration_s=10.0, warmup_s=0.0, gateways=1,
                          isolation=True, lc_told_wait=told, lane_slots=0)  # fmt: skip
        sim = FleetSim(cfg, PROFILE)
        other = SimLease("other", 1_000 * KV, 100.0, admitted_ms=0, first_token_due_ms=7_000,
                         expected_end_ms=60_000)  # fmt: skip
        sim.ledger.leases["0.0"] = other
        r = SimRequest(rid=1, tenant_class="standard", prompt=20_000, output=OUT,
                       arrival=1.0, tenant="t1")  # fmt: skip
        assert r.prompt >= sim.long_threshold
        rng = random.Random()
        rng.setstate(sim.gws[0].rng.getstate())
        sim.now = 1.0
        sim._arrive(r, 1.0)
        ms = (
            long_context_retry_after_ms(6_000, rng)
            if told
            else capacity_retry_after_ms(sim.adm, rng)
        )
        back = [t for t, _, _, p in sim.events if p is r]
        assert back == [pytest.approx(1.0 + ms / 1000)] and r.attempt == 1
        assert sim.long_told_s == [ms / 1000]
        if told:
            assert 6_000 <= ms <= 9_000
            assert sim.ledger.due["t1"] == SimDue(7_000, sim.ledger.prefill_ms(20_000), short=True)
        else:
            assert not sim.ledger.due


def test_due_backs_are_recorded_and_let_an_ask_done_before_them_backfill_the_slot() -> None:
    """b, refused at 2 s, is due back at 20 s. a's first token comes early (3 s), so the slot
    is free at 4 s when c (served before b) asks: its 20k prompt is expected done at 6.2 s,
    before b is back, so it takes the slot (the gateway's backfill). Without due-backs (the
    ledger before), c yields the slot to b instead."""
    for tells in (True, False):
        ledger = _ledger(tells_waits=tells)
        wait = _scene(ledger)
        assert wait == 18_000
        assert "b" in ledger.waiting
        assert ledger.due == ({"b": SimDue(20_000, 2_200, short=True)} if tells else {})
        ledger.prefilled("l1", 3.0)
        admitted = _ask(ledger, "c", "l3", 20_000, 4.0) is None
        assert admitted == tells
    # b is admitted at its retry; its due-back goes with its waiting entry
    ledger = _ledger()
    _scene(ledger)
    ledger.prefilled("l1", 3.0)
    assert _ask(ledger, "c", "l3", 20_000, 4.0) is None
    ledger.prefilled("l3", 6.0)
    assert _ask(ledger, "b", "l4", 20_000, 20.5) is None
    assert "b" not in ledger.due and "b" not in ledger.waiting


def test_an_ask_that_would_hold_the_slot_past_a_due_back_yields_until_the_waiter_is_back() -> None:
    """c's 100k prompt at 4 s would still be prefilling (until 23 s) when b is back at 20 s:
    it yields, told to come back when b is back and through its 2.2 s prefill
    (``yield_wait_ms``), not in 1 s with the slot idle."""
    ledger = _ledger()
    _scene(ledger)
    ledger.prefilled("l1", 3.0)
    wait = _ask(ledger, "c", "l3", 100_000, 4.0)
    slot = long_context_wait_ms([x.times() for x in ledger.leases.values()], 4_000,
                                slots_bound=True, kv_bound=False)  # fmt: skip
    assert slot == 1_000  # no prefill running
    assert wait == yield_wait_ms(slot, [(20_000, 2_200)], 4_000) == 18_200
    assert ledger.due["c"] == SimDue(4_000 + 18_200, 19_000)


def test_a_waiting_entry_outlives_the_demand_window_when_told_to_come_later() -> None:
    """b, holding nothing, is told 18 s with a 5 s demand window: it stays waiting until the
    latest retry it may be told plus the grace (``waiting_score``), so at 10 s it is still
    ahead of others; the ledger before dropped it after the window."""
    latest = 2_000 + long_context_retry_latest_ms(18_000) + WAITING_GRACE_MS
    for tells in (True, False):
        ledger = _ledger(tells_waits=tells, window_s=5.0)
        assert _scene(ledger) == 18_000
        if tells:
            score = waiting_score(2_000, 18_000, 5_000, holds=False)
            assert ledger.waiting["b"] == score / 1000 == (latest - 5_000) / 1000
        _ask(ledger, "d", "l9", 20_000, 10.0)  # prunes the waiting tenants at 10 s
        assert ("b" in ledger.waiting) == tells
        assert ("b" in ledger.due) == tells
    _ask(ledger := _ledger(window_s=5.0), "x", "lx", 10_000, 0.0)
    ledger.release("lx")
    assert _scene(ledger) == 18_000
    _ask(ledger, "d", "l9", 20_000, latest / 1000 + 0.1)  # past it: gone
    assert "b" not in ledger.waiting and "b" not in ledger.due


def test_a_tenant_holding_leases_waits_only_for_the_demand_window() -> None:
    """a holds the budget: refused (its slot share; the one slot is its own), its entry is
    scored at the refusal, as the gateway scores it."""
    ledger = _ledger()
    _scene(ledger)
    assert _ask(ledger, "a", "l5", 20_000, 3.0) is not None
    assert ledger.waiting["a"] == 3.0


def test_a_retry_after_past_the_sdks_bound_is_not_retried() -> None:
    cfg = FleetConfig(replicas=4, duration_s=10.0, warmup_s=0.0, gateways=1, isolation=True)
    sim = FleetSim(cfg, PROFILE)
    far = SimRequest(rid=1, tenant_class="standard", prompt=500, output=OUT, arrival=1.0)
    near = SimRequest(rid=2, tenant_class="standard", prompt=500, output=OUT, arrival=1.0)
    sim._reject(far, 1.0, 121.0, fleet_sim.REFUSED_LONG_BUDGET)
    sim._reject(near, 1.0, 120.0, fleet_sim.REFUSED_LONG_BUDGET)
    assert far.final and far.status == "rejected" and far.attempt == 0 and sim.gave_up == 1
    assert not near.final and near.attempt == 1
    assert [t for t, _, _, p in sim.events if p is near] == [121.0]


def test_a_wait_past_the_retry_after_cap_is_due_back_at_the_earliest_retry_told() -> None:
    """At 1,000 tokens/s a's 100k prompt is due to finish prefilling 190 s after admission:
    b is told the full wait by the budget, its retry-after is capped, and its due-back is the
    earliest retry-after it may be told (``long_context_retry_earliest_ms``), as the script
    records it, not its refusal plus the uncapped wait."""
    ledger = _ledger(rate=1_000.0)
    wait = _scene(ledger)
    assert wait is not None and wait > 120_000
    earliest = long_context_retry_earliest_ms(wait)
    assert earliest < wait
    assert ledger.tier(20_000).very_long  # at 1,000 tokens/s
    assert ledger.due["b"] == SimDue(2_000 + earliest, ledger.prefill_ms(20_000))
    kept = waiting_score(2_000, wait, 15_000, holds=False)
    assert ledger.waiting["b"] == kept / 1000
