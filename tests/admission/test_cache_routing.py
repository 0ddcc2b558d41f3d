"""Cache-aware replica choice: the expected-cache-hit term of ``gateway.admission.placement.score``
and its chooser (strategy ``cache_aware``) — never above a ceiling, never across a band,
affinity bounded by load, hot prefixes spill, placement the same in every process."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission import config, placement, routing
from gateway.admission.config import AdmissionConfig
from gateway.admission.placement import PlacementRequest, choose, load_bound, score
from gateway.admission.prefix import PrefixQuery, make_query
from gateway.admission.router import Router
from gateway.admission.routing import PrefixTerms, ReplicaView
from gateway.config import GatewayConfig
from tests.admission.test_router import BYTES_PER_TOKEN, CAPACITY_TOKENS, VERSION, Registry

CFG = AdmissionConfig(strategy="cache_aware")
# one gateway process, or KV events feeding the index: a prompt nobody holds goes as P2C's
CFG_EVENTS = AdmissionConfig(strategy="cache_aware", affinity_rendezvous=False)
P2C = AdmissionConfig(strategy="p2c")
CAP = 1_000_000
RATE = 30_000.0  # prompt tokens per second


def view(i: int, occ: float, hit: int = 0, pool: str = "shared") -> ReplicaView:
    return ReplicaView(f"r{i}", pool, occ, 0, CAP, cache_hit_tokens=hit)


def req(
    key: int = 7, tenant: int = 0, cls: config.EffectiveClass = "standard", hinted: bool = False
) -> PlacementRequest:
    return PlacementRequest(cls, 0, prefix=PrefixTerms(key, tenant, RATE, hinted=hinted))


@st.composite
def fleets(draw: st.DrawFn) -> list[ReplicaView]:
    n = draw(st.integers(1, 12))
    designated = draw(st.integers(0, n))
    out = []
    for i in range(n):
        pool = draw(st.sampled_from(["shared", "shared", "reserved"]))
        out.append(
            ReplicaView(
                f"r{i}",
                pool,
                draw(st.floats(0, 1.0)),
                draw(st.integers(0, CAP // 2)),
                CAP,
                long_rank=i if pool == "shared" else -1,
                long_designated=designated,
                hosts_long=draw(st.booleans()),
                cache_hit_tokens=draw(st.sampled_from([0, 0, 16, 4_000, 200_000])),
            )
        )
    return out


requests = st.builds(
    PlacementRequest,
    st.sampled_from(["reserved", "standard", "best_effort"]),
    st.integers(0, CAP // 4),
    st.booleans(),
    st.integers(0, 100),
    prefix=st.builds(
        PrefixTerms, st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.just(RATE)
    ),
)


@settings(max_examples=400, deadline=None)
@given(fleets(), requests, st.integers(0, 2**32))
def test_same_band_as_p2c_and_never_above_the_ceiling_or_the_load_bound(
    views: list[ReplicaView], r: PlacementRequest, seed: int
) -> None:
    """Affinity chooses only among what P2C could choose: the same eligibility and band;
    within it, never above the bound."""
    pick = choose(views, r, CFG, random.Random(seed))
    blind = choose([replace(v, cache_hit_tokens=0) for v in views], r, P2C, random.Random(seed))
    assert (pick is None) == (blind is None)
    if pick is None or blind is None:
        return
    s = score(pick, r, CFG)
    assert s is not None  # eligible: pool, ceiling with the request's own KV, long context
    top = max(b for v in views if (b := score(v, r, CFG)) is not None)
    assert placement.band_of(s) == placement.band_of(top)
    band = [
        v
        for v in views
        if (b := score(v, r, CFG)) is not None and placement.band_of(b) == placement.band_of(top)
    ]
    if not r.long_context and len(band) > 1 and len({v.cache_hit_tokens for v in band}) > 1:
        # the bound guards affinity (some replica holds more of the prompt than another);
        # unmatched traffic, or a hit every candidate holds, takes the better of two, as P2C
        assert pick.load() <= load_bound([v.load() for v in band], CFG) + 1e-12


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.floats(0.0, 0.8), min_size=2, max_size=10),
    holder=st.integers(0, 9),
    key=st.integers(0, 2**64 - 1),
)
def test_a_hot_prefix_spills_when_its_holder_passes_the_bound(
    loads: list[float], holder: int, key: int
) -> None:
    holder %= len(loads)
    views = [view(i, occ, 50_000 if i == holder else 0) for i, occ in enumerate(loads)]
    pick = choose(views, req(key), CFG, random.Random(0))
    bound = load_bound(loads, CFG)
    assert pick is not None and pick.load() <= bound
    if loads[holder] > bound:
        assert pick.replica_id != f"r{holder}"
    else:  # within the bound, 50,000 cached tokens (6.7 s at 0.25 s per unit) win
        assert pick.replica_id == f"r{holder}"


def test_the_saving_is_weighed_against_load() -> None:
    # 8,000 tokens at 30k tok/s = 0.27 s saved > 0.25 s x 0.08 of extra load
    views = [view(0, 0.30), view(1, 0.38, 8_000), view(2, 0.30)]
    assert load_bound([0.30, 0.38, 0.30], CFG) > 0.38
    assert choose(views, req(), CFG, random.Random(0)).replica_id == "r1"  # type: ignore[union-attr]
    # 300 tokens = 0.01 s < 0.02 s: not worth the load
    views = [view(0, 0.30), view(1, 0.38, 300), view(2, 0.30)]
    assert choose(views, req(), CFG, random.Random(0)).replica_id != "r1"  # type: ignore[union-attr]
    # the longer match wins at equal load
    views = [view(0, 0.3, 1_000), view(1, 0.3, 8_000), view(2, 0.3)]
    assert choose(views, req(), CFG, random.Random(0)).replica_id == "r1"  # type: ignore[union-attr]


def test_a_ceiling_and_the_reserved_pool_win_over_any_hit() -> None:
    full = view(0, 0.86, 500_000)  # above the standard ceiling
    pool = view(1, 0.10, 500_000, pool="reserved")  # standard traffic never enters
    other = view(2, 0.50)
    for seed in range(20):
        assert choose([full, pool, other], req(), CFG, random.Random(seed)) is other
    # floor traffic: the reserved pool first even when a shared replica holds the prompt
    shared_hit = view(3, 0.1, 500_000)
    pool_cold = view(4, 0.5, pool="reserved")
    pick = choose([shared_hit, pool_cold], req(cls="reserved"), CFG, random.Random(0))
    assert pick is pool_cold


def test_placement_of_a_new_prefix_is_the_same_in_every_process() -> None:
    views = [view(i, 0.2 + 0.01 * i) for i in range(8)]
    picks = {choose(views, req(12345), CFG, random.Random(s)).replica_id for s in range(20)}  # type: ignore[union-attr]
    assert len(picks) == 1  # a function of the key and the fleet, not of a process's rng
    even = [view(i, 0.2) for i in range(8)]
    spread = Counter(
        choose(even, req(key), CFG, random.Random(0)).replica_id  # type: ignore[union-attr]
        for key in range(4000)
    )
    assert len(spread) == 8 and max(spread.values()) < 2 * 4000 / 8  # keys spread evenly
    # of its key's two rendezvous choices, the less loaded: the busiest never gets one
    assert "r7" not in {
        choose(views, req(key), CFG, random.Random(0)).replica_id  # type: ignore[union-attr]
        for key in range(500)
    }


@settings(max_examples=400, deadline=None)
@given(fleets(), requests, st.integers(0, 2**32))
def test_with_nothing_to_follow_cache_aware_is_p2c(
    views: list[ReplicaView], r: PlacementRequest, seed: int
) -> None:
    """No replica holds any of the prompt, no client hint, no tenant replicas, new prefixes
    not placed by rendezvous: the choice is P2C's own — the same replica from the same rng
    draw, leaving the rng where P2C leaves it — whatever the fleet, class, request size,
    queued prefill or long-context layout. So traffic without shared prefixes (the herd) is
    routed as P2C routes it. (Placed by rendezvous instead it gets uniform, independent
    pairs too, but not P2C's: tails that differ from P2C's by seed noise, see
    bench/results/herd_seeds.md.)"""
    cold = [replace(v, cache_hit_tokens=0, queued_prefill_tokens=seed % 50_000) for v in views]
    assert r.prefix is not None
    r = replace(r, prefix=replace(r.prefix, hinted=False))
    ours, theirs = random.Random(seed), random.Random(seed)
    assert choose(cold, r, CFG_EVENTS, ours) is choose(cold, r, P2C, theirs)
    assert ours.getstate() == theirs.getstate()


@settings(max_examples=400, deadline=None)
@given(fleets(), requests, st.integers(0, 2**32), st.integers(1, 5_000))
def test_a_hit_every_replica_holds_changes_nothing(
    views: list[ReplicaView], r: PlacementRequest, seed: int, common: int
) -> None:
    """A prompt's leading blocks that every replica holds (a chat template's header, a
    tenant's short system prompt) save the same prefill wherever the request goes: the
    choice, and the rng it leaves, are what they would be without them. (Counted as a hit,
    they made every replica a holder, and the holders' best score is the emptiest replica
    on a stale scrape: the herd, bench/results/nn_cache_vs_p2c.)"""

    def plus(n: int) -> list[ReplicaView]:
        return [replace(v, cache_hit_tokens=v.cache_hit_tokens + n) for v in views]

    # a prefix held everywhere is still a held prefix: it keeps the load bound, whatever
    # its length (without KV events the bound applies as soon as anyone holds anything)
    for cfg, base in ((CFG, plus(1)), (CFG_EVENTS, plus(1)), (CFG_EVENTS, views)):
        ours, theirs = random.Random(seed), random.Random(seed)
        pick, other = choose(plus(1 + common), r, cfg, ours), choose(base, r, cfg, theirs)
        assert (pick and pick.replica_id) == (other and other.replica_id)
        assert ours.getstate() == theirs.getstate()


def test_a_prefix_every_replica_holds_does_not_herd_onto_the_emptiest() -> None:
    """Four replicas all holding a tenant's 48-token system prompt, at different loads: new
    requests spread as P2C's pairs spread them (the busiest never, the emptiest about half
    the time), not all onto the emptiest."""
    views = [view(i, 0.10 + 0.02 * i, hit=48) for i in range(4)]
    picks = Counter(
        choose(views, req(key), CFG, random.Random(0)).replica_id  # type: ignore[union-attr]
        for key in range(600)
    )
    assert picks["r3"] == 0 and 0.35 < picks["r0"] / 600 < 0.65 and picks["r2"] > 0
    p2c = Counter(
        choose(views, req(), CFG_EVENTS, random.Random(seed)).replica_id  # type: ignore[union-attr]
        for seed in range(600)
    )
    assert p2c == Counter(
        choose(views, req(), P2C, random.Random(seed)).replica_id  # type: ignore[union-attr]
        for seed in range(600)
    )
    # a prefix held by three of the four: they win over the one without it (4,000 tokens
    # save 0.53 of a replica's load) and spread over two of them as P2C's pairs
    held = [view(i, 0.10 + 0.02 * i, hit=4_000) for i in range(3)] + [view(3, 0.10)]
    picks = Counter(
        choose(held, req(key), CFG, random.Random(0)).replica_id  # type: ignore[union-attr]
        for key in range(600)
    )
    assert set(picks) == {"r0", "r1"} and picks["r1"] > 100
    # one replica holding more than the rest (the conversation's history) is still followed
    views[2] = replace(views[2], cache_hit_tokens=4_000)
    assert all(
        choose(views, req(key), CFG, random.Random(0)).replica_id == "r2"  # type: ignore[union-attr]
        for key in range(50)
    )


def test_a_hint_or_rendezvous_places_a_new_prefix_the_same_in_every_process() -> None:
    views = [view(i, 0.2 + 0.01 * i) for i in range(8)]
    for cfg, hinted in ((CFG, False), (CFG_EVENTS, True)):
        picks = {
            choose(views, req(12345, hinted=hinted), cfg, random.Random(s)).replica_id  # type: ignore[union-attr]
            for s in range(20)
        }
        assert len(picks) == 1
    # without either, each process draws as P2C does: not the same everywhere
    picks = {choose(views, req(12345), CFG_EVENTS, random.Random(s)).replica_id for s in range(20)}  # type: ignore[union-attr]
    assert len(picks) > 1


def test_tenant_placement_keeps_a_tenants_new_prefixes_on_its_replicas() -> None:
    cfg = AdmissionConfig(strategy="cache_aware", affinity_tenant_replicas=2)
    views = [view(i, 0.2) for i in range(8)]
    homes = {
        choose(views, req(key, tenant=99), cfg, random.Random(0)).replica_id  # type: ignore[union-attr]
        for key in range(500)
    }
    assert len(homes) == 2
    # its home replicas past the bound: it spills rather than overloading them
    loaded = [view(i, 0.8 if f"r{i}" in homes else 0.2) for i in range(8)]
    spilled = choose(loaded, req(5, tenant=99), cfg, random.Random(0))
    assert spilled is not None and spilled.replica_id not in homes


def test_router_sends_a_conversations_next_turn_to_its_history_and_spreads_a_hot_prefix() -> None:
    reg = Registry(4)
    now = [1.0]
    router = Router(reg, random.Random(3), config=CFG, clock=lambda: now[0])
    reg.scrape(0.9, r0=0.1, r1=0.1, r2=0.1, r3=0.1)
    salt = "s" * 64
    system = {"role": "system", "content": " ".join(f"sys{i}" for i in range(400))}
    turn1 = [system, {"role": "user", "content": "first question " * 20}]
    q1 = make_query("t", turn1, salt, 16)
    first = router.choose(VERSION, "standard", 1000, prefix=q1)
    assert first is not None
    router.on_dispatch(first, "a", 1000, prefix=q1)
    router.on_first_token(first, "a")  # the turn's prefill is done before the next turn
    turn2 = [*turn1, {"role": "assistant", "content": "answer " * 30}]
    turn2.append({"role": "user", "content": "follow up " * 10})
    q2 = make_query("t", turn2, salt, 16)
    for _ in range(10):
        second = router.choose(VERSION, "standard", 1000, prefix=q2)
        assert second is not None and second.replica_id == first.replica_id
    # the holder gets busy (its scrape well above the load bound): the shared system
    # prompt's new conversations spill off it
    reg.scrape(1.0, **{first.replica_id: 0.6})
    others: Counter[str] = Counter()
    for n in range(20):
        q = make_query("t", [system, {"role": "user", "content": f"q{n} " * 40}], salt, 16)
        pick = router.choose(VERSION, "standard", 1000, prefix=q)
        assert pick is not None and pick.replica_id != first.replica_id
        router.on_dispatch(pick, f"h{n}", 1000, prefix=q)
        router.on_first_token(pick, f"h{n}")
        others[pick.replica_id] += 1
    # new conversations' first turns take the less loaded of the first two replicas within
    # the bound in the system prompt's order, as P2C would: the prompt is cached on two, and
    # no further
    assert 1 <= len(others) <= 2


def test_gateway_processes_blind_to_each_other_send_a_conversations_turns_to_one_replica() -> None:
    """Two gateway processes (each its own index, no KV events): a conversation's later
    turns, whichever process sees them, land on one replica, though each process holds the
    tenant's long system prompt where it placed other conversations; the tenant's
    conversations split over its system prompt's rendezvous pair, by their own keys. (A
    first turn takes the better of two: see the tests below.)"""
    reg = Registry(6)
    reg.scrape(0.9, **{f"r{i}": 0.1 for i in range(6)})
    a, b = (Router(reg, random.Random(seed), config=CFG, clock=lambda: 1.0) for seed in (1, 2))
    salt = "s" * 64
    system = {"role": "system", "content": " ".join(f"sys{i}" for i in range(400))}
    homes: Counter[str] = Counter()
    for n in range(30):
        turn = [system, {"role": "user", "content": f"question {n} " * 20}]
        one, other = (a, b) if n % 2 else (b, a)
        q1 = make_query("t", turn, salt, 16)
        pick1 = one.choose(VERSION, "standard", 1000, prefix=q1)
        assert pick1 is not None
        one.on_dispatch(pick1, f"c{n}-1", 1000, prefix=q1)
        one.on_finish(pick1, f"c{n}-1")
        picks = []
        # the two processes take turns to see the conversation's next turns
        for k, router in enumerate((other, one, other), start=2):
            turn = [*turn, {"role": "assistant", "content": f"answer {k} " * 30}]
            turn.append({"role": "user", "content": f"and then {n} {k} " * 10})
            q = make_query("t", turn, salt, 16)
            pick = router.choose(VERSION, "standard", 1000, prefix=q)
            assert pick is not None
            router.on_dispatch(pick, f"c{n}-{k}", 1000, prefix=q)
            router.on_finish(pick, f"c{n}-{k}")
            picks.append(pick.replica_id)
        assert len(set(picks)) == 1
        homes[picks[0]] += 1
    assert len(homes) == 2 and min(homes.values()) >= 5


def _conversation(n: int, turns: int = 2) -> tuple[PrefixQuery, PrefixQuery]:
    """A conversation's first turn and its ``turns``th, over a tenant's long system prompt."""
    salt = "s" * 64
    system = {"role": "system", "content": " ".join(f"sys{i}" for i in range(400))}
    first = [system, {"role": "user", "content": f"question {n} " * 20}]
    later = first
    for k in range(1, turns):
        later = [*later, {"role": "assistant", "content": f"answer {k} " * 30}]
        later.append({"role": "user", "content": f"and then {n} {k} " * 10})
    return make_query("t", first, salt, 16), make_query("t", later, salt, 16)


def test_a_process_does_not_follow_its_stale_record_of_a_conversation() -> None:
    """A process that placed an earlier turn of a conversation elsewhere (a spill) sends a
    later turn, not the next, to the conversation's replica, as a process that never saw it
    does (the turn between went there through another process); before, it followed its own
    record."""
    reg = Registry(6)
    reg.scrape(0.9, **{f"r{i}": 0.1 for i in range(6)})
    old_cfg = replace(CFG, affinity_conversation_shared=False)
    for n in range(10):
        q1, q2 = _conversation(n, turns=3)
        blind = Router(reg, random.Random(1), config=CFG, clock=lambda: 1.0)
        home = blind.choose(VERSION, "standard", 1000, prefix=q1)
        assert home is not None
        elsewhere = next(r for r in reg.records if r.replica_id != home.replica_id)
        picks = []
        for cfg in (CFG, old_cfg):
            router = Router(reg, random.Random(2), config=cfg, clock=lambda: 1.0)
            router.on_dispatch(elsewhere, f"c{n}", 1000, prefix=q1)
            router.on_finish(elsewhere, f"c{n}")
            pick = router.choose(VERSION, "standard", 1000, prefix=q2)
            assert pick is not None
            picks.append(pick.replica_id)
        assert blind.choose(VERSION, "standard", 1000, prefix=q2) == home
        assert picks == [home.replica_id, elsewhere.replica_id]


def test_a_conversation_leaves_its_replica_on_the_scrape_alone_alike_in_every_process() -> None:
    """Whatever a process has in flight, a conversation stays on its replica while that
    replica's scraped occupancy is at most the bound on the scrape plus the margin, and once
    it is above, every process sends it to the same other replica of the pair."""
    reg = Registry(6)
    now = [2.0]
    for n in range(10):
        _, q1 = _conversation(n)  # a later turn (a first one takes the less loaded of two)
        reg.scrape(1.0, **{f"r{i}": 0.1 for i in range(6)})
        busy = Router(reg, random.Random(1), config=CFG, clock=lambda: now[0])
        idle = Router(reg, random.Random(2), config=CFG, clock=lambda: now[0])
        home = idle.choose(VERSION, "standard", 1000, prefix=q1)
        assert home is not None
        # 0.3 of the replica's KV this process sent there, not scraped yet
        busy.on_dispatch(home, f"big{n}", CAPACITY_TOKENS * BYTES_PER_TOKEN * 3 // 10)
        # scraped 0.35: the bound on the scrape is max(0.142 x 1.25, 0.142 + 0.10) = 0.242
        reg.scrape(1.0, **{home.replica_id: 0.35})
        bound = load_bound([0.35] + [0.1] * 5, CFG)
        assert bound < 0.35 <= bound + CFG.affinity_conversation_margin
        picks = {r.choose(VERSION, "standard", 1000, prefix=q1) for r in (busy, idle)}
        assert picks == {home}
        reg.scrape(1.0, **{home.replica_id: 0.6})
        picks = {r.choose(VERSION, "standard", 1000, prefix=q1) for r in (busy, idle)}
        assert len(picks) == 1 and home not in picks


def test_a_first_turn_takes_the_less_loaded_of_two_and_a_later_turn_its_conversations_replica() -> (
    None
):
    """A conversation's first turn goes to its conversation's replica while that replica is
    no more loaded than the other of its pair (within the request's own share): there, its
    next turn through any process finds it. Once the replica is busier (still under the
    bound plus the margin), a first turn takes the other, as P2C would, while a later turn
    stays where the conversation is."""
    reg = Registry(6)
    for n in range(10):
        q1, q2 = _conversation(n)
        reg.scrape(1.0, **{f"r{i}": 0.1 for i in range(6)})
        router = Router(reg, random.Random(n), config=CFG, clock=lambda: 2.0)
        home = router.choose(VERSION, "standard", 1000, prefix=q2)
        assert router.choose(VERSION, "standard", 1000, prefix=q1) == home
        reg.scrape(1.0, **{home.replica_id: 0.3})  # type: ignore[union-attr]
        assert 0.3 <= load_bound([0.3] + [0.1] * 5, CFG) + CFG.affinity_conversation_margin
        first = router.choose(VERSION, "standard", 1000, prefix=q1)
        assert first is not None and first != home
        assert router.choose(VERSION, "standard", 1000, prefix=q2) == home


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.floats(0.0, 0.6), min_size=2, max_size=10),  # every one under its ceiling
    keys=st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    kv=st.integers(0, CAP // 10),
)
def test_a_first_turn_is_never_placed_above_the_less_loaded_of_its_two(
    loads: list[float], keys: tuple[int, int], kv: int
) -> None:
    """Property: a conversation's first turn goes to one of two replicas, the more loaded
    of them only within the request's own share of a replica; a later turn of the same
    conversation ignores that comparison (its replica, within the bound plus the margin)."""
    views = [view(i, occ) for i, occ in enumerate(loads)]
    placement_key, shared_key = keys
    first = PlacementRequest(
        "standard",
        kv,
        prefix=PrefixTerms(placement_key, 0, RATE, key_tokens=48, shared_key=shared_key),
    )
    pick = choose(views, first, CFG, random.Random(0))
    assert pick is not None
    bound = load_bound(loads, CFG)
    order = routing.rendezvous_order(shared_key, views)
    home = routing.rendezvous_order(placement_key, order[:2])[0]
    eligible = [
        v
        for v in (home, *(v for v in order if v is not home))
        if v.occupancy <= bound + (CFG.affinity_conversation_margin if v is home else 0.0)
    ][:2]
    assert pick in eligible
    assert pick.occupancy <= min(v.occupancy for v in eligible) + kv / CAP + 1e-12
    assert first.prefix is not None
    later = dataclasses.replace(first, prefix=dataclasses.replace(first.prefix, continues=True))
    if home.occupancy <= bound:
        assert choose(views, later, CFG, random.Random(0)) == home


def test_a_turn_follows_the_one_before_it_when_this_process_placed_that_one() -> None:
    """A first turn that went to the other replica of the pair (its conversation's replica
    was busier): the process that placed it sends the second turn after it, where the whole
    history is; a process that did not goes to the conversation's replica, as every process
    does with the rule off. A turn whose previous turn this process did not place (it saw an
    older one) does not follow its record."""
    reg = Registry(6)
    no_latest = replace(CFG, affinity_conversation_latest=False)
    for n in range(10):
        q1, q2 = _conversation(n)
        assert (q1.turns, q2.turns) == (0, 1)
        reg.scrape(1.0, **{f"r{i}": 0.1 for i in range(6)})
        placed, blind, off = (
            Router(reg, random.Random(n), config=cfg, clock=lambda: 2.0)
            for cfg in (CFG, CFG, no_latest)
        )
        home = blind.choose(VERSION, "standard", 1000, prefix=q2)
        assert home is not None
        reg.scrape(1.0, **{home.replica_id: 0.3})  # busier: the first turn goes elsewhere
        first = placed.choose(VERSION, "standard", 1000, prefix=q1)
        assert first is not None and first != home
        for router in (placed, off):
            router.on_dispatch(first, f"c{n}-1", 1000, prefix=q1)
            router.on_finish(first, f"c{n}-1")
        reg.scrape(1.0, **{f"r{i}": 0.1 for i in range(6)})
        assert placed.choose(VERSION, "standard", 1000, prefix=q2) == first
        assert blind.choose(VERSION, "standard", 1000, prefix=q2) == home
        assert off.choose(VERSION, "standard", 1000, prefix=q2) == home
        # the third turn, when the second went through another process: no record of it here
        _, q3 = _conversation(n, turns=3)
        assert q3.turns == 2
        assert placed.choose(VERSION, "standard", 1000, prefix=q3) == home


def test_a_process_that_saw_a_conversation_spill_keeps_it_there_until_under_the_bound() -> None:
    """Hysteresis: between the bound and the bound plus the margin, a process that placed an
    earlier turn of the conversation on another replica (a spill) keeps it there; a process
    that did not see it goes to the conversation's replica; under the bound both do (for the
    turn right after the spill, the process that placed it follows it: the test above)."""
    reg = Registry(6)
    for n in range(10):
        q1, q2 = _conversation(n, turns=3)
        reg.scrape(1.0, **{f"r{i}": 0.1 for i in range(6)})
        blind = Router(reg, random.Random(1), config=CFG, clock=lambda: 2.0)
        saw = Router(reg, random.Random(2), config=CFG, clock=lambda: 2.0)
        home = blind.choose(VERSION, "standard", 1000, prefix=q1)
        assert home is not None
        reg.scrape(1.0, **{home.replica_id: 0.6})
        spill = saw.choose(VERSION, "standard", 1000, prefix=q1)
        assert spill is not None and spill != home
        saw.on_dispatch(spill, f"c{n}", 1000, prefix=q1)
        saw.on_finish(spill, f"c{n}")
        reg.scrape(1.0, **{home.replica_id: 0.35})  # above the bound (0.242), under + margin
        assert saw.choose(VERSION, "standard", 1000, prefix=q2) == spill
        assert blind.choose(VERSION, "standard", 1000, prefix=q2) == home
        reg.scrape(1.0, **{home.replica_id: 0.2})
        assert {r.choose(VERSION, "standard", 1000, prefix=q2) for r in (saw, blind)} == {home}


def test_router_spreads_requests_whose_only_shared_blocks_every_replica_holds() -> None:
    """A tenant's short system prompt soon sits on every replica (its requests went
    everywhere): through the real router and index, a burst of its new requests within one
    scrape spreads over the fleet instead of all landing on the emptiest replica."""
    reg = Registry(4)
    router = Router(reg, random.Random(5), config=CFG, clock=lambda: 1.0)
    reg.scrape(0.9, r0=0.10, r1=0.12, r2=0.14, r3=0.16)
    salt = "s" * 64
    # ~34 tokens with its header: two whole blocks every request of the tenant shares, its
    # placement key (the third block) already the request's own
    system = {"role": "system", "content": "you are a terse and careful helper " * 3}

    def query(n: int) -> PrefixQuery:
        return make_query("t", [system, {"role": "user", "content": f"q{n} " * 30}], salt, 16)

    for i, record in enumerate(reg.records):  # one earlier request on every replica
        router.on_dispatch(record, f"old{i}", 0, prefix=query(1000 + i))
        router.on_finish(record, f"old{i}")
    views = router.with_hits(router.views(VERSION), query(0))
    assert len({v.cache_hit_tokens for v in views}) == 1 and views[0].cache_hit_tokens > 0
    picks = Counter(
        router.choose(VERSION, "standard", 0, prefix=query(n)).replica_id  # type: ignore[union-attr]
        for n in range(200)
    )
    assert len(picks) >= 3 and picks["r0"] < 150


def test_strategy_knobs_from_env() -> None:
    cfg = AdmissionConfig.from_env(
        {
            "GATEWAY_ADMISSION_STRATEGY": "cache_aware",
            "GATEWAY_ADMISSION_AFFINITY_LOAD_FACTOR": "1.5",
            "GATEWAY_ADMISSION_AFFINITY_TENANT_REPLICAS": "4",
            "GATEWAY_ADMISSION_AFFINITY_CONVERSATION_SHARED": "0",
            "GATEWAY_ADMISSION_AFFINITY_CONVERSATION_MARGIN": "0.3",
            "GATEWAY_ADMISSION_AFFINITY_CONVERSATION_FIRST_TURNS": "0",
            "GATEWAY_ADMISSION_AFFINITY_CONVERSATION_LATEST": "0",
        }
    )
    assert not cfg.affinity_conversation_first_turns and not cfg.affinity_conversation_latest
    assert cfg.strategy == "cache_aware" and cfg.affinity_load_factor == 1.5
    assert cfg.affinity_tenant_replicas == 4
    assert not cfg.affinity_conversation_shared and cfg.affinity_conversation_margin == 0.3
    with pytest.raises(ValueError, match="affinity_conversation_margin"):
        AdmissionConfig(affinity_conversation_margin=-0.1)
    with pytest.raises(ValueError, match="affinity_load_factor"):
        AdmissionConfig(affinity_load_factor=0.5)
    with pytest.raises(ValueError, match="affinity_tenant_replicas"):
        AdmissionConfig(affinity_tenant_replicas=-1)


def test_new_prefixes_go_by_rendezvous_unless_kv_events_feed_the_index() -> None:
    events = {"GATEWAY_PREFIX_KV_EVENTS": "r0=tcp://127.0.0.1:5557"}
    assert GatewayConfig.from_env({}).admission.affinity_rendezvous
    assert not GatewayConfig.from_env(events).admission.affinity_rendezvous
    forced = {**events, "GATEWAY_ADMISSION_AFFINITY_RENDEZVOUS": "1"}
    assert GatewayConfig.from_env(forced).admission.affinity_rendezvous


def test_the_router_counts_prefill_it_queued_until_the_first_token() -> None:
    reg = Registry(2)
    router = Router(reg, random.Random(3), config=CFG, clock=lambda: 1.0)
    reg.scrape(0.9, r0=0.1, r1=0.1)
    q = make_query("t", [{"role": "user", "content": "word " * 3000}], "s" * 64, 16)
    pick = router.choose(VERSION, "standard", 1000, prefix=q)
    assert pick is not None
    router.on_dispatch(pick, "a", 1000, prefix=q)
    views = router.with_hits(router.views(VERSION), q)
    queued = {v.replica_id: v.queued_prefill_tokens for v in views}
    assert queued[pick.replica_id] == q.prompt_tokens  # nothing was cached yet
    assert sum(queued.values()) == q.prompt_tokens
    router.on_first_token(pick, "a")
    assert all(v.queued_prefill_tokens == 0 for v in router.with_hits(router.views(VERSION), q))
    # the same prompt again: its expected hit is taken off the queued work
    again = router.choose(VERSION, "standard", 1000, prefix=q)
    assert again is not None and again.replica_id == pick.replica_id
    router.on_dispatch(again, "b", 1000, prefix=q)
    views = router.with_hits(router.views(VERSION), q)
    held = len(q.block_hashes) * 16
    assert {v.replica_id: v.queued_prefill_tokens for v in views}[pick.replica_id] == (
        q.prompt_tokens - held
    )
    router.on_finish(again, "b")
    assert not router.with_hits(router.views(VERSION), q)[0].queued_prefill_tokens


def test_queued_prefill_counts_as_load() -> None:
    """A replica holding the prompt but with seconds of prefill queued there (little KV yet)
    loses to an idle one; the same replica with nothing queued wins."""
    busy = ReplicaView("r0", "shared", 0.05, 0, CAP, cache_hit_tokens=4_000)
    idle = view(1, 0.05)
    assert choose([busy, idle], req(), CFG, random.Random(0)) is busy
    # 2 s of prefill at 30k tok/s beyond the step budget that runs alongside
    queued = replace(busy, queued_prefill_tokens=60_000 + CFG.affinity_queue_free_tokens)
    assert choose([queued, idle], req(), CFG, random.Random(0)) is idle
    s_busy, s_queued = score(busy, req(), CFG), score(queued, req(), CFG)
    assert s_busy is not None and s_queued is not None and s_queued < s_busy
    # up to one step's budget, queued prefill runs alongside: no penalty
    within_step = replace(busy, queued_prefill_tokens=CFG.affinity_queue_free_tokens)
    assert score(within_step, req(), CFG) == s_busy
    # P2C never sees the term: the router fills it only under cache-aware routing
    assert score(replace(idle, queued_prefill_tokens=0), req(), P2C) is not None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.0, 0.84), st.integers(0, 200_000)), min_size=2, max_size=10),
    st.integers(0, 2**64 - 1),
)
def test_without_a_match_queued_prefill_does_not_steer_placement(
    replicas: list[tuple[float, int]], key: int
) -> None:
    """Nobody holds the prompt: every replica is scored as P2C scores it (its queued prompts
    are in its optimistic in-flight KV already), and the pick is the less loaded of the
    placement key's two rendezvous choices (no load bound: P2C has none), whatever prefill is
    queued where. (Charged to every replica, 0.25 s of queued prefill weighed as a whole replica of
    KV and steered the herd by queue length onto full replicas.)"""
    views = [
        ReplicaView(f"r{i}", "shared", occ, 0, CAP, queued_prefill_tokens=queued)
        for i, (occ, queued) in enumerate(replicas)
    ]
    for v in views:
        assert score(v, req(key), CFG) == score(v, req(key), P2C)
    pick = choose(views, req(key), CFG, random.Random(0))
    assert pick is not None
    first_two = routing.rendezvous_order(key, views)[:2]  # unbounded, as P2C's pair
    assert pick in first_two and pick.load() == min(v.load() for v in first_two)
    unqueued = [replace(v, queued_prefill_tokens=0) for v in views]
    assert choose(unqueued, req(key), CFG, random.Random(0)).replica_id == pick.replica_id  # type: ignore[union-attr]


@settings(max_examples=300, deadline=None)
@given(
    st.floats(0.0, 0.84),
    st.integers(0, 200_000),
    st.integers(0, 400_000),
    st.integers(0, 2**64 - 1),
)
def test_a_hit_is_discounted_by_its_queue_and_never_worth_less_than_none(
    occ: float, hit: int, queued: int, key: int
) -> None:
    """Holding the prefix is worth the prefill it saves less the wait behind the prefill
    queued there, never below zero: a holder never scores below itself without the hit."""
    holder = ReplicaView("r0", "shared", occ, 0, CAP, cache_hit_tokens=hit)
    busy = replace(holder, queued_prefill_tokens=queued)
    cold = replace(busy, cache_hit_tokens=0)
    s_hit, s_busy, s_cold = (score(v, req(key), CFG) for v in (holder, busy, cold))
    assert s_hit is not None and s_busy is not None and s_cold is not None
    assert s_cold <= s_busy <= s_hit
    assert s_cold == -occ
