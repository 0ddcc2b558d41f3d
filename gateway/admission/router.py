"""Replica choice within a model version's fleet (docs/design.md R5): power of two random choices
scored by last scraped KV occupancy plus this gateway's optimistic in-flight KV.

The scrape is ~250 ms stale; in that window a busy gateway makes dozens of decisions, and
"pick the emptiest" sends all of them to the same replica (C5's herd). Two changes, both
needed: choose the less loaded of two random eligible replicas, and add to each replica's
scraped occupancy the KV this router has dispatched to it that the scrape cannot show yet.

When can a scrape show it? Not at the first scrape after dispatch: with chunked prefill a
replica allocates a prompt's KV chunk by chunk (and a request may wait in its queue first),
so a 128k prompt is invisible for seconds while it holds the replica's whole prefill budget.
So an entry counts until a scrape taken after the request's *first token* (its prefill is then
complete and fully allocated; ``inflight_grace_s`` later, to be safe), or its finish, whichever
comes first. The relay reports first tokens with ``on_first_token``; a request whose first
token is never reported (a non-streamed response) counts until it finishes — conservative.
Before its first token an entry may overlap the chunks already allocated (bounded by its
prompt, for its prefill's duration): the charge doubles as the replica's outstanding prefill
work seen from this process, which is what keeps P2C off a replica chewing on a long prompt.
The record is soft state, per process, never persisted or shared.

The decisions themselves are the pure functions of ``gateway.admission`` policy modules (class
ceilings, reserved pool, P2C, cache affinity); ``bench/herd.py`` and ``bench/prefix_routing.py``
drive this same class in virtual time.

Cache affinity (strategy ``cache_aware``): a request that comes with a
``gateway.admission.prefix.PrefixQuery`` is matched against the process's ``PrefixIndex`` (which
replica holds how many of its leading blocks) and the views carry it as
``cache_hit_tokens``, with the prefill this process queued on each replica, into
``gateway.admission.placement`` (the one scoring function, ``_choose_cache_aware``). Its blocks are
recorded against the chosen replica at dispatch, so a conversation's next turn finds its
history there. The choice hashes the prompt only as far as some replica holds it; the
dispatch then hashes and records the whole prompt at once (see ``on_dispatch``).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from contracts import schema
from gateway.admission.config import AdmissionConfig, EffectiveClass
from gateway.admission.long_context import long_context_tier
from gateway.admission.placement import (
    PlacementRequest,
    long_context_order,
    long_context_replicas,
    long_floors,
    packed_floor,
)
from gateway.admission.placement import choose as place
from gateway.admission.prefix import PrefixIndex, PrefixQuery
from gateway.admission.replicas import ReplicaState
from gateway.admission.routing import PrefixTerms, ReplicaView, replica_key

# Conversations whose last turn's replica a process remembers (``Router._latest``): ~200
# bytes each, ~13 MB at the bound; a conversation idle past this many others' turns goes to
# its conversation's replica, as it would through another process.
LATEST_CONVERSATIONS = 65_536


def route(
    views: Sequence[ReplicaView],
    cls: EffectiveClass,
    cfg: AdmissionConfig,
    rng: random.Random,
    *,
    turn: int = 0,
    kv_bytes: int = 0,
    long_context: bool = False,
    kv_bytes_per_token: int = 0,
    prefix: PrefixTerms | None = None,
    growth_bytes: int = 0,
    very_long: bool = True,
) -> ReplicaView | None:
    """Pick a replica for one request, or None when no replica may take it (a 503).

    Floor traffic tries the reserved pool first, then shared replicas under 0.92 (docs/design.md R2:
    "try another"); everyone else only sees shared replicas under their class ceiling.
    Every rule is a term of ``gateway.admission.placement.score``; this is its entry point.
    ``prefix`` (strategy ``cache_aware``) adds the expected prefix-cache hit.
    """
    req = PlacementRequest(
        cls,
        kv_bytes,
        long_context,
        kv_bytes_per_token,
        prefix=prefix,
        growth_bytes=growth_bytes,
        very_long=very_long,
    )
    return place(views, req, cfg, rng, turn=turn)


class ReplicaSource(Protocol):
    """What the router reads of ``gateway.admission.replicas.ReplicaRegistry`` (and the herd
    simulation provides in virtual time)."""

    def states(self, version: str) -> Sequence[ReplicaState]: ...
    def state(self, replica_id: str) -> ReplicaState | None: ...


class Router:
    def __init__(
        self,
        registry: ReplicaSource,
        rng: random.Random | None = None,
        *,
        config: AdmissionConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        index: PrefixIndex | None = None,
    ) -> None:
        self._registry = registry
        self.index = index if index is not None else PrefixIndex(clock=clock)
        self._rng = rng or random.Random()
        self._cfg = config or AdmissionConfig()
        self._clock = clock
        # replica_id -> {request_id: kv_bytes}: dispatched, no first token reported yet
        self._prefilling: dict[str, dict[str, int]] = {}
        # replica_id -> {request_id: (first_token_at, kv_bytes)}, in first-token order:
        # prefilled, but maybe not yet in a scrape
        self._settling: dict[str, dict[str, tuple[float, int]]] = {}
        # replica_id -> {request_id: output growth bytes}: long-context requests this process
        # placed, from dispatch to finish (they shape placement for as long as they run, and
        # their expected decode KV stays reserved on the replica's load until then)
        self._long: dict[str, dict[str, int]] = {}
        # version -> (clock, fleet long-context KV in flight): the last budget answer
        self._fleet_long: dict[str, tuple[float, int]] = {}
        # version -> (clock, {replica_id: long-context KV leased there}): the last note of
        # a shared record of where the leases were placed (``note_placed_long``)
        self._placed_long: dict[str, tuple[float, dict[str, int]]] = {}
        # replica_id -> {request_id: very long}: long contexts this process dispatched there
        # with no first token yet (their prefills hold the replica's prefill slots)
        self._long_prefill: dict[str, dict[str, bool]] = {}
        # version -> (clock, {replica_id: (long prefills, of them very long)}): the long
        # prefills in flight per replica as a record shared by the gateway processes reports
        # them (``note_long_prefills``), beside this process's own
        self._fleet_prefills: dict[str, tuple[float, dict[str, tuple[int, int]]]] = {}
        # version -> (replica ids, their long-context order, each id's rank in it, how many
        # of them are designated): recomputed only when the version's replicas change
        self._order: dict[str, tuple[tuple[str, ...], list[str], dict[str, int], int]] = {}
        self._turn = 0
        # Cache-aware routing: replica_id -> {request_id: prompt tokens it must compute (the
        # expected hit taken off)}, from dispatch to first token: the replica's queued
        # prefill as this process sees it; and the last choice's expected hit.
        self._queued: dict[str, dict[str, int]] = {}
        self._last_hit: tuple[PrefixQuery, str, int] | None = None
        # Cache-aware routing: conversation key -> (its assistant turns, the replica) of the
        # last turn this process dispatched, least recently dispatched first; bounded
        self._latest: OrderedDict[int, tuple[int, str]] = OrderedDict()

    @property
    def config(self) -> AdmissionConfig:
        return self._cfg

    def optimistic_bytes(self, replica_id: str, scraped_at: float) -> int:
        """KV dispatched to the replica that its last scrape cannot have seen (all of yet),
        with the output growth reserved for its long contexts."""
        total = 0
        hosted = self._long.get(replica_id)
        if hosted:
            total = sum(hosted.values())
        prefilling = self._prefilling.get(replica_id)
        if prefilling:
            total += sum(prefilling.values())
        entries = self._settling.get(replica_id)
        if entries:
            cutoff = scraped_at - self._cfg.inflight_grace_s
            while entries:  # first-token order: drop the prefix the scrape accounts for
                rid, (at, _) = next(iter(entries.items()))
                if at > cutoff:
                    break
                del entries[rid]
            total += sum(b for _, b in entries.values())
        return total

    def note_fleet_long(self, version: str, inflight_bytes: int) -> None:
        """The fleet's long-context KV in flight, as the last budget answer reported it
        (without the request being placed: its own KV is counted by the ceiling check)."""
        self._fleet_long[version] = (self._clock(), max(0, inflight_bytes))

    def note_placed_long(self, version: str, kv_by_replica: dict[str, int]) -> None:
        """Of the fleet's long-context KV in flight, the part a shared record knows the
        replica of (every gateway process's leases dispatched there), per replica; for
        ``lease_ttl_s`` after the note. The long-context floor (``placement.long_floors``)
        charges each designated replica what is placed there and packs only the rest in
        order; without a note all of it is packed in order, which is where long contexts
        packed by KV are. The gateway notes it before placing a long context under
        ``long_prefill_placement`` (its ledger records each long context's replica then:
        ``AdmissionController._note_placements``), a short request's placement uses the last
        note while fresh; the fleet simulation notes it on every arrival from its ledger
        (``FleetConfig.place_shared``)."""
        self._placed_long[version] = (self._clock(), dict(kv_by_replica))

    def note_long_prefills(self, version: str, by_replica: dict[str, tuple[int, int]]) -> None:
        """The long prefills in flight on each replica of ``version`` fleet-wide (all gateway
        processes' long contexts dispatched there with no first token yet: count, of them
        very long), as a shared record reports them; placement takes the larger of this and
        this process's own count, for ``lease_ttl_s`` after the note. The gateway notes it
        before placing a long context under ``long_prefill_placement``, from its ledger's
        record of each long context's replica (``AdmissionController._note_placements``;
        without the store each process knows its own); the fleet simulation from its ledger
        (``FleetConfig.place_shared``)."""
        self._fleet_prefills[version] = (self._clock(), dict(by_replica))

    def long_prefills(self, version: str, replica_id: str) -> tuple[int, int]:
        """The long prefills in flight on the replica as this process knows them: (all,
        very long), the larger of its own and a fresh ``note_long_prefills``."""
        own = self._long_prefill.get(replica_id)
        total = len(own) if own else 0
        very = sum(own.values()) if own else 0
        noted = self._fleet_prefills.get(version)
        if noted is not None and self._clock() - noted[0] <= self._cfg.lease_ttl_s:
            n_total, n_very = noted[1].get(replica_id, (0, 0))
            total, very = max(total, n_total), max(very, n_very)
        return total, very

    def very_long(self, version: schema.ModelVersionRecord, est_kv_bytes: int) -> bool:
        """Whether a long context of ``est_kv_bytes`` prompt KV is very long
        (``long_context.long_context_tier``, the budget's tier)."""
        per_token = max(1, version.kv_bytes_per_token)
        return long_context_tier(max(0, est_kv_bytes) // per_token, version, self._cfg).very_long

    def _layout(
        self, version: str, states: Sequence[ReplicaState]
    ) -> tuple[tuple[str, ...], list[str], dict[str, int], int]:
        ids = tuple(sorted(s.replica_id for s in states if s.record.pool != "reserved"))
        cached = self._order.get(version)
        if cached is None or cached[0] != ids:
            order = long_context_order(version, ids)
            rank = {rid: i for i, rid in enumerate(order)}
            cached = (ids, order, rank, long_context_replicas(len(order), self._cfg))
            self._order[version] = cached
        return cached

    def views(
        self, version: schema.ModelVersionRecord, prefix: PrefixQuery | None = None
    ) -> list[ReplicaView]:
        """The version's routable replicas as the router sees them; with ``prefix``, with
        what ``with_hits`` adds, filled in as each view is built (``dataclasses.replace``
        per view was most of cache-aware routing's cost on a prompt nobody holds)."""
        capacity = version.kv_capacity_tokens * version.kv_bytes_per_token
        states = self._registry.states(version.version)
        blocks: dict[str, int] = {}
        if prefix is not None:
            blocks = self.index.match_query(
                prefix, [s.replica_id for s in states if s.healthy and s.scraped_at > 0]
            )
        # Per request: the order, ranks and designated count come from the cache.
        _, order, rank, designated = self._layout(version.version, states)
        fleet = self._fleet_long.get(version.version)
        fleet_bytes = 0
        if fleet is not None and self._clock() - fleet[0] <= self._cfg.lease_ttl_s:
            fleet_bytes = fleet[1]
        # per replica where the ledger records placements (long_prefill_placement), else in
        # order per replica (the default: no list per request)
        floors: list[float] | None = None
        noted = self._placed_long.get(version.version)
        if fleet_bytes and noted is not None and self._clock() - noted[0] <= self._cfg.lease_ttl_s:
            placed = noted[1]
            floors = long_floors(
                fleet_bytes, [placed.get(rid, 0) for rid in order[:designated]], capacity, self._cfg
            )
        out = []
        for s in states:
            if not s.healthy or s.scraped_at <= 0:
                continue
            r = rank.get(s.replica_id, -1)
            floor = 0.0
            if 0 <= r < designated and fleet_bytes:
                floor = (
                    floors[r]
                    if floors is not None
                    else packed_floor(fleet_bytes, r, capacity, self._cfg)
                )
            hit = queued = 0
            prefills = very = 0
            # read by placement only under long_prefill_placement (placement.score)
            if 0 <= r < designated and self._cfg.long_prefill_placement:
                prefills, very = self.long_prefills(version.version, s.replica_id)
            if prefix is not None:
                hit = blocks[s.replica_id] * prefix.block_size
                pending = self._queued.get(s.replica_id)
                queued = sum(pending.values()) if pending else 0
            out.append(
                ReplicaView(
                    s.replica_id,
                    s.record.pool,
                    s.kv_usage,
                    self.optimistic_bytes(s.replica_id, s.scraped_at),
                    capacity,
                    long_rank=r,
                    long_designated=designated,
                    hosts_long=bool(self._long.get(s.replica_id)) or floor > 0.0,
                    long_floor=floor,
                    cache_hit_tokens=hit,
                    queued_prefill_tokens=queued,
                    long_prefills=prefills,
                    very_long_prefills=very,
                )
            )
        return out

    def with_hits(self, views: list[ReplicaView], query: PrefixQuery) -> list[ReplicaView]:
        """The views with ``cache_hit_tokens`` (the leading prompt tokens each replica is
        believed to hold, from this process's index) and ``queued_prefill_tokens`` (prompt
        tokens this process sent there that have no first token yet, less their expected
        hits)."""
        blocks = self.index.match_query(query, [v.replica_id for v in views])
        bs = query.block_size
        out = []
        for v in views:
            pending = self._queued.get(v.replica_id)
            queued = sum(pending.values()) if pending else 0
            hit = blocks[v.replica_id] * bs
            if hit or queued:
                v = dataclasses.replace(v, cache_hit_tokens=hit, queued_prefill_tokens=queued)
            out.append(v)
        return out

    def choose(
        self,
        version: schema.ModelVersionRecord,
        admission_class: str,
        est_kv_bytes: int,
        *,
        long_context: bool = False,
        prefix: PrefixQuery | None = None,
        growth_bytes: int = 0,
        very_long: bool | None = None,
    ) -> schema.ReplicaRecord | None:
        """A replica of ``version`` that may take a request of the (effective) class, or None
        when none may (the caller answers 503). ``est_kv_bytes`` (the prompt's KV) counts
        against the class ceiling here and is recorded by ``on_dispatch``: a choice is not
        yet a dispatch. ``growth_bytes``: a long context's expected output KV, reserved
        against the ceiling too. ``very_long``: a long context's tier when the caller has
        it already (the budget's ask); None: derived here (``very_long``)."""
        cls: EffectiveClass = admission_class  # type: ignore[assignment]
        aware = prefix is not None and self._cfg.strategy == "cache_aware"
        views = self.views(version, prefix if aware else None)
        terms = None
        if prefix is not None and aware and views:
            latest = ""
            if prefix.key_tokens and prefix.turns:
                # the turn just before this one went through this process: where it went
                last = self._latest.get(prefix.placement_key)
                if last is not None and last[0] == prefix.turns - 1:
                    latest = last[1]
            terms = PrefixTerms(
                prefix.placement_key,
                replica_key(prefix.tenant_id),
                version.prefill_tokens_per_s,
                hinted=prefix.hinted,
                key_tokens=prefix.key_tokens,
                shared_key=prefix.shared_key,
                continues=prefix.turns > 0,
                latest_replica=latest,
            )
        pick = route(
            views,
            cls,
            self._cfg,
            self._rng,
            turn=self._turn,
            kv_bytes=est_kv_bytes,
            long_context=long_context,
            kv_bytes_per_token=version.kv_bytes_per_token,
            prefix=terms,
            growth_bytes=growth_bytes,
            very_long=long_context
            and (self.very_long(version, est_kv_bytes) if very_long is None else very_long),
        )
        self._turn += 1
        if terms is not None and prefix is not None and pick is not None:
            self._last_hit = (prefix, pick.replica_id, pick.cache_hit_tokens)
        if pick is None:
            return None
        state = self._registry.state(pick.replica_id)
        return state.record if state is not None else None

    def on_dispatch(
        self,
        replica: schema.ReplicaRecord,
        request_id: str,
        est_kv_bytes: int,
        *,
        long_context: bool = False,
        prefix: PrefixQuery | None = None,
        growth_bytes: int = 0,
        very_long: bool = True,
    ) -> None:
        """Called once the request is sent to ``replica``: count it until a scrape after its
        first token (or its finish); a long-context request marks the replica as hosting
        long contexts until it finishes, and its output growth stays charged there until
        then, and holds one of the replica's prefill slots (of its tier: ``very_long``)
        until its first token; the prompt's blocks are now cached there."""
        self._prefilling.setdefault(replica.replica_id, {})[request_id] = max(0, est_kv_bytes)
        if long_context:
            self._long.setdefault(replica.replica_id, {})[request_id] = max(0, growth_bytes)
            self._long_prefill.setdefault(replica.replica_id, {})[request_id] = very_long
        if prefix is not None and self._cfg.strategy == "cache_aware":
            # The whole prompt's blocks, now: a request routed a moment later (a burst of
            # conversations sharing a system prompt) must see the whole hit, or it weighs
            # this replica's affinity by the leading blocks alone and spills elsewhere
            # (deferring this cost ~3 points of cached share in bench.prefix_gateway).
            rid = replica.replica_id
            self.index.record(rid, prefix.block_hashes)
            if prefix.key_tokens:
                self._latest[prefix.placement_key] = (prefix.turns, rid)
                self._latest.move_to_end(prefix.placement_key)
                if len(self._latest) > LATEST_CONVERSATIONS:
                    self._latest.popitem(last=False)
            hit = 0
            last = self._last_hit
            if last is not None and last[0] is prefix and last[1] == rid:
                hit = last[2]
            self._queued.setdefault(rid, {})[request_id] = max(0, prefix.prompt_tokens - hit)

    def _prefill_over(self, replica_id: str, request_id: str) -> None:
        slots = self._long_prefill.get(replica_id)
        if slots is not None and slots.pop(request_id, None) is not None and not slots:
            del self._long_prefill[replica_id]

    def _unqueue(self, replica_id: str, request_id: str) -> None:
        queued = self._queued.get(replica_id)
        if queued is not None and queued.pop(request_id, None) is not None and not queued:
            del self._queued[replica_id]

    def on_first_token(self, replica: schema.ReplicaRecord, request_id: str) -> None:
        """Called when the request's first token arrives (its prefill is done): from here it
        counts only until the replica's next scrape. Unknown or repeated calls are no-ops."""
        self._unqueue(replica.replica_id, request_id)
        self._prefill_over(replica.replica_id, request_id)
        prefilling = self._prefilling.get(replica.replica_id)
        if prefilling is None:
            return
        kv_bytes = prefilling.pop(request_id, None)
        if kv_bytes is not None:
            self._settling.setdefault(replica.replica_id, {})[request_id] = (
                self._clock(),
                kv_bytes,
            )

    def on_finish(self, replica: schema.ReplicaRecord, request_id: str) -> None:
        """Called exactly once per dispatched request, whatever its ending: a request that
        ended before the next scrape no longer holds KV the scrape would have shown."""
        replica_id = replica.replica_id
        self._unqueue(replica_id, request_id)
        self._prefill_over(replica_id, request_id)
        hosted = self._long.get(replica_id)
        if hosted is not None and hosted.pop(request_id, None) is not None and not hosted:
            del self._long[replica_id]
        prefilling = self._prefilling.get(replica_id)
        if prefilling is not None and prefilling.pop(request_id, None) is not None:
            return
        settling = self._settling.get(replica_id)
        if settling is not None:
            settling.pop(request_id, None)
