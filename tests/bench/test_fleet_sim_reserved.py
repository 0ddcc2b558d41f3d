"""The fleet simulation's reserved-class accounting: which requests could meet the TTFT SLO
at all, per-request attainment of both SLOs with the misses split by SLO and cause, the
drain that lets measured requests finish, and the reserved pool."""

from __future__ import annotations

import math

import pytest

from bench import fleet_sim
from bench.fleet_sim import (
    CAUSE_FULL_DECODE,
    CAUSE_LONG_PREFILL,
    CAUSE_NEVER_SERVED,
    CAUSE_PREEMPTED_DECODE,
    CAUSE_PREEMPTED_PREFILL,
    CAUSE_QUEUED,
    CAUSE_RETRIED,
    CAUSE_SLOW_PREFILL,
    FleetConfig,
    FleetSim,
    SimRequest,
    class_slo,
    miss_causes,
    slo_missed,
)
from bench.stats import lone_prefill_feasible
from emulator.profiles import LLAMA_70B_TP4_H100, get_profile


def _req(
    arrival: float = 10.0,
    sent: float | None = None,
    scheduled: float | None = None,
    first: float | None = 10.2,
    done: float | None = 13.2,
    output: int = 101,
    prompt: int = 500,
    status: str = "ok",
    replica: int = 0,
) -> SimRequest:
    r = SimRequest(rid=1, tenant_class="reserved", prompt=prompt, output=output, arrival=arrival)
    r.sent = arrival if sent is None else sent
    r.scheduled = r.sent if scheduled is None else scheduled
    r.first_token, r.finished, r.status, r.final = first, done, status, True
    r.replica = replica
    return r


def test_feasible_is_the_lone_prefill_under_the_ttft_slo() -> None:
    p = LLAMA_70B_TP4_H100
    limit = fleet_sim._feasible_limit(p)
    assert p.prefill_seconds(limit - 1) < 1.0 <= p.prefill_seconds(limit)
    assert lone_prefill_feasible(limit - 1) and not lone_prefill_feasible(limit)
    assert lone_prefill_feasible(800) and not lone_prefill_feasible(128_000)
    # a slower profile (or a tighter target) makes fewer prompts feasible
    assert not lone_prefill_feasible(limit - 1, ttft_s=0.5)


def test_every_feasible_prompt_is_short_traffic_to_the_gateway() -> None:
    """The gateway's long-context threshold (prefill alone at least the TTFT target, from the
    rate the simulated version advertises) is where feasibility ends: a feasible reserved
    request is never placed as a long context."""
    sim = FleetSim(FleetConfig(replicas=2, gateways=1, isolation=True), LLAMA_70B_TP4_H100)
    assert sim.long_threshold == fleet_sim._feasible_limit(LLAMA_70B_TP4_H100)


def test_slo_missed_counts_ttft_from_the_first_arrival() -> None:
    assert slo_missed(_req()) == (False, False)  # TTFT 0.2 s, TPOT 30 ms
    # the 503 waits count: sent 0.9 s after arriving, first token 0.2 s after that
    assert slo_missed(_req(sent=10.9, first=11.1, done=14.1)) == (True, False)
    assert slo_missed(_req(done=10.2 + 100 * 0.05)) == (False, True)  # TPOT exactly 50 ms
    assert slo_missed(_req(output=1, done=10.2)) == (False, False)  # one token: no TPOT
    # never served: a TTFT miss, no TPOT
    assert slo_missed(_req(status="rejected", first=None, done=None)) == (True, False)


def test_ttft_miss_goes_to_the_largest_part_of_the_wait() -> None:
    lone = LLAMA_70B_TP4_H100.prefill_seconds(500)
    retried = _req(sent=10.8, scheduled=10.85, first=11.1, done=14.1)
    assert miss_causes(retried, []) == (CAUSE_RETRIED,)
    queued = _req(scheduled=10.9, first=11.0, done=14.0)
    assert miss_causes(queued, []) == (CAUSE_QUEUED,)
    stretched = _req(scheduled=10.1, first=11.2, done=14.2)  # 1.1 s of prefill for ~36 ms
    assert lone < 0.05
    assert miss_causes(stretched, []) == (CAUSE_SLOW_PREFILL,)
    preempted = _req(scheduled=10.1, first=11.2, done=14.2)
    preempted.preempted_before_first = preempted.preemptions = 1
    assert miss_causes(preempted, []) == (CAUSE_PREEMPTED_PREFILL,)
    assert miss_causes(_req(status="rejected", first=None, done=None), []) == (CAUSE_NEVER_SERVED,)


def test_tpot_miss_goes_to_the_kind_of_slow_step_that_took_its_decode() -> None:
    slow = _req(first=10.2, done=10.2 + 100 * 0.06)  # TPOT 60 ms
    prefill_steps = [(11.0, 11.6, 8192, 40), (12.0, 12.6, 8000, 41)]  # chunks in the batch
    decode_steps = [(13.0, 13.06, 40, 40)]  # a decode-only step over 50 ms
    assert miss_causes(slow, prefill_steps + decode_steps) == (CAUSE_LONG_PREFILL,)
    many_decode = [(10.3 + 0.06 * i, 10.36 + 0.06 * i, 40, 40) for i in range(50)]
    assert miss_causes(slow, many_decode) == (CAUSE_FULL_DECODE,)
    # steps outside its decode (before its first token, after it finished) do not count
    outside = [(9.0, 10.2, 8192, 10), (16.3, 17.0, 8192, 10)]
    assert miss_causes(slow, sorted(outside + many_decode)) == (CAUSE_FULL_DECODE,)
    slow.preemptions = 1  # preempted after its first token
    assert miss_causes(slow, prefill_steps) == (CAUSE_PREEMPTED_DECODE,)
    # missed both: one cause per SLO
    both = _req(scheduled=11.0, first=11.1, done=11.1 + 100 * 0.06)
    assert miss_causes(both, [(11.5, 12.1, 8192, 5)]) == (CAUSE_QUEUED, CAUSE_LONG_PREFILL)
    assert miss_causes(_req(), prefill_steps) == ()  # met both


