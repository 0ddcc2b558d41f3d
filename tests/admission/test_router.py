"""The router (docs/design.md R5): the optimistic in-flight charge lasts until a scrape can
show the request's KV, i.e. a scrape after its first token, not merely the next scrape after
its dispatch."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from contracts import schema
from gateway.admission.config import AdmissionConfig
from gateway.admission.replicas import ReplicaState
from gateway.admission.router import Router

GIB = 1 << 30
CAPACITY_TOKENS = 100_000
BYTES_PER_TOKEN = 1_000


class Registry:
    """A real ``ReplicaState`` per replica, filled the way the scraper fills them."""

    def __init__(self, n: int) -> None:
        self.records = [schema.ReplicaRecord(f"r{i}", f"http://r{i}", "shared") for i in range(n)]
        self.by_id = {r.replica_id: ReplicaState(record=r, version="v") for r in self.records}

    def states(self, version: str) -> Sequence[ReplicaState]:
        return list(self.by_id.values())

    def state(self, replica_id: str) -> ReplicaState | None:
        return self.by_id.get(replica_id)

    def scrape(self, t: float, **usage: float) -> None:
        for rid, s in self.by_id.items():
            s.healthy, s.scraped_at, s.kv_usage = True, t, usage.get(rid, s.kv_usage)


VERSION = schema.ModelVersionRecord(
    "v", "fam", 131_072, BYTES_PER_TOKEN, 50, CAPACITY_TOKENS, replicas=()
)


def make(n: int = 2) -> tuple[Router, Registry, list[float]]:
    reg = Registry(n)
    now = [1.0]
    router = Router(reg, random.Random(1), config=AdmissionConfig(), clock=lambda: now[0])
    reg.scrape(0.9)
    return router, reg, now


def test_charge_survives_scrapes_until_first_token_then_one_more_scrape() -> None:
    router, reg, now = make()
    r0 = reg.records[0]
    long_bytes = 60_000 * BYTES_PER_TOKEN  # a long prompt, 60 % of the replica's KV
    router.on_dispatch(r0, "long", long_bytes)
    for t in (1.25, 1.5, 3.0, 5.0):  # prefill in progress: scrapes show ~nothing of it
        reg.scrape(t, r0=0.05)
        assert router.optimistic_bytes("r0", t) == long_bytes
    now[0] = 5.1
    router.on_first_token(r0, "long")
    assert router.optimistic_bytes("r0", 5.0) == long_bytes  # scrape older than the token
    reg.scrape(5.25, r0=0.65)  # the prefill is now fully allocated and visible
    assert router.optimistic_bytes("r0", 5.25) == 0
    router.on_finish(r0, "long")  # after the charge lapsed: harmless
    assert router.optimistic_bytes("r0", 5.25) == 0


def test_finish_before_first_token_drops_the_charge() -> None:
    router, reg, _ = make()
    r1 = reg.records[1]
    router.on_dispatch(r1, "a", 5 * GIB)
    router.on_dispatch(r1, "b", 7 * GIB)
    router.on_finish(r1, "a")
    assert router.optimistic_bytes("r1", 0.9) == 7 * GIB
    router.on_first_token(r1, "b")
    router.on_first_token(r1, "b")  # repeated / unknown calls are no-ops
    router.on_first_token(r1, "never-dispatched")
    router.on_finish(r1, "b")
    assert router.optimistic_bytes("r1", 0.9) == 0


def test_p2c_avoids_a_replica_whose_long_prefill_the_scrape_cannot_see() -> None:
    router, reg, now = make(2)
    r0 = reg.records[0]
    router.on_dispatch(r0, "long", 60_000 * BYTES_PER_TOKEN)
    picks: Counter[str] = Counter()
    t = 1.0
    for i in range(200):  # 200 short requests over several scrape periods
        t += 0.02
        now[0] = t
        if i % 12 == 0:
            reg.scrape(t, r0=0.10, r1=0.12)  # r0 looks emptier: its prompt is mid-prefill
        rec = router.choose(VERSION, "standard", 500 * BYTES_PER_TOKEN)
        assert rec is not None
        picks[rec.replica_id] += 1
        router.on_dispatch(rec, f"s{i}", 500 * BYTES_PER_TOKEN)
        router.on_first_token(rec, f"s{i}")  # short prompts prefill at once
    assert picks["r0"] == 0  # 0.10 + 0.60 > 0.12 + at most one scrape's shorts
    assert picks["r1"] == 200


def test_standard_ceiling_counts_the_unseen_prefill() -> None:
    router, reg, _ = make(1)
    r0 = reg.records[0]
    router.on_dispatch(r0, "long", 80_000 * BYTES_PER_TOKEN)
    reg.scrape(4.0, r0=0.10)  # many scrapes later, still prefilling
    # 0.10 + 0.80 exceeds standard's 0.85 ceiling: no room, though the scrape alone says 10 %.
    assert router.choose(VERSION, "standard", 1_000) is None
    router.on_first_token(r0, "long")
    reg.scrape(5.0, r0=0.90)
    assert router.choose(VERSION, "reserved", 1_000) is not None  # scrape alone now: 0.90


def test_the_fleet_ledger_shows_long_contexts_another_process_placed() -> None:
    """Process B never placed a long context, but the ledger says the fleet holds one
    replica's worth: B's view of the first designated replica is that full (a long prefill
    is invisible to the scrape for seconds), so its next long context goes to the second."""
    from gateway.admission.placement import long_context_order

    reg = Registry(8)
    now = [1.0]
    router = Router(reg, random.Random(1), config=AdmissionConfig(), clock=lambda: now[0])
    reg.scrape(0.9)
    order = long_context_order("v", [r.replica_id for r in reg.records])
    full = int(CAPACITY_TOKENS * BYTES_PER_TOKEN * 0.85)
    router.note_fleet_long("v", full)
    views = {v.replica_id: v for v in router.views(VERSION)}
    assert views[order[0]].load() >= 0.85 - 1e-9 and views[order[0]].hosts_long
    assert views[order[1]].load() == 0.0
    rec = router.choose(VERSION, "standard", 20_000 * BYTES_PER_TOKEN, long_context=True)
    assert rec is not None and rec.replica_id == order[1]
    # short traffic keeps off the replica the ledger fills
    short = router.choose(VERSION, "standard", 500 * BYTES_PER_TOKEN)
    assert short is not None and short.replica_id != order[0]
