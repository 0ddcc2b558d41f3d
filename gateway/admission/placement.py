"""Replica placement: ONE pure scoring function that every routing rule goes through.

``score(view, request, cfg)`` says how much the router wants to put ``request`` on the
replica ``view`` describes: ``None`` = the replica may not take it at all, otherwise a
float where higher is better. ``choose`` takes the best of the scores. Every rule of
replica choice is a term of that one function, so that a new term (the expected prefix
cache hit, say) cannot quietly bypass an older one:

- **eligibility (None)**: the reserved pool takes only floor traffic; the class ceiling
  must hold *after* this request's full prompt KV lands (the KV still to come is charged
  from admission, not as its chunks materialise); a long-context request may only go to
  the replicas designated for long contexts (see below).
- **bands** (multiples of ``BAND``): a preference no fractional term can override.
  Floor traffic: the reserved pool first. Long-context requests: the lowest-ranked
  designated replica with room (packing: as few replicas as the ceilings allow) among
  those with a prefill slot of the request's tier free when ``long_prefill_placement`` is
  on (off by default; ``prefill_slot_free``: the long prefills in flight there, from
  dispatch to first token, against the budget's per-replica slots; not for reserved long
  contexts, which are outside the budget), then the others. Packed by KV alone, several
  long prefills share one replica's steps, each at a fraction of its lone speed
  (bench/results/fleet_sim_isolation_place.md). Short
  requests: replicas that host no long context first; short reserved requests also keep
  off the designated replicas that host none yet (``reserved_off_long_replicas``): a
  request decodes for tens of seconds, packing may start on its replica at any moment of
  them, and the long prefills it stacks there stretch every step the request decodes in
  (bench/results/fleet_sim_reserved.md: 16 of the 17 feasible reserved requests that
  shared a replica with long prefills missed TPOT, at 100–300 ms). A reserved long context
  takes the reserved pool first, as other floor traffic; with ``reserved_long_off_pool``
  (off by default) the designated shared replicas first and the reserved pool only when
  none of them has room: in the pool first, its 128k prefill queued the short
  floor requests behind it for 1–2.7 s (bench/results/fleet_sim_reserved.md); the pool stays
  its last resort, so R2's floor promise (refused only when no replica qualifies) holds.
  Its cost: there it queues with other tenants' long prompts (with heavy tenants, first
  tokens after ~26 s instead of ~2 s; bench/results/fleet_sim_reserved_pool.md).
- **within a band** (|term| < ``BAND`` / 2): the load (scraped occupancy plus this
  process's optimistic in-flight KV) — the emptier the better — plus the affinity term:
  the prefill time the replica would save because it already holds the request's leading
  prompt tokens in its prefix cache (``ReplicaView.cache_hit_tokens``, filled in by
  cache-aware routing from ``gateway.admission.prefix``; the version's prefill rate turns
  tokens into seconds, ``affinity_load_cost_s`` seconds weigh as one unit of occupancy),
  less the wait behind the prefill this process queued there, never below zero
  (``net_affinity``: the queue discounts a hit; a replica without one is scored on its
  load alone, as P2C scores it). Affinity lives only inside a band, so the ceilings, the
  reserved pool and the long-context placement always win over it.

Which replicas host long contexts: every gateway process orders a version's shared
replicas the same way (rendezvous hashing of the replica id, ``long_context_order``), so
all processes pack long contexts onto the same replicas without talking to each other.
Long contexts may use the first ``designated`` replicas of that order (the fleet budget's
replica count, ``long_context_replicas``); a replica "hosts" long contexts when this
process has one in flight there or when its long-context floor (``long_floors``) is above
zero: the fleet's long-context KV in flight (the last long-context budget answer from
Redis), charged where the ledger records its leases placed (``long_prefill_placement``)
and the rest packed in order at the standard ceiling.

The chooser (``choose``): candidates are the eligible replicas of the best band. A
long-context request takes the best of all of them (they are rare and large; packing is the
point, and the optimistic in-flight charge of a 40 GiB prompt keeps the next decision off a
replica it just filled). Everything else samples two of them and takes the better (power of
two choices): the scrape is ~250 ms stale and a busy gateway decides dozens of times in that
window; the best of all would herd onto one replica (see ``bench/herd.py``).

With strategy ``cache_aware`` and a request's ``PrefixTerms``, only what a replica holds
beyond what every candidate of the band holds counts as affinity (``distinct_hit``; ``choose``
fills in ``PlacementRequest.common_hit_tokens``): leading blocks every replica holds (a chat
template's header, a tenant's short system prompt sent everywhere) save the same prefill
wherever the request goes. Counted as a hit they made every replica a "holder", and the best
score among equal holders is the emptiest replica on a ~250 ms stale scrape: pick-the-emptiest,
the herd P2C exists to avoid (bench/results/nn_cache_vs_p2c: standard tenants' TPOT p95 up to
1.8x their quiet baseline against 1.1x under P2C in the same run). A request with nothing
to follow (``follows_affinity``: no candidate holds more of its prompt than another, no
client hint, no tenant replicas, and ``affinity_rendezvous`` off) is placed exactly as P2C
places it: the same draw from the router's rng, the same comparison, so traffic without
shared prefixes (the herd) is routed as P2C routes it. Otherwise (``_choose_cache_aware``)
random sampling would rarely include the replica holding the prefix, so within the band:
bounded load when some replica holds part of the prompt (even a part every replica holds: a
hot prefix all the same), or with ``affinity_tenant_replicas`` — only replicas whose load
(with the queued prefill) is at most
``max(mean x affinity_load_factor, mean + affinity_load_slack)`` of the band are candidates
(consistent hashing with bounded loads: a hot prefix spills to another replica instead of
piling onto one). Then, if some candidate holds more of the prompt than another, the best
score decides how much of the prompt the choice follows, and among the candidates holding
exactly that much (a prefix spread over several replicas) the better of the first two in the
placement key's rendezvous order: the same rule of two choices as P2C, not the best of all
of them. Otherwise the better of the first two replicas in the placement key's rendezvous
order (the same two in every gateway process, so a conversation's or a system prompt's first
requests meet; distinct keys give uniform, independent pairs, as P2C's draws are, but not the
same ones), within the tenant's own replicas when ``affinity_tenant_replicas`` is set.

One exception, for gateway processes blind to each other (``affinity_rendezvous`` on, no
tenant replicas): a chat request keyed by its conversation (``PrefixTerms.key_tokens``; see
``gateway.admission.prefix.conversation_block``) that continues it (an assistant turn before
it: ``PrefixTerms.continues``) goes to its conversation's replica — of the first two replicas
of its shared key's rendezvous order (its system prompt's pair), the first in its
conversation key's order — while that replica's scraped occupancy is at most the load bound
on scraped occupancy plus ``affinity_conversation_margin``, else to the first replica of the
shared key's order within that bound (``_place_conversation``). No load comparison and
neither where this process placed earlier turns nor its in-flight KV (only a deep prefill
backlog it queued, and a spill it saw, for hysteresis: see ``_place_conversation``): the
scrape is the same in every process, so whichever process sees a turn computes the same
replica. Following this process's own record of the conversation sent a turn back to where
this process had placed an earlier one after the other processes had placed the turns
between elsewhere, and a bound on each process's own in-flight loads spilled a turn in one
process and not in another (bench/results/conversation_key.md). A conversation's first turn
takes the better of two, as P2C does: its conversation's replica and the next in its system
prompt's order, the conversation's replica unless the other scores higher by more than the
request's own share of a replica; and a turn whose previous turn this process placed follows
it (``latest_replica``: that replica holds the whole history). With
``affinity_conversation_shared`` off (before), only a conversation no candidate holds the
key's block of is placed so (within the bound on this process's loads); one this process
placed is followed as above.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.admission.classes import occupancy_ceiling, pool_admits
from gateway.admission.config import AdmissionConfig, EffectiveClass
from gateway.admission.routing import PrefixTerms, ReplicaView, rendezvous_order

BAND = 1_000_000.0  # one preference step; terms inside a band stay well under BAND / 2
_IN_BAND = BAND / 4
# Below every designated replica's packing band (-long_rank): where a reserved long context
# goes only when no designated shared replica has room.
_LAST_RESORT = -(1 << 20)


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """What placement knows about the request being placed."""

    cls: EffectiveClass
    kv_bytes: int  # the prompt's full KV: what the replica holds once prefill is done
    long_context: bool = False  # above the version's long-context threshold
    kv_bytes_per_token: int = 0  # unused since the affinity term is in seconds; kept for callers
    prefix: PrefixTerms | None = None  # cache-aware routing's terms (strategy cache_aware)
    # The KV its decode will add after admission (the output the admission's KV charge
    # assumes, times the sequences): a long context's ceiling check reserves it.
    growth_bytes: int = 0
    # Cached tokens every candidate of the band holds (``choose`` fills it in): a hit that
    # is the same everywhere saves the same prefill wherever the request goes, so only what a
    # replica holds beyond it (``distinct_hit``) is affinity.
    common_hit_tokens: int = 0
    # A long context's tier (``long_context.long_context_tier``): a very long prompt needs a
    # free very long prefill slot on its replica, a shorter one a free slot of either tier.
    # True when unknown: it then needs both (``prefill_slot_free``).
    very_long: bool = True


def in_band(term: float) -> float:
    """Clamp a within-band term so it can never cross into another band."""
    return max(-_IN_BAND, min(_IN_BAND, term))


def band_of(value: float) -> int:
    return math.floor(value / BAND + 0.5)


def request_bytes(req: PlacementRequest) -> int:
    """The KV the ceiling check charges for the request: its whole prompt, and for a long
    context also its expected output growth — its decode KV keeps arriving for as long as
    it runs, on a replica packed to the ceiling with other long contexts. (A short request's
    growth is small beside the ceiling's margin and is seen by the next scrapes.)"""
    growth = max(0, req.growth_bytes) if req.long_context else 0
    return max(0, req.kv_bytes) + growth


def fits_ceiling(view: ReplicaView, req: PlacementRequest, cfg: AdmissionConfig) -> bool:
    """The class ceiling holds with this request's KV on the replica (``request_bytes``):
    the KV a long prompt will allocate chunk by chunk over seconds, and a long context's
    output growth, are counted from admission."""
    load = view.load(cfg.optimistic_inflight)
    if cfg.count_request_kv and view.capacity_bytes > 0:
        load += request_bytes(req) / view.capacity_bytes
    ceiling = occupancy_ceiling(req.cls, cfg)
    return load <= ceiling if req.cls == "reserved" else load < ceiling


def _prefill_rate(req: PlacementRequest, cfg: AdmissionConfig) -> float:
    if req.prefix is not None and req.prefix.prefill_tokens_per_s > 0:
        return req.prefix.prefill_tokens_per_s
    return cfg.affinity_prefill_tokens_per_s


def distinct_hit(view: ReplicaView, req: PlacementRequest) -> int:
    """The prompt tokens this replica holds beyond what every candidate holds
    (``common_hit_tokens``): the part of its hit that is a reason to choose it."""
    return max(0, view.cache_hit_tokens - req.common_hit_tokens)


def affinity(view: ReplicaView, req: PlacementRequest, cfg: AdmissionConfig) -> float:
    """The expected-cache-hit term: the prefill seconds this replica saves because it holds
    the request's leading prompt tokens beyond what every candidate holds (``distinct_hit`` /
    the prefill rate), in units of occupancy (``affinity_load_cost_s`` seconds = one full
    replica of load)."""
    hit = distinct_hit(view, req)
    if hit <= 0:
        return 0.0
    return hit / _prefill_rate(req, cfg) / cfg.affinity_load_cost_s


def queue_term(view: ReplicaView, req: PlacementRequest, cfg: AdmissionConfig) -> float:
    """The prefill this process queued on the replica (``queued_prefill_tokens``, filled in
    by cache-aware routing) beyond one step's token budget (which a new request shares
    rather than waits behind), in the same units: the seconds a new request would wait.
    KV occupancy alone misses it: a replica busy prefilling holds little KV yet, and
    affinity would pile a tenant's conversations onto it."""
    waiting = view.queued_prefill_tokens - cfg.affinity_queue_free_tokens
    if waiting <= 0:
        return 0.0
    return waiting / _prefill_rate(req, cfg) / cfg.affinity_load_cost_s


def net_affinity(view: ReplicaView, req: PlacementRequest, cfg: AdmissionConfig) -> float:
    """What holding the prompt's prefix is worth on this replica: the prefill it saves less
    the wait behind the prefill queued there, never below zero. The queue discounts a hit
    and nothing else: a replica without one is scored on its load alone, exactly as P2C
    scores it (its queued prompts are already in the optimistic in-flight KV). Charged to
    every replica, the queue term outweighed occupancy by orders of magnitude (0.25 s of
    queued prefill weighs as a full replica) and steered unmatched traffic by queue
    length alone, onto replicas with full KV and large decode batches."""
    gain = affinity(view, req, cfg)
    if gain <= 0.0:
        return 0.0
    return max(0.0, gain - queue_term(view, req, cfg))


def designated(view: ReplicaView) -> bool:
    """A shared replica long contexts may be packed onto (``long_context_order``'s first
    ``long_designated``), hosting one now or not."""
    return view.pool != "reserved" and 0 <= view.long_rank < view.long_designated


def prefill_slot_free(view: ReplicaView, req: PlacementRequest, cfg: AdmissionConfig) -> bool:
    """Whether the replica has a prefill slot of the long context's tier free: the fleet
    budget's tiers (``long_context.long_context_budget`` and ``long_context_lane_slots``)
    per replica. A very long prompt needs fewer very long prefills in flight there than
    ``long_prefill_slots_per_replica`` and a free slot of all; a shorter one a free slot of
    all (``long_prefill_slots_per_replica`` + ``short_long_prefill_slots_per_replica``).
    Long prefills on one replica share each step's prefill budget (vLLM's chunk cap,
    ``--long-prefill-token-threshold``), so past its slots each runs at a fraction of its
    lone speed."""
    slots = cfg.long_prefill_slots_per_replica
    total = slots + cfg.short_long_prefill_slots_per_replica
    if view.long_prefills >= total:
        return False
    return not req.very_long or view.very_long_prefills < slots


def score(view: ReplicaView, req: PlacementRequest, cfg: AdmissionConfig) -> float | None:
    """How much ``req`` should go to ``view``: None = not at all; higher is better."""
    capacity = cfg.enforces("capacity")
    if capacity:
        if not pool_admits(req.cls, view.pool) or not fits_ceiling(view, req, cfg):
            return None
    band = 0
    if capacity and req.cls == "reserved" and view.pool == "reserved":
        if req.long_context and cfg.context_placement and cfg.reserved_long_off_pool:
            # A reserved long context: the designated shared replicas first, the pool only
            # when none has room (module doc), so R2's "try another" still ends in the pool.
            return _LAST_RESORT * BAND + in_band(-view.load(cfg.optimistic_inflight))
        # The reserved pool first, then shared replicas (docs/design.md R2: "try another").
        band += 2
    if cfg.context_placement and view.pool != "reserved":
        if req.long_context:
            if not designated(view):
                return None  # not a long-context replica: the budget's replicas only
            band -= view.long_rank  # pack: the lowest-ranked one with room
            if (
                cfg.long_prefill_placement
                and req.cls != "reserved"
                and not prefill_slot_free(view, req, cfg)
            ):
                # below every designated replica with a free prefill slot of its tier (the
                # budget's classes; reserved long contexts, outside it, are placed as before)
                band -= view.long_designated
        else:
            # Short traffic keeps off long contexts while it has room elsewhere; reserved
            # short traffic also off the designated replicas hosting none yet (module doc).
            wary = req.cls == "reserved" and cfg.reserved_off_long_replicas
            if view.hosts_long:
                band -= 2 if wary else 1
            elif wary and designated(view):
                band -= 1
    term = -view.load(cfg.optimistic_inflight) + net_affinity(view, req, cfg)
    return band * BAND + in_band(term)


def choose(
    views: Sequence[ReplicaView],
    req: PlacementRequest,
    cfg: AdmissionConfig,
    rng: random.Random,
    *,
    turn: int = 0,
) -> ReplicaView | None:
    """The replica for ``req``, or None when no replica may take it (a 503)."""
    scored = [(s, v) for v in views if (s := score(v, req, cfg)) is not None]
    if len(scored) <= 1:  # none may take it, or the only one that may (no band to compare)
        return scored[0][1] if scored else None
    top = max(band_of(s) for s, _ in scored)
    cands = [(s, v) for s, v in scored if band_of(s) == top]
    if len(cands) == 1:
        return cands[0][1]
    if cfg.strategy == "cache_aware" and req.prefix is not None and not req.long_context:
        common = min(v.cache_hit_tokens for _, v in cands)
        if common > 0:  # a hit every candidate holds is no reason to prefer any of them
            req = dataclasses.replace(req, common_hit_tokens=common)
            # the same replicas, bands and eligibility: only the affinity term changes
            cands = [(s, v) for _, v in cands if (s := score(v, req, cfg)) is not None]
        if follows_affinity(cands, req, cfg):
            return _choose_cache_aware(cands, req, cfg, views)
    if cfg.strategy == "round_robin":
        return cands[turn % len(cands)][1]
    if req.long_context or cfg.strategy == "emptiest":
        return max(cands, key=lambda sv: sv[0])[1]
    a, b = rng.sample(range(len(cands)), 2)
    return cands[a][1] if cands[a][0] >= cands[b][0] else cands[b][1]


def follows_affinity(
    cands: Sequence[tuple[float, ReplicaView]], req: PlacementRequest, cfg: AdmissionConfig
) -> bool:
    """Whether cache-aware routing has anything to follow among the candidates: some
    replica holds more of the prompt than the others (``distinct_hit``), the client gave an
    affinity hint, the tenant has home replicas, or new prefixes are placed by rendezvous
    (``affinity_rendezvous``: gateway processes blind to each other's placements). Otherwise
    the request is placed exactly as P2C places it: the same draw of two from the router's
    rng, the same comparison."""
    assert req.prefix is not None
    return (
        cfg.affinity_rendezvous
        or req.prefix.hinted
        or 0 < cfg.affinity_tenant_replicas < len(cands)
        or any(distinct_hit(v, req) > 0 for _, v in cands)
    )


def load_bound(loads: Sequence[float], cfg: AdmissionConfig) -> float:
    """Bounded load: no replica is chosen for affinity above this (consistent hashing with
    bounded loads, with an absolute slack so a nearly idle fleet does not spill at once)."""
    mean = sum(loads) / len(loads)
    return max(mean * cfg.affinity_load_factor, mean + cfg.affinity_load_slack)


def _choose_cache_aware(
    cands: Sequence[tuple[float, ReplicaView]],
    req: PlacementRequest,
    cfg: AdmissionConfig,
    views: Sequence[ReplicaView] = (),
) -> ReplicaView:
    """Within one band (see the module doc): when some replica holds part of the prompt,
    the load bound; then, when some replica within it holds more of the prompt than the
    others, the best score, or the better of two among the replicas holding as much as the
    best; else the better of two rendezvous choices of the placement key."""
    prefix = req.prefix
    assert prefix is not None
    within = {v.replica_id: (s, v) for s, v in cands}
    tenant_homes = 0 < cfg.affinity_tenant_replicas < len(cands)
    if (
        cfg.affinity_rendezvous
        and not tenant_homes
        and prefix.key_tokens > 0
        and (
            cfg.affinity_conversation_shared
            or not any(v.cache_hit_tokens >= prefix.key_tokens for _, v in cands)
        )
    ):
        return _place_conversation(cands, req, cfg, views)
    if tenant_homes or any(v.cache_hit_tokens > 0 for _, v in cands):
        # The bound guards affinity (and a tenant's home replicas): a holder's queued prefill
        # counts as its load, so a hot prefix spills before its queue grows; a prefix every
        # replica holds is still a hot one. Otherwise unmatched traffic is not bounded: it
        # takes the less loaded of two, as P2C does.
        loads = {
            v.replica_id: v.load(cfg.optimistic_inflight) + queue_term(v, req, cfg)
            for _, v in cands
        }
        bound = load_bound(list(loads.values()), cfg)
        # the least loaded candidate is always within (the bound is at least the mean)
        within = {rid: sv for rid, sv in within.items() if loads[rid] <= bound}
    ranked = rendezvous_order(prefix.placement_key, [v for _, v in within.values()])
    if any(distinct_hit(v, req) > 0 for v in ranked):
        # max keeps the first of equal scores: the rendezvous order breaks ties alike
        best = max(ranked, key=lambda v: within[v.replica_id][0])
        # Among replicas that hold as much of the prompt as the best (they save the same
        # prefill; a prefix spread over several), load decides, and the best of all of them
        # on a stale scrape is pick-the-emptiest: the herd. The better of two, as P2C.
        ranked = [v for v in ranked if distinct_hit(v, req) == distinct_hit(best, req)]
    elif tenant_homes:
        home = {
            v.replica_id
            for v in rendezvous_order(prefix.tenant_key, [v for _, v in cands])[
                : cfg.affinity_tenant_replicas
            ]
        }
        ranked = [v for v in ranked if v.replica_id in home] or ranked
    return max(ranked[:2], key=lambda v: within[v.replica_id][0])


def _place_conversation(
    cands: Sequence[tuple[float, ReplicaView]],
    req: PlacementRequest,
    cfg: AdmissionConfig,
    views: Sequence[ReplicaView] = (),
) -> ReplicaView:
    """A chat request keyed by its conversation, with new prefixes placed by rendezvous: its
    conversation's replica is the first in its conversation key's rendezvous order of the
    first two replicas in its shared prefix's order (a tenant's system prompt: its home pair;
    the conversations of a tenant split over the pair by their keys).

    A first turn (``PrefixTerms.continues`` false) takes the better of two by score: that
    replica (within the bound plus the margin) and the next candidate within the bound in
    the shared prefix's order; that replica on a tie within the request's own share of a
    replica. A later turn whose previous turn this process placed goes where that one went
    (``PrefixTerms.latest_replica``) while it is within the bound plus the margin. What
    follows is for the other turns.

    ``affinity_conversation_shared`` (the default): that replica while its scraped occupancy
    is at most the load bound on the candidates' scraped occupancy plus
    ``affinity_conversation_margin``, else the first candidate in the shared prefix's order
    (the other of the pair first) within that bound. The scrape decides, which every
    gateway process sees alike: not this process's record of where it placed earlier turns
    (stale once another process placed a later one elsewhere), nor its in-flight KV (each
    process's differs, so the conversation's replica was over the bound for one process and
    not for another). The only term of this process's own is a prefill backlog it queued
    beyond one engine step (``queue_term``): zero unless deep, it keeps a burst of new prompts
    off a replica whose queue the scrape does not show yet (the herd's TTFT p99 without it:
    bench/results/conversation_key.md). The margin is the hysteresis: a conversation leaves
    its replica only well above the bound; one this process saw leave (it holds more of the
    conversation on a replica within the bound than on the conversation's replica) returns
    when the replica is back under the bound, any other when it is under the bound plus the
    margin (bench/results/conversation_key.md, "Shared placement"). The orders are over all
    of the version's replicas (``views``), not only this process's candidates, so that a
    replica one process may not use (its ceiling counts the process's in-flight KV) does not
    shift the pair.

    Off (before): only for a conversation this process has not placed (no candidate holds
    its key's block); within the load bound on this process's loads, the pair and the first
    of it as above."""
    prefix = req.prefix
    assert prefix is not None
    if not cfg.affinity_conversation_shared:
        loads = {
            v.replica_id: v.load(cfg.optimistic_inflight) + queue_term(v, req, cfg)
            for _, v in cands
        }
        bound = load_bound(list(loads.values()), cfg)
        within = [v for _, v in cands if loads[v.replica_id] <= bound]
        pair = rendezvous_order(prefix.shared_key, within)[:2]
        return rendezvous_order(prefix.placement_key, pair)[0]
    # the scrape, plus a prefill backlog this process queued there beyond one engine step
    # (``queue_term``, 0 unless it is deep: then it spares the replica a burst of new prompts)
    scraped = {v.replica_id: v.load(optimistic=False) + queue_term(v, req, cfg) for _, v in cands}
    bound = load_bound(list(scraped.values()), cfg)
    order = rendezvous_order(prefix.shared_key, views or [v for _, v in cands])
    home = rendezvous_order(prefix.placement_key, order[:2])[0]
    by_id = {v.replica_id: v for _, v in cands}
    if not prefix.continues and cfg.affinity_conversation_first_turns:
        # A first turn: nothing of the conversation is cached yet and a second turn may
        # never come (most API traffic is one turn), so it takes the better of two as P2C
        # does: the conversation's replica (within the bound plus the margin, as a later
        # turn) and the next replica within the bound in its system prompt's order. Within
        # one request's own share of a replica the two are as balanced as P2C leaves them,
        # and the conversation's replica keeps the turn, where its next turn, through any
        # gateway process, will go. Sent there regardless, one-turn traffic was placed at
        # random within the bound and the noisy-neighbour bench's TPOT fell behind P2C's
        # (bench/results/conversation_key.md, "First turns"). The score counts the system
        # prompt where this process saw it cached: by load alone, 44 replicas under 4
        # processes served 1.1 points fewer prompt tokens from cache (same section).
        first, *rest = itertools.islice(
            (
                by_id[v.replica_id]
                for v in (home, *(v for v in order if v is not home))
                if scraped.get(v.replica_id, math.inf)
                <= bound + (cfg.affinity_conversation_margin if v is home else 0.0)
            ),
            2,
        )
        if not rest:
            return first
        second = rest[0]
        scores = {v.replica_id: s for s, v in cands}
        slack = req.kv_bytes / first.capacity_bytes if first.capacity_bytes else 0.0
        return first if scores[first.replica_id] + slack >= scores[second.replica_id] else second
    latest = by_id.get(prefix.latest_replica) if cfg.affinity_conversation_latest else None
    if (
        latest is not None
        and scraped[latest.replica_id] <= bound + cfg.affinity_conversation_margin
    ):
        # This process sent the turn just before this one there: it holds the whole history
        # (no other process can have placed a turn since), wherever the first turn's choice
        # of two or a spill put it (bench/results/conversation_key.md, "The latest turn").
        return latest
    home_load = scraped.get(home.replica_id, math.inf)
    if home_load <= bound + cfg.affinity_conversation_margin:
        held = by_id[home.replica_id].cache_hit_tokens
        if home_load > bound:
            # Between the bound and the margin: a conversation this process saw spilled (it
            # holds more of it elsewhere, on a replica within the bound) stays there until
            # its replica is back under the bound.
            moved = [
                v
                for _, v in cands
                if v.cache_hit_tokens >= prefix.key_tokens
                and v.cache_hit_tokens > held
                and scraped[v.replica_id] <= bound
            ]
            if moved:
                return max(moved, key=lambda v: v.cache_hit_tokens)
        return by_id[home.replica_id]
    # the least loaded candidate is within the bound (it is at least the mean)
    return next(by_id[v.replica_id] for v in order if scraped.get(v.replica_id, math.inf) <= bound)


# -- which replicas take long contexts -----------------------------------------------------


def long_context_order(version: str, replica_ids: Sequence[str]) -> list[str]:
    """The shared replicas of ``version`` in the order every gateway process packs long
    contexts onto them: rendezvous hashing, stable under replicas joining or leaving."""

    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{version}\0{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight)


def long_context_replicas(shared_replicas: int, cfg: AdmissionConfig) -> int:
    """How many shared replicas may hold long contexts: ``long_context_replica_share`` of
    them, at least one (a lone replica serves everyone)."""
    if shared_replicas <= 0:
        return 0
    share = math.floor(cfg.long_context_replica_share * shared_replicas)
    return max(1, min(shared_replicas, share))


def packed_floor(
    fleet_long_bytes: int, rank: int, capacity_bytes: int, cfg: AdmissionConfig
) -> float:
    """``long_floors`` of the designated replica of ``rank`` when nothing is recorded as
    placed (the default: no ledger record), per replica: the fleet's long-context KV beyond
    ``rank`` replicas filled to the standard ceiling, at most one replica's worth."""
    if capacity_bytes <= 0:
        return 0.0
    per_replica = capacity_bytes * cfg.standard_max_occupancy
    return min(per_replica, max(0.0, fleet_long_bytes - rank * per_replica)) / capacity_bytes


def long_floors(
    fleet_long_bytes: int,
    placed: Sequence[int],
    capacity_bytes: int,
    cfg: AdmissionConfig,
) -> list[float]:
    """The occupancy the fleet's long-context KV in flight implies on each designated
    replica (``ReplicaView.long_floor``), in the long-context order: the KV of the long
    contexts recorded as placed on it (``placed``, by rank: every gateway process's leases
    whose replica the shared record knows), and the rest of the fleet's total (leases with
    no recorded replica: admitted and being sent, or a record that keeps none) packed in
    order onto the room each replica has left under the standard ceiling.

    With nothing placed this is the order-packing floor (replica ``r`` holds the total
    beyond ``r`` full replicas, at most one replica's worth): right while long contexts are
    packed by KV in that order, wrong once they spread (``long_prefill_placement`` with
    fleet-wide prefill counts), when it charged the first replicas full while the contexts
    ran elsewhere and placement refused long contexts the budget had admitted
    (bench/results/fleet_sim_isolation_place2.md)."""
    if capacity_bytes <= 0:
        return [0.0] * len(placed)
    per_replica = capacity_bytes * cfg.standard_max_occupancy
    placed = [max(0, b) for b in placed]
    rest = max(0, fleet_long_bytes - sum(placed))
    out = []
    below = 0.0  # placed KV of the lower ranks, each up to one replica's worth
    for rank, held in enumerate(placed):
        # the room the lower ranks had left took the unplaced KV before this one
        fill = min(max(0.0, per_replica - held), max(0.0, rest - (rank * per_replica - below)))
        out.append((held + fill) / capacity_bytes)
        below += min(held, per_replica)
    return out