def test_class_slo_counts_and_splits_the_misses() -> None:
    steps = [[(11.0, 11.6, 8192, 40), (12.0, 12.6, 8192, 40)]]
    reqs = [
        _req(),
        _req(),
        _req(scheduled=10.9, first=11.0, done=14.0),  # TTFT: queued
        _req(first=10.2, done=10.2 + 100 * 0.06),  # TPOT: prefill chunks
        _req(scheduled=11.0, first=11.1, done=11.1 + 100 * 0.06),  # both
        _req(status="rejected", first=None, done=None),  # never served
    ]
    c = class_slo(reqs, steps)
    assert (c.n, c.met, c.missed, c.ttft_missed, c.tpot_missed) == (6, 2, 4, 3, 2)
    assert c.attainment == pytest.approx(2 / 6)
    assert c.causes == ((CAUSE_NEVER_SERVED, 1), (CAUSE_QUEUED, 2), (CAUSE_LONG_PREFILL, 2))
    assert math.isnan(class_slo([], steps).attainment)


def test_drain_lets_measured_requests_finish_with_the_same_arrivals() -> None:
    base = FleetConfig(replicas=3, rate_rps=8.0, duration_s=8.0, warmup_s=2.0, gateways=1)
    profile = get_profile(fleet_sim.PROFILE)
    cut = FleetSim(base, profile).run()
    drained = FleetSim(fleet_sim.replace(base, drain_s=120.0), profile).run()
    first = [(r.arrival, r.prompt, r.output) for r in cut.requests]
    assert [(r.arrival, r.prompt, r.output) for r in drained.requests[: len(first)]] == first
    assert any(r.arrival >= base.duration_s for r in drained.requests)  # the load goes on
    assert cut.censored() > 0 and drained.censored() == 0
    assert all(r.arrival < base.duration_s for r in drained.measured())
    assert len(drained.measured()) == len(cut.measured()) + cut.censored()


def test_reserved_pool_takes_only_reserved_traffic() -> None:
    cfg = FleetConfig(replicas=4, rate_rps=10.0, duration_s=10.0, warmup_s=0.0, gateways=2,
                      isolation=True, reserved_replicas=1, class_mix=(0.3, 0.5, 0.2))  # fmt: skip
    res = FleetSim(cfg, get_profile(fleet_sim.PROFILE)).run()
    served = [r for r in res.requests if r.replica >= 0]
    assert all(r.tenant_class == "reserved" for r in served if r.replica == 0)
    reserved = [r for r in served if r.tenant_class == "reserved"]
    assert reserved and sum(r.replica == 0 for r in reserved) > len(reserved) / 2


def test_reserved_long_contexts_keep_out_of_the_pool_while_the_designated_have_room() -> None:
    """Reserved traffic only, a pool of 2 of 8 replicas: with ``reserved_long_off_pool`` the
    class's long contexts go to the designated shared replicas, without it to the pool first."""
    cfg = FleetConfig(replicas=8, rate_rps=12.0, duration_s=60.0, warmup_s=0.0, gateways=2,
                      isolation=True, reserved_replicas=2, class_mix=(1.0, 0.0, 0.0))  # fmt: skip
    in_pool: dict[bool, float] = {}
    for rule in (True, False):
        res = FleetSim(
            fleet_sim.replace(cfg, reserved_long_off_pool=rule), get_profile(fleet_sim.PROFILE)
        )
        longs = [
            r for r in res.run().requests if r.replica >= 0 and not lone_prefill_feasible(r.prompt)
        ]
        assert longs
        in_pool[rule] = sum(r.replica < cfg.reserved_replicas for r in longs) / len(longs)
    # without the rule most go to the pool (the rest when the pool is full)
    assert in_pool[True] == 0.0 and in_pool[False] > 0.5


def test_pool_slo_sums_runs_and_their_causes() -> None:
    from bench.fleet_sim import ClassSLO, pool_slo

    a = ClassSLO(n=1000, met=998, ttft_missed=1, tpot_missed=1,
                 causes=((CAUSE_QUEUED, 1), (CAUSE_LONG_PREFILL, 1)))  # fmt: skip
    b = ClassSLO(n=2000, met=1999, ttft_missed=1, tpot_missed=0, causes=((CAUSE_QUEUED, 1),))
    both = pool_slo([a, b])
    assert (both.n, both.met, both.ttft_missed, both.tpot_missed) == (3000, 2997, 2, 1)
    assert both.causes == ((CAUSE_QUEUED, 2), (CAUSE_LONG_PREFILL, 1))  # in CAUSES order
    assert both.attainment == pytest.approx(0.999)
    assert pool_slo([]).n == 0 and math.isnan(pool_slo([]).attainment)
