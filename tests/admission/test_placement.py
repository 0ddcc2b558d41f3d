"""The one scoring function of replica choice (gateway/admission/placement.py), property-tested:
ceilings, the reserved pool and long-context placement always win over every other term."""

from __future__ import annotations

import math
import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from contracts import schema
from gateway.admission import classes, config, estimates, long_context, placement
from gateway.admission.config import AdmissionConfig
from gateway.admission.placement import PlacementRequest, choose, score
from gateway.admission.router import Router
from gateway.admission.routing import ReplicaView
from tests.admission.test_router import BYTES_PER_TOKEN, VERSION, make

CFG = AdmissionConfig()
SLOTS = replace(CFG, long_prefill_placement=True)  # placement by prefill slots (off by default)
CAP = 1_000_000
CLASSES = ("reserved", "standard", "best_effort")


@st.composite
def fleets(draw: st.DrawFn) -> list[ReplicaView]:
    n = draw(st.integers(1, 8))
    designated = draw(st.integers(0, n))
    out = []
    shared_rank = 0
    for i in range(n):
        pool = draw(st.sampled_from(["shared", "shared", "reserved"]))
        rank = -1
        if pool == "shared":
            rank, shared_rank = shared_rank, shared_rank + 1
        out.append(
            ReplicaView(
                f"r{i}",
                pool,
                draw(st.floats(0, 1.0)),
                draw(st.integers(0, CAP // 2)),
                CAP,
                long_rank=rank,
                long_designated=designated,
                hosts_long=draw(st.booleans()),
                cache_hit_tokens=draw(st.integers(0, 50_000)),
                long_floor=draw(st.sampled_from([0.0, 0.0, 0.3, 0.9])),
                long_prefills=(prefills := draw(st.integers(0, 3))),
                very_long_prefills=draw(st.integers(0, prefills)),
            )
        )
    return out


requests = st.builds(
    PlacementRequest,
    st.sampled_from(CLASSES),
    st.integers(0, CAP),
    st.booleans(),
    st.integers(0, 100),
    growth_bytes=st.integers(0, CAP // 2),
    very_long=st.booleans(),
)


def slot_free(v: ReplicaView, very_long: bool, cfg: AdmissionConfig = CFG) -> bool:
    """A prefill slot of the tier free on the replica, written out: the budget's tiers per
    replica (a very long prompt: a very long slot and a slot of all; a shorter one: a slot
    of all)."""
    total = cfg.long_prefill_slots_per_replica + cfg.short_long_prefill_slots_per_replica
    if very_long:
        return v.very_long_prefills < cfg.long_prefill_slots_per_replica and v.long_prefills < total
    return v.long_prefills < total


def allowed(v: ReplicaView, r: PlacementRequest, cfg: AdmissionConfig = CFG) -> bool:
    """The hard rules, written out independently of the scoring function."""
    # a long context's expected output growth is reserved with its prompt
    load = v.load() + (r.kv_bytes + (r.growth_bytes if r.long_context else 0)) / v.capacity_bytes
    ceiling = classes.occupancy_ceiling(r.cls, cfg)
    if v.pool == "reserved" and r.cls != "reserved":
        return False
    if not (load <= ceiling if r.cls == "reserved" else load < ceiling):
        return False
    if r.long_context and v.pool != "reserved":
        return 0 <= v.long_rank < v.long_designated
    return True


@settings(max_examples=300, deadline=None)
@given(fleets(), requests, st.integers(0, 2**32))
def test_choice_is_eligible_and_none_only_when_nothing_is(
    views: list[ReplicaView], req: PlacementRequest, seed: int
) -> None:
    for v in views:
        assert (score(v, req, CFG) is not None) == allowed(v, req)
    pick = choose(views, req, CFG, random.Random(seed))
    if pick is None:
        assert not any(allowed(v, req) for v in views)
    else:
        assert allowed(pick, req)


@settings(max_examples=300, deadline=None)
@given(fleets(), requests, st.integers(0, 2**32))
def test_affinity_never_overrides_a_rule(
    views: list[ReplicaView], req: PlacementRequest, seed: int
) -> None:
    """Whatever the expected cache hits, the pick is in the same band as without them."""
    blind = [replace(v, cache_hit_tokens=0) for v in views]
    with_hits = choose(views, req, CFG, random.Random(seed))
    without = choose(blind, req, CFG, random.Random(seed))
    assert (with_hits is None) == (without is None)
    if with_hits is not None and without is not None:
        s1 = score(with_hits, req, CFG)
        s0 = score(replace(without, cache_hit_tokens=0), req, CFG)
        assert s1 is not None and s0 is not None
        assert placement.band_of(s1) == placement.band_of(s0)


@settings(max_examples=200, deadline=None)
@given(fleets(), st.integers(0, CAP // 10), st.integers(0, 2**32))
def test_reserved_floor_traffic_uses_the_pool_first(
    views: list[ReplicaView], kv: int, seed: int
) -> None:
    req = PlacementRequest("reserved", kv)
    pick = choose(views, req, CFG, random.Random(seed))
    pool_ok = [v for v in views if v.pool == "reserved" and allowed(v, req)]
    if pool_ok:
        assert pick is not None and pick.pool == "reserved"


@settings(max_examples=200, deadline=None)
@given(fleets(), st.integers(0, CAP // 4), st.integers(0, 2**32))
def test_long_contexts_pack_onto_the_lowest_ranked_replica_with_room(
    views: list[ReplicaView], kv: int, seed: int
) -> None:
    """Packing by KV, with the prefill slots out of the way (long_prefill_placement off)."""
    off = replace(CFG, long_prefill_placement=False)
    req = PlacementRequest("standard", kv, long_context=True)
    pick = choose(views, req, off, random.Random(seed))
    ok = [v for v in views if allowed(v, req, off)]
    if ok:
        assert pick is not None and pick.long_rank == min(v.long_rank for v in ok)


@settings(max_examples=300, deadline=None)
@given(fleets(), st.integers(0, CAP // 4), st.booleans(), st.integers(0, 2**32))
def test_long_contexts_go_where_a_prefill_slot_of_their_tier_is_free(
    views: list[ReplicaView], kv: int, very_long: bool, seed: int
) -> None:
    """The lowest-ranked designated replica with room among those with a prefill slot of the
    request's tier free; the lowest-ranked with room when none has one (the budget, not
    placement, bounds the fleet's long prefills)."""
    req = PlacementRequest("standard", kv, long_context=True, very_long=very_long)
    pick = choose(views, req, SLOTS, random.Random(seed))
    ok = [v for v in views if allowed(v, req)]
    free = [v for v in ok if slot_free(v, very_long)]
    if not ok:
        assert pick is None
    elif free:
        assert pick is not None and pick.long_rank == min(v.long_rank for v in free)
    else:
        assert pick is not None and pick.long_rank == min(v.long_rank for v in ok)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 3), st.integers(0, 3), st.integers(1, 2), st.integers(0, 2))
def test_prefill_slot_free_is_the_budget_tiers_per_replica(
    prefills: int, very: int, slots: int, lane: int
) -> None:
    cfg = replace(
        CFG, long_prefill_slots_per_replica=slots, short_long_prefill_slots_per_replica=lane
    )
    very = min(very, prefills)
    v = ReplicaView("a", "shared", 0.0, 0, CAP, long_rank=0, long_designated=1,
                    long_prefills=prefills, very_long_prefills=very)  # fmt: skip
    for tier in (True, False):
        req = PlacementRequest("standard", 1, long_context=True, very_long=tier)
        assert placement.prefill_slot_free(v, req, cfg) == slot_free(v, tier, cfg)
    # a shorter prompt may take any slot a very long one may
    long_req = PlacementRequest("standard", 1, long_context=True, very_long=True)
    short_req = PlacementRequest("standard", 1, long_context=True, very_long=False)
    if placement.prefill_slot_free(v, long_req, cfg):
        assert placement.prefill_slot_free(v, short_req, cfg)


def test_a_long_context_avoids_a_replica_prefilling_one_even_with_more_room() -> None:
    """A 128k prompt beside another long prefill shares its replica's steps: the next
    designated replica, emptier or not, takes it; a shorter one may take the lane there."""
    busy = ReplicaView("a", "shared", 0.2, 0, CAP, long_rank=0, long_designated=3,
                       hosts_long=True, long_prefills=1, very_long_prefills=1)  # fmt: skip
    idle = ReplicaView("b", "shared", 0.5, 0, CAP, long_rank=1, long_designated=3)
    views = [busy, idle]
    very = PlacementRequest("standard", 10, long_context=True, very_long=True)
    shorter = PlacementRequest("standard", 10, long_context=True, very_long=False)
    assert choose(views, very, SLOTS, random.Random(0)) is idle
    assert choose(views, shorter, SLOTS, random.Random(0)) is busy  # the lane: packing by KV
    full = replace(busy, long_prefills=2)
    assert choose([full, idle], shorter, SLOTS, random.Random(0)) is idle
    # none free: packing by KV again
    both = [busy, replace(idle, long_prefills=1, very_long_prefills=1)]
    assert choose(both, very, SLOTS, random.Random(0)) is busy
    assert choose(views, very, CFG, random.Random(0)) is busy  # off, the default: by KV


@settings(max_examples=200, deadline=None)
@given(fleets(), st.integers(0, CAP // 100), st.integers(0, 2**32))
def test_short_traffic_keeps_off_long_context_replicas_while_it_has_room(
    views: list[ReplicaView], kv: int, seed: int
) -> None:
    req = PlacementRequest("standard", kv)
    pick = choose(views, req, CFG, random.Random(seed))
    free = [v for v in views if allowed(v, req) and not v.hosts_long]
    if free:
        assert pick is not None and not pick.hosts_long


def _designated(v: ReplicaView) -> bool:
    return v.pool == "shared" and 0 <= v.long_rank < v.long_designated


@settings(max_examples=300, deadline=None)
@given(fleets(), st.integers(0, CAP // 100), st.integers(0, 2**32))
def test_reserved_short_traffic_keeps_off_every_designated_replica_while_it_has_room(
    views: list[ReplicaView], kv: int, seed: int
) -> None:
    """A designated replica that hosts no long context now may host a stack of them within
    a reserved request's decode: reserved short traffic takes a replica that is neither
    designated nor hosting when one is eligible (the reserved pool first, as ever)."""
    req = PlacementRequest("reserved", kv)
    pick = choose(views, req, CFG, random.Random(seed))
    if any(v.pool == "reserved" and allowed(v, req) for v in views):
        return  # the pool first (test_reserved_floor_traffic_uses_the_pool_first)
    clear = [v for v in views if allowed(v, req) and not _designated(v) and not v.hosts_long]
    if clear:
        assert pick is not None and not _designated(pick) and not pick.hosts_long
    # ...and among designated ones, one that hosts nothing before one that does
    idle = [v for v in views if allowed(v, req) and not v.hosts_long]
    if idle:
        assert pick is not None and not pick.hosts_long
    off = choose(views, req, replace(CFG, reserved_off_long_replicas=False), random.Random(seed))
    if idle:  # without the rule: as other short traffic, off the hosting replicas only
        assert off is not None and not off.hosts_long


@settings(max_examples=300, deadline=None)
@given(fleets(), st.integers(0, CAP // 4), st.integers(0, CAP // 4), st.integers(0, 2**32))
def test_reserved_long_contexts_take_the_pool_only_when_no_designated_replica_has_room(
    views: list[ReplicaView], kv: int, growth: int, seed: int
) -> None:
    """With ``reserved_long_off_pool`` (off by default), a reserved long context packs onto
    the designated shared replicas as any other long context; the reserved pool is its last
    resort (R2: refused only when no replica qualifies). With the rule off, the pool first."""
    req = PlacementRequest("reserved", kv, long_context=True, growth_bytes=growth)
    pick = choose(views, req, replace(CFG, reserved_long_off_pool=True), random.Random(seed))
    shared_ok = [v for v in views if v.pool == "shared" and allowed(v, req)]
    pool_ok = [v for v in views if v.pool == "reserved" and allowed(v, req)]
    if shared_ok:
        assert pick is not None and pick.pool == "shared"
        assert pick.long_rank == min(v.long_rank for v in shared_ok)
    elif pool_ok:
        assert pick is not None and pick.pool == "reserved"
    else:
        assert pick is None
    before = choose(views, req, CFG, random.Random(seed))
    if pool_ok:
        assert before is not None and before.pool == "reserved"
    # short floor traffic still takes the pool first either way
    short = choose(views, replace(req, long_context=False), CFG, random.Random(seed))
    if any(v.pool == "reserved" and allowed(v, replace(req, long_context=False)) for v in views):
        assert short is not None and short.pool == "reserved"


def test_only_reserved_traffic_keeps_off_an_idle_designated_replica() -> None:
    """The emptier replica is designated (hosting nothing): standard traffic takes it, as
    before; reserved traffic takes the other one, unless the rule is off."""
    views = [
        ReplicaView("d", "shared", 0.1, 0, CAP, long_rank=0, long_designated=1),
        ReplicaView("n", "shared", 0.5, 0, CAP, long_rank=1, long_designated=1),
    ]
    for seed in range(20):
        rng = random.Random(seed)
        assert choose(views, PlacementRequest("standard", 1000), CFG, rng) is views[0]
        assert choose(views, PlacementRequest("reserved", 1000), CFG, rng) is views[1]
        off = replace(CFG, reserved_off_long_replicas=False)
        assert choose(views, PlacementRequest("reserved", 1000), off, rng) is views[0]
        # a long context still goes to the designated one, whatever its class
        long_req = PlacementRequest("reserved", 1000, long_context=True)
        assert choose(views, long_req, CFG, rng) is views[0]


def test_the_request_own_kv_counts_against_the_ceiling() -> None:
    v = ReplicaView("a", "shared", 0.50, 0, CAP)
    assert score(v, PlacementRequest("standard", CAP // 10), CFG) is not None  # 0.60
    assert score(v, PlacementRequest("standard", CAP * 4 // 10), CFG) is None  # 0.90
    old = AdmissionConfig(count_request_kv=False)
    assert score(v, PlacementRequest("standard", CAP * 4 // 10), old) is not None


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0.0, 0.85),
    st.integers(0, CAP // 2),
    st.integers(0, CAP // 2),
    st.sampled_from(CLASSES[1:]),
)
def test_a_long_context_reserves_its_output_growth_against_the_ceiling(
    occ: float, kv: int, growth: int, cls: config.EffectiveClass
) -> None:
    """A long context fits only if its prompt and its expected decode KV both fit under
    the ceiling; a short request's ceiling check is its prompt alone."""
    v = ReplicaView("a", "shared", occ, 0, CAP, long_rank=0, long_designated=1)
    ceiling = classes.occupancy_ceiling(cls, CFG)
    long_req = PlacementRequest(cls, kv, long_context=True, growth_bytes=growth)
    assert (score(v, long_req, CFG) is not None) == (occ + (kv + growth) / CAP < ceiling)
    short = PlacementRequest(cls, kv, growth_bytes=growth)
    assert (score(v, short, CFG) is not None) == (occ + kv / CAP < ceiling)


def test_the_router_keeps_a_long_contexts_growth_reserved_until_it_finishes() -> None:
    router, reg, _ = make(2)
    reg.scrape(0.95, r0=0.10, r1=0.10)
    capacity = VERSION.kv_capacity_tokens * VERSION.kv_bytes_per_token
    growth = capacity // 10
    rec = router.choose(VERSION, "standard", 1000, long_context=True, growth_bytes=growth)
    assert rec is not None
    router.on_dispatch(rec, "long", 1000, long_context=True, growth_bytes=growth)
    router.on_first_token(rec, "long")
    loads = {v.replica_id: v.load() for v in router.views(VERSION)}
    # prefilled (its prompt is the scrape's from here on) but its decode KV is still to come
    assert loads[rec.replica_id] >= 0.10 + 0.1 - 1e-9
    router.on_finish(rec, "long")
    assert {v.replica_id: v.load() for v in router.views(VERSION)}[rec.replica_id] < 0.11


def test_the_router_counts_its_long_prefills_per_replica_until_their_first_token() -> None:
    """Its own long contexts from dispatch to first token, per replica and tier: a very long
    prompt avoids the designated replica prefilling one, a shorter one takes the lane there,
    and the first token frees the slot."""
    router, reg, now = make(8)  # 8 shared replicas: 2 designated
    router = Router(reg, random.Random(1), config=SLOTS, clock=lambda: now[0])
    reg.scrape(0.95, **{f"r{i}": 0.10 for i in range(8)})
    version = replace(VERSION, prefill_tokens_per_s=1000.0, ttft_target_ms=1000)
    very, shorter = 8_000 * BYTES_PER_TOKEN, 1_500 * BYTES_PER_TOKEN
    assert router.very_long(version, very) and not router.very_long(version, shorter)
    first = router.choose(version, "standard", very, long_context=True)
    assert first is not None
    router.on_dispatch(first, "long-1", very, long_context=True, very_long=True)
    assert router.long_prefills(version.version, first.replica_id) == (1, 1)
    second = router.choose(version, "standard", very, long_context=True)
    assert second is not None and second.replica_id != first.replica_id
    lane = router.choose(version, "standard", shorter, long_context=True)
    assert lane is not None and lane.replica_id == first.replica_id
    router.on_first_token(first, "long-1")
    assert router.long_prefills(version.version, first.replica_id) == (0, 0)
    again = router.choose(version, "standard", very, long_context=True)
    assert again is not None and again.replica_id == first.replica_id
    # what the other processes placed there, noted from a shared record, counts as well
    router.note_long_prefills(version.version, {first.replica_id: (1, 1)})
    assert router.long_prefills(version.version, first.replica_id) == (1, 1)
    other = router.choose(version, "standard", very, long_context=True)
    assert other is not None and other.replica_id != first.replica_id
    router.on_finish(first, "long-1")


def test_plain_p2c_when_context_placement_is_off() -> None:
    off = AdmissionConfig(context_placement=False)
    views = [
        ReplicaView("a", "shared", 0.1, 0, CAP, long_rank=5, long_designated=1),
        ReplicaView("b", "shared", 0.2, 0, CAP, long_rank=0, long_designated=1, hosts_long=True),
    ]
    req = PlacementRequest("standard", 10, long_context=True)
    assert choose(views, req, off, random.Random(0)) is views[0]  # the emptier: no packing
    assert choose(views, req, CFG, random.Random(0)) is views[1]  # the designated replica


@given(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=12, unique=True))
def test_long_context_order_is_the_same_in_every_process(ids: list[str]) -> None:
    order = placement.long_context_order("v1", ids)
    assert sorted(order) == sorted(ids)
    assert placement.long_context_order("v1", list(reversed(ids))) == order
    # a replica leaving keeps the others' relative order (rendezvous hashing)
    if len(ids) > 1:
        gone = ids[0]
        rest = placement.long_context_order("v1", ids[1:])
        assert rest == [r for r in order if r != gone]


def test_thresholds_follow_the_replica_profile() -> None:
    v = schema.ModelVersionRecord(
        "v", "f", 131_072, 327_680, 40, 560_000, prefill_tokens_per_s=10_000, ttft_target_ms=1000
    )
    assert estimates.long_context_threshold(v) == 10_000  # a prefill of one TTFT target
    assert estimates.prefill_seconds(128_000, v) == 12.8
    faster = replace(v, prefill_tokens_per_s=28_000)
    assert estimates.long_context_threshold(faster) == 28_000
    unknown = replace(v, prefill_tokens_per_s=0.0)  # not pushed: nothing is a long context
    assert estimates.long_context_threshold(unknown) > 10**15
    kv, slots = long_context.long_context_budget(v, 8, "standard", CFG)
    assert slots == 2 and kv == int(2 * 560_000 * 327_680 * 0.85)
    assert long_context.long_context_budget(v, 1, "standard", CFG)[1] == 1  # a lone replica


def test_reserved_long_off_pool_knob_from_env() -> None:
    assert not AdmissionConfig.from_env({}).reserved_long_off_pool  # off by default
    env = {"GATEWAY_ADMISSION_RESERVED_LONG_OFF_POOL": "1"}
    assert AdmissionConfig.from_env(env).reserved_long_off_pool


def packed_in_order(fleet: int, n: int, cfg: AdmissionConfig = CFG) -> list[float]:
    """The order-packing floor, written out: replica ``r`` holds the fleet's long-context
    KV beyond ``r`` replicas filled to the standard ceiling, at most one replica's worth."""
    per = CAP * cfg.standard_max_occupancy
    return [min(per, max(0.0, fleet - r * per)) / CAP for r in range(n)]


placed_kv = st.lists(st.integers(0, CAP), max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10 * CAP), st.integers(0, 8))
def test_with_nothing_placed_the_floor_packs_the_fleets_kv_in_order(fleet: int, n: int) -> None:
    """No replica recorded for any lease (the gateway's ledger today): the floor is exactly
    the order packing the router charged before per-replica records existed."""
    assert placement.long_floors(fleet, [0] * n, CAP, CFG) == packed_in_order(fleet, n)
    # the router's per-replica form of it, without a record (the default)
    assert [placement.packed_floor(fleet, r, CAP, CFG) for r in range(n)] == packed_in_order(
        fleet, n
    )


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10 * CAP), placed_kv)
def test_the_floor_charges_each_replica_its_own_and_packs_only_the_rest(
    fleet: int, placed: list[int]
) -> None:
    """Each replica is charged at least the KV placed on it; on top, only the KV with no
    recorded replica, in order, into the room left under the standard ceiling, never more
    of it than there is."""
    floors = placement.long_floors(fleet, placed, CAP, CFG)
    per = CAP * CFG.standard_max_occupancy
    extra = [f * CAP - b for f, b in zip(floors, placed, strict=True)]
    rest = max(0, fleet - sum(placed))
    for b, e in zip(placed, extra, strict=True):
        assert e >= -1e-6 and b + e <= max(b, per) + 1e-6
    assert sum(extra) <= rest + 1e-6
    # in order: a replica gets unplaced KV only once every lower rank is full
    for r, e in enumerate(extra):
        if e > 1e-6:
            assert all(placed[i] + extra[i] >= per - 1e-6 for i in range(r))
    room = sum(max(0.0, per - b) for b in placed)
    assert math.isclose(sum(extra), min(rest, room), abs_tol=1e-3)


@settings(max_examples=300, deadline=None)
@given(placed_kv)
def test_a_fully_recorded_fleet_is_charged_where_its_long_contexts_are(placed: list[int]) -> None:
    """Every lease's replica known: each replica's floor is its own long-context KV, however
    they spread over the order (placement by prefill slots spreads them)."""
    floors = placement.long_floors(sum(placed), placed, CAP, CFG)
    assert floors == [b / CAP for b in placed]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10 * CAP), placed_kv, st.data())
def test_recording_a_leases_replica_raises_no_other_replicas_floor(
    fleet: int, placed: list[int], data: st.DataObject
) -> None:
    """Knowing where one more lease runs only takes an assumption away: its replica may be
    charged more, no other replica is charged more than before."""
    if not placed:
        return
    j = data.draw(st.integers(0, len(placed) - 1))
    kv = data.draw(st.integers(0, max(0, fleet - sum(placed))))
    before = placement.long_floors(fleet, placed, CAP, CFG)
    after = placement.long_floors(
        fleet, [b + kv if i == j else b for i, b in enumerate(placed)], CAP, CFG
    )
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if i != j:
            assert a <= b + 1e-9


def test_the_router_charges_long_contexts_where_the_shared_record_placed_them() -> None:
    """The fleet holds two replicas' worth of long-context KV, placed on the 2nd and 3rd
    designated replicas (spread by prefill slots). Packed in order, the floor says the 1st
    and 2nd are full and sends the next long context to the 3rd, which is full; with the
    record of where each lease runs, the 1st is empty and takes it."""
    router, reg, now = make(16)  # 16 shared replicas: 4 designated
    reg.scrape(0.95, **{f"r{i}": 0.0 for i in range(16)})
    order = placement.long_context_order(VERSION.version, [r.replica_id for r in reg.records])
    capacity = VERSION.kv_capacity_tokens * VERSION.kv_bytes_per_token
    full = int(capacity * CFG.standard_max_occupancy)
    prompt = 20_000 * BYTES_PER_TOKEN
    router.note_fleet_long(VERSION.version, 2 * full)
    blind = {v.replica_id: v for v in router.views(VERSION)}
    assert blind[order[0]].hosts_long and blind[order[1]].hosts_long
    assert not blind[order[2]].hosts_long
    blind_pick = router.choose(VERSION, "standard", prompt, long_context=True)
    assert blind_pick is not None and blind_pick.replica_id == order[2]
    router.note_placed_long(VERSION.version, {order[1]: full, order[2]: full})
    seen = {v.replica_id: v for v in router.views(VERSION)}
    assert seen[order[0]].load() == 0.0 and not seen[order[0]].hosts_long
    assert seen[order[2]].load() >= CFG.standard_max_occupancy - 1e-9 and seen[order[2]].hosts_long
    pick = router.choose(VERSION, "standard", prompt, long_context=True)
    assert pick is not None and pick.replica_id == order[0]
    # short traffic keeps off the replicas the record says host long contexts
    short = router.choose(VERSION, "standard", 500 * BYTES_PER_TOKEN)
    assert short is not None and short.replica_id not in (order[1], order[2])
