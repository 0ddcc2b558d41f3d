"""Every knob of admission in one value object, read from ``GATEWAY_ADMISSION_*`` (the
env/CLI mapping is in gateway/README.md), and the names the other admission modules share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, get_args

from contracts import formulas
from contracts.schema import AdmissionClass

# The class a single request is admitted under. A reserved tenant above its own floor is
# routed as "standard": the floor is what it bought, the rest is shared like anyone's.
EffectiveClass = AdmissionClass
Strategy = Literal["p2c", "emptiest", "round_robin", "cache_aware"]
# "concurrency": an API key's own cap on its requests in flight (per-key limits)
Layer = Literal["requests", "tokens", "kv_seconds", "concurrency"]

# Layers that can be switched off for comparisons (the noisy-neighbour benchmark's
# "requests/min only" arm): the three quota layers, per-replica capacity, retry budget.
LAYERS = ("requests", "tokens", "kv_seconds", "capacity", "retry_budget", "long_context")
ENV_PREFIX = "GATEWAY_ADMISSION_"

# vLLM's --scheduling-policy priority runs lower values first; the replica's scheduler
# must agree with the gateway about who matters most when it has to preempt.
VLLM_PRIORITY: dict[str, int] = {"reserved": 0, "standard": 1, "best_effort": 2}


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Every knob of admission in one value object (env/CLI mapping in gateway/README.md)."""

    # docs/design.md §7 / R2: per-replica KV occupancy ceilings by class.
    standard_max_occupancy: float = 0.85
    best_effort_max_occupancy: float = 0.60
    reserved_max_occupancy: float = formulas.RESERVED_MAX_OCCUPANCY
    # docs/design.md §7: reserved floors are sold against this share of the reserved pool (a written
    # capacity-planning decision, not a scheduler parameter).
    reserved_oversubscription: float = formulas.RESERVED_OVERSUBSCRIPTION
    # Residence time that converts GiB·s floors into GiB of KV when sizing the pool:
    # the p95 output (1,200 tokens, docs/design.md §2) at the 40 ms TPOT target.
    pool_sizing_residence_s: float = formulas.POOL_SIZING_RESIDENCE_S
    # KV estimate: est_out = effective max_output, optionally capped (0 = no cap). The
    # default charges the full max_output: pessimistic, so the KV layer never over-admits
    # (docs/design.md §6 "charge max_tokens at admission"); the lease is released at the terminal
    # event.
    est_out_cap: int = 0
    # docs/design.md R1.
    tpot_window_s: float = 30.0
    tpot_max_factor: float = 4.0
    tpot_stale_after_s: float = 60.0
    tpot_stale_factor: float = 2.0
    # docs/design.md R4 leases.
    lease_ttl_s: float = 15.0
    lease_renew_s: float = 5.0
    # docs/design.md R5 routing.
    # P2C until cache-aware routing has its noisy-neighbour comparison and its per-request
    # cost is settled (gateway/README.md, "Cache-aware routing"); cache_aware is opt-in.
    strategy: Strategy = "p2c"
    optimistic_inflight: bool = True
    # A dispatch this close before a scrape may not be in the scraped figure yet.
    inflight_grace_s: float = 0.05
    # Cache-aware routing (``choose_cache_aware``): bounded load — a replica is a candidate
    # for affinity only while its load is at most max(mean x factor, mean + slack) of the
    # eligible replicas'; the expected prefill time saved is weighed against load at
    # ``affinity_load_cost_s`` seconds per unit of occupancy; prompt tokens prefilled per
    # second turn cached tokens into seconds saved (the profile's prefill rate).
    affinity_load_factor: float = 1.25
    affinity_load_slack: float = 0.10
    affinity_load_cost_s: float = 0.25
    affinity_prefill_tokens_per_s: float = 30_000.0
    # Queued prefill (tokens this process dispatched to a replica, no first token yet) up to
    # one engine step's token budget runs alongside a new request (chunked prefill batches
    # them); only what is beyond it delays the new one.
    affinity_queue_free_tokens: int = 8192
    # Placement fairness: a prefix nobody holds goes to one of this many replicas chosen per
    # tenant (rendezvous hashing on the tenant), so a tenant churning unique prompts evicts
    # other tenants' prefixes on those replicas only; 0 = the whole fleet.
    affinity_tenant_replicas: int = 0
    # A prompt nobody holds (no client hint, no tenant replicas): on, it goes to the less
    # loaded of its placement key's two rendezvous choices — the same two in every gateway
    # process, so processes that cannot see each other's placements (several processes
    # without KV events) still meet on a new shared prefix — and a conversation goes to the
    # one of its system prompt's pair its conversation key picks
    # (``placement._place_conversation``); off, it is placed exactly as P2C places it (the
    # same draw from the router's rng). The gateway turns it off when KV
    # events feed its index, unless GATEWAY_ADMISSION_AFFINITY_RENDEZVOUS says otherwise.
    affinity_rendezvous: bool = True
    # With affinity_rendezvous, a chat request keyed by its conversation that continues it (a
    # first turn takes the better of two, ``placement._place_conversation``): on, it goes to its
    # conversation's replica (``placement._place_conversation``) while that replica's scraped
    # occupancy is at most the load bound on scraped occupancy plus this margin, whatever this
    # process placed before (but a conversation this process saw spill stays where it went
    # until the replica is back under the bound), so that every gateway process (each sees
    # the same scrape) computes the same replica; off, as before: a conversation this process
    # placed follows its own record, and the bound counts this process's in-flight KV.
    affinity_conversation_shared: bool = True
    affinity_conversation_margin: float = 0.20
    # With affinity_conversation_shared: a conversation's first turn takes the better of two
    # (its conversation's replica on a tie), else (off, before) its conversation's replica;
    # and a later turn goes where this process sent the turn just before it, if it did (that
    # replica holds the whole history), within the bound plus the margin, else (off, before)
    # to its conversation's replica (``placement._place_conversation``).
    affinity_conversation_first_turns: bool = True
    affinity_conversation_latest: bool = True
    # docs/design.md R6: retry budget over a sliding minute.
    retry_budget_ratio: float = 0.20
    retry_budget_min_admitted: int = 20
    retry_budget_window_s: float = 60.0
    storm_retry_after_s: tuple[float, float] = (30.0, 60.0)
    # R6's identity of retries (gateway/admission/retrymemory.py): the recent retryable
    # failures per process (entries, age) and their shared marks in Redis.
    retry_memory_entries: int = 50_000
    retry_memory_ttl_s: float = 60.0
    retry_memory_shared: bool = True
    # docs/design.md R6: every retry-after is base + uniform jitter.
    quota_jitter_fraction: float = 0.5
    quota_jitter_min_ms: int = 500
    capacity_retry_base_ms: int = 5_000
    capacity_jitter_ms: int = 5_000
    # docs/design.md §8: with Redis down, KV·seconds fails closed to this share of each tenant's
    # cap, enforced in-process (per gateway process, hence a conservative fraction).
    local_kv_fraction: float = 0.25
    # Floors, not strict priority (docs/design.md §7): above its 0.60 ceiling, best-effort traffic
    # may still take this share of a gateway process's admissions (at least one request per
    # window) on replicas under the standard ceiling, so it is never starved to zero.
    best_effort_floor_share: float = 0.05
    best_effort_floor_window_s: float = 10.0
    # Early dispatch: the upstream request leaves while its quota answer is on the way when
    # this process's last answer for the tenant-model left at least this share of every
    # limit free (after the other early requests still awaiting theirs), was at most this
    # old, and fewer than ``early_dispatch_max_pending`` are awaiting theirs. The answer
    # stays authoritative: a refusal withdraws the upstream request within its round trip.
    early_dispatch: bool = True
    early_dispatch_margin: float = 0.25
    early_dispatch_max_age_s: float = 1.0
    early_dispatch_max_pending: int = 8
    # Placement (gateway/admission/placement.py). A request's full prompt KV counts against the
    # class ceiling from admission (not as its chunks materialise); long contexts are packed onto
    # the designated replicas and short traffic keeps off them while it has room.
    count_request_kv: bool = True
    context_placement: bool = True
    # With context placement: short reserved traffic keeps off every designated replica
    # (hosting a long context yet or not) while it has room elsewhere.
    reserved_off_long_replicas: bool = True
    # With context placement, on: a reserved long context takes the reserved pool only when
    # no designated shared replica has room (the pool last, not first), so that short floor
    # traffic never queues behind a long prefill in the pool. Off by default: measured, it
    # removed 2 of 4 feasible misses (not a measurable difference at that sample) and left
    # the class's own long contexts queued with other tenants' 128k prompts, first tokens
    # after ~26 s instead of ~2 s (bench/results/fleet_sim_reserved_pool.md).
    reserved_long_off_pool: bool = False
    # The long-context budget: the share of a version's shared replicas that long contexts
    # may occupy (their KV up to the class ceiling), and how many long prefills one replica
    # runs at once (vLLM's --max-long-partial-prefills, default 1).
    long_context_replica_share: float = 0.25
    long_prefill_slots_per_replica: int = 1
    # Two tiers of long contexts, as vLLM's --max-num-partial-prefills beside
    # --max-long-partial-prefills: a "very long" prompt (its expected prefill,
    # estimates.prefill_expected_seconds, over very_long_prefill_ttft_factor TTFT targets)
    # takes one of the long_prefill_slots_per_replica; a shorter long context may also take
    # one of short_long_prefill_slots_per_replica more per designated replica, so a 128k
    # prefill holding the long slot for ~20 targets does not refuse a neighbour's prompt of
    # a few targets. 4 targets (~41k tokens on the 70B profile): alone a lane prompt holds
    # its slot a few seconds, beside a 128k prefill a few times that, still a fraction of the
    # 128k one's ~20 targets, so an ask refused for a busy lane is told a wait its client's
    # retries can span, which a very long prefill outlasts (docs/design.md §7 "Long
    # contexts"). 0 lane slots: one tier, as before. 2 was measured and not adopted: no
    # more prefill beside a 128k prompt (two lane prompts share the rest of each step), no
    # fewer refusals beyond the spread, later first tokens (bench/results/nn_lane2/README.md).
    short_long_prefill_slots_per_replica: int = 1
    very_long_prefill_ttft_factor: float = 4.0
    # With context placement, on: a long context goes to a designated replica with a
    # prefill slot of its tier free (per replica, the slot counts above: the long prefills in
    # flight there, from dispatch to first token, every gateway process's: the ledger records
    # each long context's replica at dispatch and the router reads them back before placing
    # one, ``Limiter.placed`` / ``Limiter.placements``), packing by KV among those; the
    # designated replicas without one only when none has. The long-context floor then
    # charges each replica the leased KV placed there (``placement.long_floors``). Off (the
    # default): packing by KV alone, which stacks several long prefills on one replica, where
    # they share each step's prefill budget and each runs at a fraction of its lone speed;
    # nothing is recorded or read. Measured with four gateway processes
    # (bench/results/fleet_sim_isolation_place2.md): fleet-wide, the stacking ended and the
    # heavy tenants' long contexts completed nearly twice as often, the others' attainment
    # and the reserved class unchanged, but the others' TTFT p95 rose 40-60 ms and placement
    # refused ~1,200-1,400 long contexts the budget had admitted per run (whole contexts do
    # not fit the room the budget counts once they are spread; long_context_fit below ends
    # those, bench/results/fleet_sim_isolation_fit.md); each process's own count
    # alone (before the record) left the stacking as it was and cost the others 0.3-0.4
    # points (bench/results/fleet_sim_isolation_place.md).
    long_prefill_placement: bool = False
    # The long-context budget admits only what some designated replica can hold whole: an
    # ask of ``need`` bytes is judged against the budget less (designated - 1) x need
    # (``long_context.fit_budget``: then, by pigeonhole, some designated replica's
    # long-context floor leaves room for it under the class ceiling). Off (the default):
    # the designated replicas' KV up to the ceiling counts as one pool, and once long
    # contexts spread over the replicas (long_prefill_placement) the room left is in pieces
    # no 128k context fits: placement refused ~1,200-1,400 long contexts the budget had
    # admitted per run (bench/results/fleet_sim_isolation_place2.md). With this rule and
    # fleet-wide placement it refused 1 per run (the one before the first scrape) and the
    # budget's 503s in all fell; with packing by KV (the default placement) it changed
    # nothing measurable, so it stays off (bench/results/fleet_sim_isolation_fit.md).
    long_context_fit: bool = False
    # The share of a replica step's token budget one prefill may take: vLLM's
    # --long-prefill-token-threshold over max_num_batched_tokens (5,242 / 8,192 in the
    # platform's replica command, 655 / 1,024 in the benches). A lane prompt beside a very
    # long prefill gets the rest of each step (long_context.lane_prefill_seconds).
    long_prefill_step_share: float = 0.64
    # A long prefill holds its slot until the request's first token arrives; this multiple
    # of its upper-bound prefill time (estimates.prefill_bound_seconds) is only the safety
    # expiry for a release that never comes (docs/design.md §7 "Long contexts").
    long_prefill_hold_factor: float = 2.0
    # The share of the threshold prompt's prefill time that is attention (the part that
    # grows with the context): estimates.prefill_expected_seconds, the first-token time a
    # long prefill's lease records and a refusal for a full prefill slot is told to wait
    # for. Each version's own is pushed with it (ModelVersionRecord.prefill_attention_share);
    # this is the default for a version pushed without one (an older control plane). 0.10
    # is the realistic 70B profile's (emulator/profiles.py; 0.28 for the 8B one).
    long_prefill_attention_share: float = 0.10
    # A tenant competes for the long-context budget (max-min fair share) while it asked for
    # it within this window.
    long_context_demand_window_s: float = 15.0
    # The long-context hold (gateway/admission/hold.py): a request the budget refuses with a
    # told wait is held by the gateway, waits that wait and asks again, while its whole hold
    # stays within long_context_hold_s, instead of getting the 503 (0: off, the 503 at once;
    # bench/results/nn_hold: no neighbour's long prompt finally refused, their tenants'
    # TPOT tail up to 1.06x pooled: off by default). Per process at most
    # long_context_hold_per_tenant held requests of one tenant and long_context_hold_max in
    # all; past either, the 503 at once.
    long_context_hold_s: float = 0.0
    long_context_hold_per_tenant: int = 4
    long_context_hold_max: int = 64
    # Which layers are enforced (all by default).
    layers: frozenset[str] = frozenset(LAYERS)

    def enforces(self, layer: str) -> bool:
        return layer in self.layers

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AdmissionConfig:
        """Every field from ``GATEWAY_ADMISSION_<FIELD>`` (upper case) when set: numbers as
        numbers, booleans as 1/0/true/false, ``STORM_RETRY_AFTER_S`` as ``low,high`` and
        ``LAYERS`` as a comma list. Raises ValueError naming the variable on bad input."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = ENV_PREFIX + f.name.upper()
            raw = env.get(name, "").strip()
            if not raw:
                continue
            default = getattr(cls(), f.name)
            try:
                values[f.name] = _parse(raw, default)
            except ValueError as exc:
                raise ValueError(f"{name}={raw!r}: {exc}") from None
        try:
            return replace(cls(), **values)
        except ValueError as exc:
            raise ValueError(f"{ENV_PREFIX}*: {exc}") from None

    def __post_init__(self) -> None:
        for name in (
            "standard_max_occupancy",
            "best_effort_max_occupancy",
            "reserved_max_occupancy",
            "reserved_oversubscription",
            "retry_budget_ratio",
            "local_kv_fraction",
            "early_dispatch_margin",
            "long_context_replica_share",
        ):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if not (
            self.best_effort_max_occupancy
            <= self.standard_max_occupancy
            <= self.reserved_max_occupancy
        ):
            raise ValueError("occupancy ceilings must satisfy best_effort <= standard <= reserved")
        if self.lease_renew_s * 2 >= self.lease_ttl_s:
            raise ValueError("lease_renew_s must be under half of lease_ttl_s")
        if self.retry_memory_entries < 1 or self.retry_memory_ttl_s <= 0:
            raise ValueError("retry_memory_entries >= 1 and retry_memory_ttl_s > 0")
        lo, hi = self.storm_retry_after_s
        if not 0 < lo <= hi:
            raise ValueError("storm_retry_after_s must be (low, high) with 0 < low <= high")
        if self.est_out_cap < 0 or self.tpot_max_factor < 1 or self.tpot_stale_factor < 1:
            raise ValueError("est_out_cap >= 0, tpot factors >= 1")
        if self.affinity_load_factor < 1 or self.affinity_load_slack < 0:
            raise ValueError("affinity_load_factor >= 1 and affinity_load_slack >= 0")
        if self.affinity_load_cost_s <= 0 or self.affinity_prefill_tokens_per_s <= 0:
            raise ValueError("affinity_load_cost_s > 0 and affinity_prefill_tokens_per_s > 0")
        if self.affinity_conversation_margin < 0:
            raise ValueError("affinity_conversation_margin >= 0")
        if self.affinity_tenant_replicas < 0:
            raise ValueError("affinity_tenant_replicas >= 0")
        if self.long_prefill_slots_per_replica < 1 or self.long_context_demand_window_s <= 0:
            raise ValueError("long_prefill_slots_per_replica >= 1, demand window > 0")
        if self.short_long_prefill_slots_per_replica < 0 or self.very_long_prefill_ttft_factor < 1:
            raise ValueError("short_long_prefill_slots_per_replica >= 0, very_long factor >= 1")
        if not 0 < self.long_prefill_step_share < 1:
            raise ValueError("0 < long_prefill_step_share < 1")
        if self.long_prefill_hold_factor < 1:
            raise ValueError("long_prefill_hold_factor >= 1")
        if self.long_context_hold_s < 0:
            raise ValueError("long_context_hold_s >= 0 (0: off)")
        if self.long_context_hold_per_tenant < 1 or self.long_context_hold_max < 1:
            raise ValueError("long_context_hold_per_tenant >= 1, long_context_hold_max >= 1")
        if not 0 <= self.long_prefill_attention_share <= 1:
            raise ValueError("0 <= long_prefill_attention_share <= 1")
        if self.strategy not in get_args(Strategy):
            raise ValueError(f"strategy must be one of {get_args(Strategy)}")
        unknown = set(self.layers) - set(LAYERS)
        if unknown:
            raise ValueError(f"unknown layers {sorted(unknown)}; known: {', '.join(LAYERS)}")


def _parse(raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected a boolean")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    if isinstance(default, tuple):
        lo, hi = (float(x) for x in raw.split(","))
        return (lo, hi)
    if isinstance(default, frozenset):
        return frozenset(x.strip() for x in raw.split(",") if x.strip())
    return raw
