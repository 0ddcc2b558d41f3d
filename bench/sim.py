"""The simulation core of the routing scenarios (bench/herd.py, bench/fleet_sim.py,
bench/prefix_routing.py): the emulator's own ``Engine`` stepped in virtual time, and the
gateway's own ``gateway.admission.router.Router`` fed the way the gateway feeds it — occupancy only
through a scrape every ``scrape_s``, first tokens and finishes as the relay reports them.
Arrivals come from ``bench.workload.poisson_arrivals``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bench.workload import DESIGN_OUTPUT, poisson_arrivals
from contracts import schema
from emulator.engine import Engine, StepResult
from emulator.profiles import Profile, prefill_attention_share
from emulator.replica_flags import platform_engine_config
from gateway.admission.config import AdmissionConfig
from gateway.admission.estimates import est_out_for_kv, expected_duration_ms
from gateway.admission.long_context import (
    LeaseTimes,
    LongContextTier,
    displaced,
    long_context_admits,
    long_context_budget,
    long_context_lane_slots,
    long_context_tier,
    long_context_wait_ms,
    slot_share_reached,
    takes_a_waiters_slot,
    waiting_ahead,
    waiting_score,
    yield_wait_ms,
    yields_to_waiting,
)
from gateway.admission.replicas import ReplicaState
from gateway.admission.retry import long_context_retry_earliest_ms
from gateway.admission.router import Router

HEAVY_PROMPT = 128_000  # a flooding tenant's prompt (plus its output fits the context)


class SimRegistry:
    """The two queries ``Router`` makes of ``gateway.admission.replicas.ReplicaRegistry``, over
    ``ReplicaState`` objects that the simulated scrape fills like the real scraper does."""

    def __init__(self, version: str, states: Sequence[ReplicaState]) -> None:
        self._version = version
        self._list = list(states)
        self._by_id = {s.replica_id: s for s in states}

    def states(self, version: str) -> list[ReplicaState]:
        return self._list if version == self._version else []

    def state(self, replica_id: str) -> ReplicaState | None:
        return self._by_id.get(replica_id)


def replica_records(
    n: int, name: Callable[[int], str] = "r{}".format, reserved: int = 0
) -> list[schema.ReplicaRecord]:
    """``n`` replicas as the read model lists them (addresses are never dialled): the first
    ``reserved`` form the reserved pool (docs/design.md R2), the others are shared."""
    return [
        schema.ReplicaRecord(name(i), f"sim://{name(i)}", "reserved" if i < reserved else "shared")
        for i in range(n)
    ]


def sim_engine(profile: Profile, seed: int, long_prefill_tokens: int = 0) -> Engine:
    """One replica's ``Engine`` with the platform's flags, prefix caching off (the routing
    simulations' prompts are unique) and ``--long-prefill-token-threshold``
    ``long_prefill_tokens`` (0 = no cap; the platform's replica command sets 4 % of the
    context, catalog/replica.py)."""
    flags = platform_engine_config(
        enable_prefix_caching=False, long_prefill_token_threshold=long_prefill_tokens
    )
    return Engine(profile, flags, seed=seed)


def heavy_arrivals(seed: int, rate_rps: float, start: float, end: float) -> list[tuple[float, int]]:
    """A flooding tenant's ``HEAVY_PROMPT`` requests on [start, end): (arrival, output
    tokens), Poisson at ``rate_rps`` from ``seed``, outputs of the design's shape capped at
    3,000 (so that prompt and output fit the context)."""
    rng = np.random.default_rng(seed)
    return [
        (float(t), int(min(3_000, max(1, DESIGN_OUTPUT.sample(rng, 1)[0]))))
        for t in poisson_arrivals(rng, rate_rps, start, end)
    ]


@dataclass(slots=True)
class SimLease:
    """One long-context lease as the admit script records it (gateway/admission/quota.py's
    lease and its 'p:' admission record): its tenant and KV bytes, the time (s) its prefill
    slot is held until (its safety expiry, moved to its first token's arrival), in the
    store's ms when it was admitted, when its first token is expected and when it is
    expected to end, and its tier (``long_context.is_very_long``; False: it may have taken
    the lane, the record's ':s')."""

    tenant: str
    kv: int
    prefill_end: float
    admitted_ms: int = -1
    first_token_due_ms: int = -1
    expected_end_ms: int = 0
    very_long: bool = True
    replica: str = ""  # where it was dispatched (``placed``); "" until then

    def times(self, expires: int = -1) -> LeaseTimes:
        """Its times as the gateway's ``long_context_wait_ms`` reads them (``expires``: its
        lease expiry, ``LongContextLedger.lease_expiry``; -1: not recorded)."""
        return LeaseTimes(
            prefill_end=store_ms(self.prefill_end),
            expected_end=self.expected_end_ms,
            admitted=self.admitted_ms,
            first_token_due=self.first_token_due_ms,
            very_long=self.very_long,
            kv=self.kv,
            expires=expires,
        )


@dataclass(frozen=True, slots=True)
class SimDue:
    """A refused tenant's due-back as the admit script records it ('d:<tenant>'): when it is
    due back (ms, its refusal plus the earliest retry-after it may be told), its ask's
    expected prefill (ms) and whether that ask was shorter than very long (the ':s')."""

    at: int
    prefill_ms: int
    short: bool = False


@dataclass(frozen=True, slots=True)
class _Tiered:
    """The ledger's state one ask reads (the script's ``lc_refusal`` reads it from the
    ledger's fields): KV held, long prefills running (all, and the very long ones) per
    tenant, and the budget's KV, very long slots and lane slots."""

    usage: dict[str, int]
    prefill_by: dict[str, int]
    long_by: dict[str, int]
    budget: int
    slots: int
    lane: int

    @property
    def prefilling(self) -> int:
        return sum(self.prefill_by.values())

    @property
    def long_prefilling(self) -> int:
        return sum(self.long_by.values())


def store_ms(t: float) -> int:
    """A virtual time (s) on the store's clock (integer ms, as Redis ``TIME`` gives it)."""
    return math.floor(t * 1000)


@dataclass(slots=True)
class LongContextLedger:
    """The fleet's long-context ledger (Redis in production, read by the admit script of
    gateway/admission/quota.py) and the budget's decisions and answers on it, from the
    gateway's own pure functions (``long_context.long_context_admits``; a refusal's wait
    from ``long_context_wait_ms`` and ``yield_wait_ms``, the waiting entry from
    ``waiting_score``): leases (``SimLease``: tenant, KV bytes, prefill slot held until,
    admitted, first token expected, expected end), the tenants waiting (-> the entry's
    score, s: it counts until score plus the demand window), each refused tenant's due-back
    (``SimDue``: its refusal plus the earliest retry-after it may be told, its ask's
    expected prefill, ms, and whether that ask was shorter than very long), each tenant's
    last admission, and the admissions per tenant (and when each was).

    The budget's two tiers as the script keeps them (``long_context_tier``: the ask's tier
    and expected first token, the gateway's own function): ``slots`` very long prefills
    and the lane's ``long_context_lane_slots`` more for shorter long contexts (0 when the
    config's ``short_long_prefill_slots_per_replica`` is 0: the one-tier rule), each lease's
    tier, the waiters' tiers (``short_waiters``), and a shorter ask admitted while a very
    long prefill runs expected at its lane estimate (``LongContextTier.first_token_ms``).

    ``tells_waits`` off: the ledger before it (for the comparison arms and the herd
    simulation, whose clients do not retry): no due-backs, so the turn order has no
    backfill and every waiter counts as due now, and a waiting entry lasts the demand
    window from the refusal whatever wait it was told (the fleet simulation's clients were
    then told the fleet-full retry-after, ``capacity_retry_after_ms``)."""

    version: schema.ModelVersionRecord
    shared_replicas: int
    adm: AdmissionConfig
    tells_waits: bool = True
    leases: dict[str, SimLease] = field(default_factory=dict)
    waiting: dict[str, float] = field(default_factory=dict)
    due: dict[str, SimDue] = field(default_factory=dict)
    served: dict[str, float] = field(default_factory=dict)
    admitted_at: dict[str, list[float]] = field(default_factory=dict)

    @property
    def admitted_by(self) -> dict[str, int]:
        """The admissions per tenant."""
        return {who: len(at) for who, at in self.admitted_at.items()}

    def tier(self, prompt: int) -> LongContextTier:
        """A ``prompt``-token ask's tier and expected prefill (``long_context_tier``), as the
        gateway's ``AdmissionController.long_context_ask`` puts them in its ask."""
        return long_context_tier(prompt, self.version, self.adm)

    def prefill_ms(self, prompt: int) -> int:
        """A ``prompt``-token ask's expected first token from admission alone (ms), as the
        gateway's ``AdmissionController.long_context_ask`` puts it in its ask."""
        return self.tier(prompt).prefill_ms

    @property
    def lane_slots(self) -> int:
        """The lane's prefill slots (``long_context_lane_slots``; 0: one tier)."""
        return long_context_lane_slots(self.shared_replicas, self.adm)

    def expected_ms(self, output: int) -> int:
        """How long a lease is expected to hold its KV (ms): its decode at the TPOT estimate,
        as the gateway's ``expected_duration_ms``. The estimate is the target (the floor of
        ``tpot_estimate``: the simulated replicas run at or under it)."""
        est_out = est_out_for_kv(output, self.adm.est_out_cap)
        return expected_duration_ms(est_out, self.version.tpot_target_ms / 1000)

    def admit(
        self, tenant: str, lease: str, need: int, prompt: int, now: float, output: int = 0
    ) -> bool:
        """Whether the budget admits ``need`` KV bytes (prompt and output growth, as the
        gateway charges them) of a ``prompt``-token long context for ``tenant``
        (``ask``)."""
        return self.ask(tenant, lease, need, prompt, now, output) is None

    def ask(
        self, tenant: str, lease: str, need: int, prompt: int, now: float, output: int = 0
    ) -> int | None:
        """The admit script's answer to a long-context ask: None, admitted (the lease is
        held until ``release``, its prefill slot until ``prefilled``); else how long (ms)
        the refused ask should wait before asking again (the script's ``frees_in_ms``, which
        the gateway jitters into the 503's retry-after, ``long_context_retry_after_ms``).
        ``output``: its output tokens (the lease's expected end)."""
        window = self.adm.long_context_demand_window_s
        for who, at in list(self.waiting.items()):
            if at < now - window:
                del self.waiting[who]
        for who in [w for w in self.due if w not in self.waiting]:
            del self.due[who]  # a due-back outlives its waiting entry by one ask at most
        usage: dict[str, int] = {}
        prefill_by: dict[str, int] = {}
        long_by: dict[str, int] = {}  # the very long prefills running, per tenant
        for x in self.leases.values():
            usage[x.tenant] = usage.get(x.tenant, 0) + x.kv
            if x.prefill_end > now:
                prefill_by[x.tenant] = prefill_by.get(x.tenant, 0) + 1
                if x.very_long:
                    long_by[x.tenant] = long_by.get(x.tenant, 0) + 1
        # with long_context_fit, the budget this ask's size is judged against (fit_budget),
        # as the gateway's ask carries it
        budget, slots = long_context_budget(self.version, self.shared_replicas, "standard",
                                            self.adm, need)  # fmt: skip
        tier = self.tier(prompt)
        lane = self.lane_slots
        now_ms = store_ms(now)
        # beside a running very long prefill a shorter ask expects its lane estimate (the
        # script's lc_refusal): for the backfill, its due-back and its lease
        prefill_ms = tier.first_token_ms(sum(long_by.values()))
        first_token_at = now_ms + prefill_ms if self.tells_waits else None
        due = {w: d.at for w, d in self.due.items()}
        # the waiters whose last refused ask was shorter (the script's due-backs with ':s';
        # one with no due-back recorded counts as very long)
        short = {w for w, d in self.due.items() if d.short}
        ledger = _Tiered(usage, prefill_by, long_by, budget, slots, lane)
        if long_context_admits(tenant=tenant, need=need, budget=budget, slots=slots,
                               usage=usage, prefilling=ledger.prefilling,
                               waiting=self.waiting.keys(), served=self.served,
                               prefills=prefill_by, first_token_at=first_token_at,
                               due=due, very_long=tier.very_long, lane_slots=lane,
                               long_prefilling=ledger.long_prefilling, long_prefills=long_by,
                               short_waiters=short):  # fmt: skip
            self.admitted_at.setdefault(tenant, []).append(now)
            self.served[tenant] = now
            # The prefill slot is held until the first token (``prefilled``); the hold is
            # only the gateway's safety expiry for a release that never comes.
            self.leases[lease] = SimLease(tenant, need, now + tier.hold_s, now_ms,
                                          now_ms + prefill_ms,
                                          now_ms + self.expected_ms(output),
                                          very_long=tier.very_long)  # fmt: skip
            self.waiting.pop(tenant, None)
            self.due.pop(tenant, None)
            return None
        wait = self._refusal_wait(tenant, need, ledger, tier.very_long, short, now_ms,
                                  first_token_at)  # fmt: skip
        if not self.tells_waits:
            self.waiting[tenant] = now
            return wait
        window_ms = store_ms(window)
        score = waiting_score(now_ms, wait, window_ms, holds=usage.get(tenant, 0) > 0)
        # never shortened (the script's ZADD GT)
        self.waiting[tenant] = max(self.waiting.get(tenant, now), score / 1000)
        # due back at the earliest retry it is told (the script's ``lc_told``), with its tier
        self.due[tenant] = SimDue(now_ms + long_context_retry_earliest_ms(wait), prefill_ms,
                                  short=not tier.very_long)  # fmt: skip
        return wait

    def _refusal_wait(
        self,
        tenant: str,
        need: int,
        ledger: _Tiered,
        very_long: bool,
        short_waiters: set[str],
        now_ms: int,
        first_token_at: int | None,
    ) -> int:
        """The wait (ms) the admit script tells a refused ask (gateway/admission/quota.py's
        ``lc_refusal``, whose Python spec is ``long_context_wait_ms`` and
        ``yield_wait_ms``): a slot refusal (every slot busy, or every very long one for a
        very long ask; the slot left goes to a tenant waiting ahead; or the tenant runs its
        share of them) waits for a running prefill's expected first token (a very long ask
        refused for the very long slots: a very long prefill's), any other for KV to free
        (the budget's KV: until enough leases are expected to have ended for the ask to fit,
        ``kv_frees_at``; a lease past its expected end by the overrun rule, never past its
        renewed expiry, ``lease_expiry``); a yield at least until the waiters ahead are
        due back and through their prefill."""
        usage, prefill_by = ledger.usage, ledger.prefill_by
        budget, slots, lane = ledger.budget, ledger.slots, ledger.lane
        total, prefilling = sum(usage.values()), ledger.prefilling
        all_slots = slots + lane
        waiting = self.waiting.keys()
        due = {w: d.at for w, d in self.due.items()}
        ahead = waiting_ahead(tenant, waiting, self.served, usage)
        early = displaced(ahead, first_token_at, due)
        early_short = early & short_waiters
        slots_left = all_slots - prefilling - 1
        long_left = slots - ledger.long_prefilling - int(very_long)
        slot_yield = takes_a_waiters_slot(len(early - early_short), len(early_short),
                                          very_long=very_long, slots_left=slots_left,
                                          long_slots_left=long_left)  # fmt: skip
        yields = yields_to_waiting(tenant, waiting, self.served, usage, need=need,
                                   slots_left=slots_left, kv_left=budget - total - need,
                                   first_token_at=first_token_at, due=due,
                                   very_long=very_long, long_slots_left=long_left,
                                   short_waiters=short_waiters)  # fmt: skip
        long_full = very_long and ledger.long_prefilling >= slots
        full = total + need > budget or prefilling >= all_slots or long_full
        # the tenant's share of all slots, or of the very long ones among the tenants waiting
        # for one (the script's two share branches)
        long_waiting = set(waiting) - short_waiters
        share = (
            not full
            and not yields
            and (
                slot_share_reached(tenant, all_slots, prefill_by, waiting)
                or (very_long and slot_share_reached(tenant, slots, ledger.long_by, long_waiting))
            )
        )
        slots_bound = prefilling >= all_slots or long_full or share or (yields and slot_yield)
        wait = long_context_wait_ms(
            (x.times(self.lease_expiry(x, now_ms)) for x in self.leases.values()),
            now_ms,
            slots_bound=slots_bound,
            kv_bound=not slots_bound or total + need > budget,
            long_only=long_full,
            kv_short=total + need - budget,
        )
        if yields:
            back = [(self.due[w].at, self.due[w].prefill_ms) for w in ahead if w in self.due]
            wait = yield_wait_ms(wait, back, now_ms)
        return wait

    def lease_expiry(self, lease: SimLease, now_ms: int) -> int:
        """A held lease's expiry at ``now_ms`` as the gateway keeps it (the expiry set the
        admit script reads): set to its admission plus ``lease_ttl_s`` and renewed every
        ``lease_renew_s`` while its request runs (the simulation's leases all run until
        ``release``); -1 for a lease without an admission recorded."""
        if lease.admitted_ms < 0:
            return -1
        ttl, renew = store_ms(self.adm.lease_ttl_s), store_ms(self.adm.lease_renew_s)
        return lease.admitted_ms + ttl + (now_ms - lease.admitted_ms) // renew * renew

    def prefilled(self, lease: str, at: float) -> None:
        """The first token reached the gateway: the long prefill gives its slot back (its KV
        stays leased until the request ends), as the gateway's ``prefill_done``."""
        held = self.leases.get(lease)
        if held is not None:
            held.prefill_end = at

    def release(self, lease: str) -> None:
        self.leases.pop(lease, None)

    def placed(self, lease: str, replica: str) -> None:
        """The lease's request was dispatched to ``replica``: what a ledger recording each
        long-context lease's replica at dispatch would hold."""
        held = self.leases.get(lease)
        if held is not None:
            held.replica = replica

    def placed_bytes(self, but: str = "") -> dict[str, int]:
        """The long-context KV leased per replica, of the leases dispatched (``placed``),
        but lease ``but``'s own (``Router.note_placed_long``)."""
        out: dict[str, int] = {}
        for lease, x in self.leases.items():
            if x.replica and lease != but:
                out[x.replica] = out.get(x.replica, 0) + x.kv
        return out

    def fleet_bytes(self, but: str = "") -> int:
        """The long-context KV leased fleet-wide, but lease ``but``'s own (what the router's
        ``note_fleet_long`` is told with a budget answer)."""
        return sum(x.kv for lease, x in self.leases.items() if lease != but)


def sim_version(
    version: str,
    family: str,
    profile: Profile,
    records: Sequence[schema.ReplicaRecord],
    *,
    kv_capacity_tokens: int,
    prefill_tokens_per_s: float,
    ttft_target_ms: int = 1000,
) -> schema.ModelVersionRecord:
    """The read model's record of the simulated version, from the engine profile."""
    return schema.ModelVersionRecord(
        version=version,
        family=family,
        context_length=profile.max_model_len,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        tpot_target_ms=profile.tpot_target_ms,
        kv_capacity_tokens=kv_capacity_tokens,
        replicas=tuple(records),
        prefill_tokens_per_s=prefill_tokens_per_s,
        ttft_target_ms=ttft_target_ms,
        prefill_attention_share=prefill_attention_share(profile, ttft_target_ms / 1000),
    )


def scrape(state: ReplicaState, engine: Engine, t: float) -> None:
    """What the gateway's scraper stores after a successful scrape of ``engine`` at ``t``."""
    state.kv_usage, state.running, state.waiting = (
        engine.kv_usage(),
        engine.num_running,
        engine.num_waiting,
    )
    state.scraped_at, state.failures, state.healthy = t, 0, True


def feed(routers: Iterable[Router], record: schema.ReplicaRecord, res: StepResult) -> None:
    """The relay's signals for one engine step: each first token, each finish."""
    routers = tuple(routers)
    for req in res.emitted:
        if req.num_output == 1:  # as the gateway's relay reports first tokens
            for router in routers:
                router.on_first_token(record, req.request_id)
    for req in res.finished:
        for router in routers:
            router.on_finish(record, req.request_id)


@dataclass(slots=True)
class VirtualFleet:
    """Engines stepped together in virtual time, scraped every ``scrape_s``.

    ``run_to(t)`` steps every engine up to ``t``, scraping at each scrape time on the way
    (the router sees occupancy as of the last scrape, as in the gateway); ``on_step`` gets
    each engine step (replica index, result), ``on_scrape`` each scrape time after the
    states are filled. ``now`` is the clock to give the routers.
    """

    engines: Sequence[Engine]
    states: Sequence[ReplicaState]
    scrape_s: float
    on_step: Callable[[int, StepResult], None]
    on_scrape: Callable[[float], None] | None = None
    now: float = 0.0
    _next_scrape: float = 0.0

    def clock(self) -> float:
        return self.now

    def _advance(self, t: float) -> None:
        for i, engine in enumerate(self.engines):
            while engine.has_work() and engine.now < t:
                self.on_step(i, engine.step())
            if not engine.has_work():
                engine.advance_to(t)

    def run_to(self, t: float) -> None:
        while self._next_scrape <= t:
            at = self._next_scrape
            self._advance(at)
            self.now = at
            for engine, state in zip(self.engines, self.states, strict=True):
                scrape(state, engine, at)
            if self.on_scrape is not None:
                self.on_scrape(at)
            self._next_scrape += self.scrape_s
        self._advance(t)
        self.now = t

    def finish(self, t: float) -> None:
        """Step the engines to ``t`` without scraping (the end of a run)."""
        self._advance(t)
        self.now = t
