"""The fleet simulation's "never served" accounting: each refused attempt records what it ran
into, and the sizing table says what the requests never served ran into."""

from __future__ import annotations

from bench import fleet_sim
from bench.fleet_sim import (
    REFUSED_LONG_BUDGET,
    REFUSED_NO_REPLICA,
    REFUSED_REPLICA_DOWN,
    FleetConfig,
    FleetSim,
    SimRequest,
    never_served_by,
    never_served_cell,
)
from bench.sim import SimLease
from emulator.profiles import get_profile


def _resolved(rid: int, status: str, refusal: str = "") -> SimRequest:
    r = SimRequest(rid=rid, tenant_class="standard", prompt=500, output=100, arrival=1.0)
    r.status, r.final, r.refusal = status, True, refusal
    return r


def test_never_served_counts_only_resolved_refusals_by_their_last_cause() -> None:
    reqs = [
        _resolved(1, "ok", REFUSED_LONG_BUDGET),  # refused once, then served: not counted
        _resolved(2, "rejected", REFUSED_LONG_BUDGET),
        _resolved(3, "rejected", REFUSED_NO_REPLICA),
        _resolved(4, "rejected", REFUSED_LONG_BUDGET),
        _resolved(5, "error", REFUSED_REPLICA_DOWN),
    ]
    pending = _resolved(6, "rejected", REFUSED_NO_REPLICA)
    pending.final = False  # still retrying at the end: censored, not never served
    by = never_served_by([*reqs, pending])
    assert by == {REFUSED_LONG_BUDGET: 2, REFUSED_NO_REPLICA: 1, REFUSED_REPLICA_DOWN: 1}
    assert list(by) == [REFUSED_LONG_BUDGET, REFUSED_NO_REPLICA, REFUSED_REPLICA_DOWN]
    assert never_served_by(reqs[:1]) == {}


def test_never_served_cell_gives_the_share_and_the_causes() -> None:
    assert never_served_cell(0.0, {}) == "0.0 %"
    cell = never_served_cell(0.0021, {REFUSED_LONG_BUDGET: 24})
    assert cell.endswith(f"(24: {REFUSED_LONG_BUDGET} 24)")


def test_a_long_prompt_the_budget_refuses_on_every_attempt_is_never_served_by_it() -> None:
    """The long-context budget's one prefill slot (4 replicas: 1 designated; no lane) is held
    by another tenant's long prefill: a long prompt whose client tries once is refused by the
    budget and ends never served, with that cause."""
    cfg = FleetConfig(replicas=4, duration_s=10.0, warmup_s=0.0, gateways=1, isolation=True,
                      max_attempts=1, lane_slots=0)  # fmt: skip
    sim = FleetSim(cfg, get_profile(fleet_sim.PROFILE))
    sim.ledger.leases["0.0"] = SimLease("other", 1_000 * sim.kv_bytes, 100.0)  # prefilling
    r = SimRequest(rid=1, tenant_class="standard", prompt=20_000, output=100, arrival=1.0,
                   tenant="t1")  # fmt: skip
    assert r.prompt >= sim.long_threshold
    sim.now = 1.0
    sim._arrive(r, 1.0)
    assert r.final and r.status == "rejected" and r.rejections == 1
    assert r.refusal == REFUSED_LONG_BUDGET
    assert never_served_by([r]) == {REFUSED_LONG_BUDGET: 1}
