"""Scenario 4: fleet-scale discrete-event simulation of the 70B fleet at the scale of
docs/design.md §2.

Drives the gateway's own admission and routing code (``gateway.admission.router.Router`` over
``gateway.admission`` policy modules: class ceilings, P2C / pick-emptiest / round robin, optimistic
in-flight; jittered retry-after and the retry budget — imported, not copied) against 44 of
the emulator's own ``Engine`` (70B profile: continuous batching, paged KV, preemption)
stepped in virtual time, at 333 req/s with the heavy-tailed token shape (docs/design.md §2).
Several gateways each keep their own optimistic in-flight view, as in production; all of
them see replica occupancy only through a scrape every 250 ms.
Simplified: no network or gateway CPU time, prefix caching off (the prompts are unique),
clients retry as described per experiment.

``python -m bench.fleet_sim`` writes bench/results/fleet_sim.md and fleet_sim_*.png.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from bench.cliff import CliffPoint, run_engine
from bench.loadgen import sdk_should_retry
from bench.sim import (
    HEAVY_PROMPT,
    LongContextLedger,
    SimRegistry,
    heavy_arrivals,
    replica_records,
    scrape,
    sim_engine,
    sim_version,
)
from bench.stats import (
    TPOT_SLO_S,
    TTFT_SLO_S,
    clopper_pearson_lower,
    lone_prefill_feasible,
    max_min_shares,
)
from bench.stats import fmt_ms as _ms
from bench.stats import fmt_pct as _pct
from bench.stats import percentile as _p
from bench.workload import DESIGN_OUTPUT, DESIGN_PROMPT, poisson_arrivals
from emulator.profiles import LLAMA_70B_TP4_H100, Profile, get_profile, threshold_prefill_rate
from gateway.admission.classes import occupancy_ceiling
from gateway.admission.config import LAYERS, VLLM_PRIORITY, AdmissionConfig, Strategy
from gateway.admission.estimates import long_context_threshold
from gateway.admission.placement import (
    PlacementRequest,
    designated,
    fits_ceiling,
    request_bytes,
)
from gateway.admission.replicas import ReplicaState
from gateway.admission.retry import (
    capacity_retry_after_ms,
    in_retry_storm,
    long_context_retry_after_ms,
    sheds_retry,
    storm_retry_after_ms,
)
from gateway.admission.router import Router
from gateway.admission.routing import ReplicaView

RESULTS = Path(__file__).parent / "results"
PROFILE = "llama-70b-tp4-h100"
SIM_VERSION = "llama-70b-sim"

# Event kinds, ordered so that at equal times steps finish before new arrivals are routed.
_STEP, _SCRAPE, _KILL, _ARRIVE = range(4)


# A replica step at least TPOT_SLO_S long: (start, end, tokens scheduled, sequences scheduled);
# tokens > sequences means a prefill chunk rode in it.
SlowStep = tuple[float, float, int, int]


@dataclass(slots=True)
class SimRequest:
    """One client request as the simulator tracks it (times in model seconds)."""

    rid: int
    tenant_class: str
    prompt: int
    output: int
    arrival: float  # first attempt's arrival at the gateway
    priority: int = 1
    attempt: int = 0
    sent: float = 0.0  # this attempt's dispatch time
    first_token: float | None = None
    finished: float | None = None
    status: str = "pending"  # pending | ok | rejected | error
    replica: int = -1
    gateway: int = -1
    final: bool = False  # completed, or the client gave up
    ended: float = 0.0  # when it became final
    tenant: str = ""
    heavy: bool = False  # a flooding tenant's 128k prompt
    long_lease: bool = False  # holds a lease on the long-context budget
    # Where its time went (the reserved-class miss breakdown, ``miss_causes``): 503s it got,
    # when the replica first scheduled it (this attempt), preemptions before its first
    # token and in all.
    rejections: int = 0
    # Why its last attempt was not served (one of REFUSALS): what a request that was never
    # served ran into, for the reports' "never served" breakdown.
    refusal: str = ""
    scheduled: float | None = None
    preempted_before_first: int = 0
    preemptions: int = 0
    # A long context's prefill on its replica (``long_prefill_contention``), this attempt:
    # the other long prefills in flight there (dispatched, no first token yet) when it was
    # dispatched, of them very long, and the most at once before its first token; its tier,
    # its expected first token (s after dispatch, as its lease records it) and its prefill
    # slot's safety expiry (s after dispatch). -1: not a long context sent to a replica.
    long_beside: int = -1
    long_beside_very: int = -1
    long_beside_max: int = -1
    long_very: bool = False
    long_expected_s: float = 0.0
    long_hold_s: float = 0.0
    # Where a request that is not a long context was dispatched (its last attempt), by the
    # placement bands as gateway 0 saw the designated replicas at the last sample
    # (``short_landing``): LANDED_*; "" before the first sample or without context placement.
    landed: str = ""


@dataclass(frozen=True, slots=True)
class FleetConfig:
    replicas: int = 44
    rate_rps: float = 333.0
    duration_s: float = 150.0
    warmup_s: float = 60.0  # statistics skip the fill-up of an empty fleet
    gateways: int = 4
    scrape_s: float = 0.25
    scrape_failures_unhealthy: int = 3
    strategy: Strategy = "p2c"
    optimistic: bool = True
    class_mix: tuple[float, float, float] = (0.10, 0.80, 0.10)  # reserved, standard, free
    seed: int = 1
    # A replica failure (docs/design.md C6): kill these replicas at kill_at_s; r6 = the retry
    # rules of docs/design.md R6 (jittered retry-after + retry budget).
    kill_at_s: float | None = None
    kill_count: int = 1
    r6: bool = True
    max_attempts: int = 4
    unjittered_retry_after_s: float = 5.0
    sample_s: float = 1.0
    # docs/design.md §2's arithmetic taken literally: every request is the median (800 in, 300 out).
    literal: bool = False
    # Long-context isolation (gateway/admission/placement.py, the long-context budget): off =
    # routing as before it, for the comparison runs of bench/results/fleet_sim_isolation.md.
    isolation: bool = False
    # Standard tenants flooding 128k-token prompts, each at heavy_rps, on top of rate_rps.
    heavy_tenants: int = 0
    heavy_rps: float = 0.4
    # Per heavy tenant, cycled (overrides heavy_rps): unequal demands show the budget's
    # max-min fairness (a tenant asking less than its share gets all it asks).
    heavy_rates: tuple[float, ...] = ()
    tenants: int = 100  # the other traffic's tenants (round robin over request ids)
    # Model seconds the run goes on after duration_s, arrivals and all (the same load), so
    # that requests which arrived by duration_s can finish: without it the end of the run
    # cuts off the long outputs, and the measured requests over-represent short ones, which
    # are the likelier to miss TPOT (a slow step weighs more in a short mean). The run ends
    # as soon as every measured request (not heavy) has resolved.
    drain_s: float = 0.0
    # Replicas of the reserved pool (docs/design.md R2: only floor traffic enters it; the
    # reserved class tries it first, then shared replicas under its 0.92 ceiling); 0 = every
    # replica shared, reserved traffic riding on them with vLLM priority 0.
    reserved_replicas: int = 0
    # The replicas' --long-prefill-token-threshold: the most prompt tokens one request may
    # compute in a step. 0 = no cap (what the simulations ran with so far); the platform's
    # replica command sets 4 % of the context (catalog/replica.py), 5,242 for 131,072.
    long_prefill_tokens: int = 0
    # The reserved pool's replicas' --long-prefill-token-threshold, when it differs from the
    # shared replicas' (``long_prefill_tokens``): a pool launched with its own vLLM flag, so
    # that one prompt's chunk leaves more of each step's --max-num-batched-tokens budget to
    # the other prompts on the replica. 0 = the same as ``long_prefill_tokens``.
    pool_long_prefill_tokens: int = 0
    # AdmissionConfig.reserved_off_long_replicas (False: the rule before it, for the
    # before/after arm of bench/results/fleet_sim_reserved.md).
    reserved_off_long: bool = True
    # AdmissionConfig.reserved_long_off_pool (False, the gateway's default: reserved long
    # contexts take the pool first; bench/results/fleet_sim_reserved_pool.md).
    reserved_long_off_pool: bool = False
    # The long-context ledger as the gateway keeps it (``LongContextLedger.tells_waits``): a
    # budget refusal tells the client the wait the admit script computes (the running
    # prefill's expected first token, the first lease's expected end, the waiters ahead's
    # due-backs) and records its due-back; False: the sim before it, for the comparison arm
    # of bench/results/fleet_sim_isolation_retry.md (told the fleet-full retry-after, 5-10 s;
    # no due-backs; waiting entries last the demand window).
    lc_told_wait: bool = True
    # The long-context budget's lane (AdmissionConfig.short_long_prefill_slots_per_replica,
    # the gateway's default 1): per designated replica, this many more prefill slots for
    # long contexts that are not very long, beside the very long one. 0 = one tier (every
    # long prefill in the one slot per designated replica), the arm of --lane-off
    # (bench/results/fleet_sim_isolation_lane.md).
    lane_slots: int = 1
    # AdmissionConfig.long_prefill_placement (the gateway's default, off): a long context to
    # a designated replica with a prefill slot of its tier free, as each gateway process
    # knows its own long prefills in flight (the arm of --place-own: the gateway before its
    # ledger recorded each long context's replica); off: packing by KV
    # alone. place_shared: each gateway process also sees the other processes' long
    # prefills per replica (``Router.note_long_prefills``, from the simulated ledger, the
    # arm of --place-shared) and the long-context KV leased per replica, which its
    # long-context floor charges where it is (``Router.note_placed_long``,
    # ``placement.long_floors``): what the gateway's ledger gives under
    # long_prefill_placement, which records each long context's replica at dispatch.
    prefill_placement: bool = False
    place_shared: bool = False
    # bench/results/fleet_sim_isolation_place.md, fleet_sim_isolation_place2.md
    # AdmissionConfig.long_context_fit (the gateway's default, off): the budget admits an
    # ask only while some designated replica can hold it whole (``long_context.fit_budget``),
    # the arms of --place-fit and --fit-packed (bench/results/fleet_sim_isolation_fit.md).
    lc_fit: bool = False

    def replica_long_prefill_tokens(self, idx: int) -> int:
        """Replica ``idx``'s --long-prefill-token-threshold (the pool is replicas
        0 .. reserved_replicas - 1, as ``_Gateway`` registers them)."""
        if idx < self.reserved_replicas and self.pool_long_prefill_tokens:
            return self.pool_long_prefill_tokens
        return self.long_prefill_tokens

    def admission(self) -> AdmissionConfig:
        layers = LAYERS if self.isolation else tuple(x for x in LAYERS if x != "long_context")
        return AdmissionConfig(
            strategy=self.strategy,
            optimistic_inflight=self.optimistic,
            count_request_kv=self.isolation,
            context_placement=self.isolation,
            reserved_off_long_replicas=self.reserved_off_long,
            reserved_long_off_pool=self.reserved_long_off_pool,
            short_long_prefill_slots_per_replica=self.lane_slots,
            long_prefill_placement=self.prefill_placement,
            long_context_fit=self.lc_fit,
            layers=frozenset(layers),
        )


@dataclass(slots=True)
class Series:
    t: list[float] = field(default_factory=list)
    occ_max: list[float] = field(default_factory=list)
    occ_mean: list[float] = field(default_factory=list)
    occ_all: list[np.ndarray] = field(default_factory=list)
    arrivals: list[int] = field(default_factory=list)  # first attempts + retries offered
    retries: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    rejected_first: list[int] = field(default_factory=list)  # 503s to first attempts
    errors: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    # With context placement, as gateway 0 sees them (``short_landing``): the designated
    # replicas hosting long contexts, and the mean occupancy of the shared replicas hosting
    # none (where short traffic goes first).
    hosting: list[int] = field(default_factory=list)
    short_band_occ: list[float] = field(default_factory=list)


@dataclass(slots=True)
class SimResult:
    cfg: FleetConfig
    requests: list[SimRequest]
    series: Series
    tokens_out: np.ndarray  # per replica, over the measured window
    preemptions: int
    wall_s: float
    attempts: int = 0
    gave_up: int = 0
    long_refused: int = 0
    long_refused_by: dict[str, int] = field(default_factory=dict)
    long_admitted_at: dict[str, list[float]] = field(default_factory=dict)  # admission times
    long_told_s: list[float] = field(default_factory=list)  # long-context 503s' retry-after
    slow_steps: list[list[SlowStep]] = field(default_factory=list)
    # Long contexts the budget admitted that placement then refused (``placement_refusal``)
    placement_refusals: list[PlacementRefusal] = field(default_factory=list)

    def measured(self) -> list[SimRequest]:
        """Requests that arrived in [warmup_s, duration_s) and resolved before the end of the
        run (still streaming at the end: censored, not counted either way; ``drain_s`` lets
        them finish)."""
        lo, hi = self.cfg.warmup_s, self.cfg.duration_s
        return [r for r in self.requests if lo <= r.arrival < hi and r.final]

    def censored(self) -> int:
        """Measured arrivals (not heavy) still unresolved at the end of the run."""
        lo, hi = self.cfg.warmup_s, self.cfg.duration_s
        return sum(1 for r in self.requests if lo <= r.arrival < hi and not r.final and not r.heavy)

    def ttfts(self, reqs: list[SimRequest] | None = None) -> list[float]:
        rs = self.measured() if reqs is None else reqs
        return [r.first_token - r.sent for r in rs if r.first_token is not None]

    def tpots(self, reqs: list[SimRequest] | None = None) -> list[float]:
        rs = self.measured() if reqs is None else reqs
        return [
            (r.finished - r.first_token) / (r.output - 1)
            for r in rs
            if r.finished is not None and r.first_token is not None and r.output > 1
        ]

    def attainment(self, reqs: list[SimRequest] | None = None) -> float:
        """Share of requests that met both SLOs, TTFT counted from the attempt served (the
        reports' "attainment" columns; ``slo_missed``)."""
        rs = self.measured() if reqs is None else reqs
        if not rs:
            return math.nan
        ok = sum(1 for r in rs if not any(slo_missed(r, from_first_attempt=False)))
        return ok / len(rs)


def slo_missed(r: SimRequest, *, from_first_attempt: bool = True) -> tuple[bool, bool]:
    """(TTFT missed, TPOT missed) for one resolved request. TTFT counts from the first
    attempt's arrival, the 503 waits included, as the fleet sizing counts it: the client
    waited them (``from_first_attempt=False``: from the attempt served). A request never
    served missed TTFT (and has no TPOT)."""
    if r.status != "ok" or r.first_token is None or r.finished is None:
        return True, False
    tpot = (r.finished - r.first_token) / (r.output - 1) if r.output > 1 else 0.0
    start = r.arrival if from_first_attempt else r.sent
    return r.first_token - start >= TTFT_SLO_S, tpot >= TPOT_SLO_S


def _slow_in(steps: list[SlowStep], lo: float, hi: float) -> tuple[float, float]:
    """Seconds of the slow steps ending in (lo, hi]: (those carrying a prefill chunk, the
    decode-only ones). ``steps`` are one replica's, in time order."""
    ends = [e for _, e, _, _ in steps]
    with_prefill = decode_only = 0.0
    for start, end, tokens, seqs in steps[bisect.bisect_right(ends, lo) :]:
        if end > hi:
            break
        if tokens > seqs:
            with_prefill += end - start
        else:
            decode_only += end - start
    return with_prefill, decode_only


# Why a request missed an SLO (``miss_causes``), in the order the report lists them.
CAUSE_NEVER_SERVED = "never served (503s until the client gave up)"
CAUSE_RETRIED = "TTFT: 503 retried (the retry-after waits)"
CAUSE_QUEUED = "TTFT: waited in the replica's queue"
CAUSE_PREEMPTED_PREFILL = "TTFT: preempted before its first token"
CAUSE_SLOW_PREFILL = "TTFT: its prefill stretched by co-batched work"
CAUSE_LONG_PREFILL = "TPOT: prefill chunks in its decode batch"
CAUSE_FULL_DECODE = "TPOT: decode-only steps over 50 ms (KV-heavy batch)"
CAUSE_PREEMPTED_DECODE = "TPOT: preempted while decoding"
CAUSES = (
    CAUSE_NEVER_SERVED, CAUSE_RETRIED, CAUSE_QUEUED, CAUSE_PREEMPTED_PREFILL,
    CAUSE_SLOW_PREFILL, CAUSE_LONG_PREFILL, CAUSE_FULL_DECODE, CAUSE_PREEMPTED_DECODE,
)  # fmt: skip


# Why an attempt was not served (``SimRequest.refusal``): a 503 from the long-context budget,
# from placement (no replica under its class ceiling), from the retry budget (a retry shed
# in a storm), or a transport error (its replica died).
REFUSED_LONG_BUDGET = "long-context budget"
REFUSED_NO_REPLICA = "no replica under its ceiling"
REFUSED_RETRY_BUDGET = "retry budget"
REFUSED_REPLICA_DOWN = "replica down"
REFUSALS = (REFUSED_LONG_BUDGET, REFUSED_NO_REPLICA, REFUSED_RETRY_BUDGET, REFUSED_REPLICA_DOWN)


def never_served_by(reqs: list[SimRequest]) -> dict[str, int]:
    """The resolved requests never served, counted by what their last attempt ran into
    (``SimRequest.refusal``), in the order of ``REFUSALS``."""
    counts = dict.fromkeys(REFUSALS, 0)
    for r in reqs:
        if r.final and r.status != "ok":
            counts[r.refusal] = counts.get(r.refusal, 0) + 1
    return {k: n for k, n in counts.items() if n}


def never_served_cell(share: float, by: dict[str, int]) -> str:
    """The "never served" cell: the share, and when any, how many by refusal."""
    if not by:
        return _pct(share)
    parts = ", ".join(f"{cause} {n}" for cause, n in by.items())
    return f"{_pct(share)} ({sum(by.values())}: {parts})"


def miss_causes(
    r: SimRequest, steps: list[SlowStep], profile: Profile | None = None
) -> tuple[str, ...]:
    """Why ``r`` missed its SLOs, one cause per SLO missed (empty when it met both).

    TTFT: the largest of its three parts, from the first arrival — the 503 retry-after waits
    (until this attempt was sent), the wait in the replica's queue (until first scheduled)
    and the prefill's excess over its lone prefill time on ``profile`` (co-batched decodes
    and other prompts' chunks) — unless it was preempted before its first token. TPOT: a
    preemption while decoding, else whichever kind of step of 50 ms or more
    (``steps``, the replica's) took more of its decode time: those carrying a prefill chunk
    or decode-only ones (a batch whose KV reads alone take 50 ms)."""
    ttft_missed, tpot_missed = slo_missed(r)
    if r.status != "ok" or r.first_token is None or r.finished is None:
        return (CAUSE_NEVER_SERVED,)
    out: list[str] = []
    if ttft_missed:
        if r.preempted_before_first:
            out.append(CAUSE_PREEMPTED_PREFILL)
        else:
            scheduled = r.sent if r.scheduled is None else r.scheduled
            lone = (profile or LLAMA_70B_TP4_H100).prefill_seconds(r.prompt)
            parts = {
                CAUSE_RETRIED: r.sent - r.arrival,
                CAUSE_QUEUED: scheduled - r.sent,
                CAUSE_SLOW_PREFILL: r.first_token - scheduled - lone,
            }
            out.append(max(parts, key=parts.__getitem__))
    if tpot_missed:
        if r.preemptions > r.preempted_before_first:
            out.append(CAUSE_PREEMPTED_DECODE)
        else:
            with_prefill, decode_only = _slow_in(steps, r.first_token, r.finished)
            out.append(CAUSE_LONG_PREFILL if with_prefill >= decode_only else CAUSE_FULL_DECODE)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ClassSLO:
    """One class's attainment of both SLOs per request (``slo_missed``), over some of its
    measured requests, with its misses split by SLO and by cause (``miss_causes``; a request
    that missed both SLOs counts under each)."""

    n: int
    met: int
    ttft_missed: int
    tpot_missed: int
    causes: tuple[tuple[str, int], ...] = ()

    @property
    def attainment(self) -> float:
        return self.met / self.n if self.n else math.nan

    @property
    def missed(self) -> int:
        return self.n - self.met


def class_slo(
    reqs: list[SimRequest], slow_steps: list[list[SlowStep]], profile: Profile | None = None
) -> ClassSLO:
    """``ClassSLO`` of ``reqs`` (resolved requests; ``slow_steps`` per replica)."""
    met = ttft = tpot = 0
    causes: dict[str, int] = {}
    for r in reqs:
        t, d = slo_missed(r)
        ttft += t
        tpot += d
        if not (t or d):
            met += 1
            continue
        steps = slow_steps[r.replica] if 0 <= r.replica < len(slow_steps) else []
        for c in miss_causes(r, steps, profile):
            causes[c] = causes.get(c, 0) + 1
    order = sorted(causes.items(), key=lambda kv: CAUSES.index(kv[0]))
    return ClassSLO(n=len(reqs), met=met, ttft_missed=ttft, tpot_missed=tpot, causes=tuple(order))


def reserved_slo(res: SimResult, feasible_only: bool) -> ClassSLO:
    """The reserved class (enterprise under its floor) over its measured requests, or over
    those whose prompt could meet the TTFT SLO on this hardware model at all
    (``bench.stats.lone_prefill_feasible``; the promise is 99.9 % of these)."""
    reqs = [
        r
        for r in res.measured()
        if r.tenant_class == "reserved"
        and not r.heavy
        and (not feasible_only or lone_prefill_feasible(r.prompt))
    ]
    return class_slo(reqs, res.slow_steps)


def reserved_band_slo(res: SimResult, lo_s: float, hi_s: float) -> ClassSLO:
    """The reserved class over its measured requests whose prompt's lone prefill on the
    profile takes ``lo_s`` <= t < ``hi_s`` (``Profile.prefill_seconds``, the measure behind
    ``lone_prefill_feasible``): where in the feasible range the misses are, and what a
    feasibility margin (a limit below the TTFT SLO) would count."""
    prefill = LLAMA_70B_TP4_H100.prefill_seconds
    reqs = [
        r
        for r in res.measured()
        if r.tenant_class == "reserved" and not r.heavy and lo_s <= prefill(r.prompt) < hi_s
    ]
    return class_slo(reqs, res.slow_steps)


def pool_slo(parts: list[ClassSLO]) -> ClassSLO:
    """Several runs' ``ClassSLO`` as one sample (counts and causes summed), for an attainment
    measured over more requests than one run holds."""
    causes: dict[str, int] = {}
    for c in parts:
        for name, k in c.causes:
            causes[name] = causes.get(name, 0) + k
    return ClassSLO(
        n=sum(c.n for c in parts),
        met=sum(c.met for c in parts),
        ttft_missed=sum(c.ttft_missed for c in parts),
        tpot_missed=sum(c.tpot_missed for c in parts),
        causes=tuple(sorted(causes.items(), key=lambda kv: CAUSES.index(kv[0]))),
    )


FLOOR_REFUSAL = "long-context floor"
CEILING_REFUSAL = "ceiling (scrape + in-flight)"
UNSCRAPED_REFUSAL = "no designated replica scraped yet"


@dataclass(frozen=True, slots=True)
class PlacementRefusal:
    """Why placement refused a long context the budget had admitted, from the views the
    router chose among (``placement_refusal``): its designated replicas, how many of them
    passed the ceiling check, how many would have with no long-context floor
    (``ReplicaView.long_floor``), the sums of their floors and of their loads without it
    (scrape plus this gateway's in-flight KV), in replicas' worth of occupancy, and the
    fleet's long-context KV in flight in standard-ceiling replicas."""

    at: float
    very_long: bool
    designated: int
    fit: int
    fit_without_floor: int
    floor_sum: float
    load_sum: float
    fleet_replicas: float
    # the request's KV with its output growth (``placement.request_bytes``), the largest room
    # any designated replica had left under the class ceiling (its floor included) and the
    # sum of their rooms, in replicas' worth of occupancy
    need: float = 0.0
    largest_room: float = 0.0
    room_sum: float = 0.0

    @property
    def cause(self) -> str:
        if not self.designated:
            return UNSCRAPED_REFUSAL
        if self.fit_without_floor > self.fit:
            return FLOOR_REFUSAL
        return CEILING_REFUSAL


def placement_refusal(
    views: list[ReplicaView], req: PlacementRequest, adm: AdmissionConfig, fleet_bytes: int,
    at: float,
) -> PlacementRefusal:  # fmt: skip
    """Which check refused an admitted long context (``PlacementRefusal``): the ceiling
    check (``placement.fits_ceiling``) on each designated replica with its long-context
    floor and with it taken off."""
    des = [v for v in views if designated(v)]
    cap = des[0].capacity_bytes if des else 0
    per_replica = cap * adm.standard_max_occupancy
    ceiling = occupancy_ceiling(req.cls, adm)
    rooms = [max(0.0, ceiling - v.load(adm.optimistic_inflight)) for v in des]
    return PlacementRefusal(
        at=at,
        very_long=req.very_long,
        designated=len(des),
        fit=sum(1 for v in des if fits_ceiling(v, req, adm)),
        fit_without_floor=sum(1 for v in des if fits_ceiling(replace(v, long_floor=0.0), req, adm)),
        floor_sum=sum(v.long_floor for v in des),
        load_sum=sum(replace(v, long_floor=0.0).load(adm.optimistic_inflight) for v in des),
        fleet_replicas=fleet_bytes / per_replica if per_replica else 0.0,
        need=request_bytes(req) / cap if cap else 0.0,
        largest_room=max(rooms, default=0.0),
        room_sum=sum(rooms),
    )


class _Gateway:
    """One gateway process: its own ``gateway.admission.router.Router`` (P2C / emptiest / round
    robin over ``gateway.admission`` policy modules, optimistic in-flight per dispatch) fed by its
    own scrapes."""

    def __init__(self, n: int, profile: Profile, cfg: AdmissionConfig, seed: int,
                 clock: Callable[[], float], reserved: int = 0) -> None:  # fmt: skip
        # The first ``reserved`` replicas form the reserved pool (docs/design.md R2).
        self.records = replica_records(n, name=str, reserved=reserved)
        self.states = [ReplicaState(record=rec, version=SIM_VERSION) for rec in self.records]
        self.version = sim_version(
            SIM_VERSION, "llama-70b", profile, self.records,
            kv_capacity_tokens=profile.kv_capacity_tokens,
            prefill_tokens_per_s=threshold_prefill_rate(profile, 1.0),
        )  # fmt: skip
        self.rng = random.Random(seed)
        registry = SimRegistry(SIM_VERSION, self.states)
        self.router = Router(registry, self.rng, config=cfg, clock=clock)


class _Replica:
    """An ``Engine`` plus what the event loop needs to know about it."""

    def __init__(self, idx: int, profile: Profile, seed: int, long_prefill_tokens: int = 0) -> None:
        self.idx = idx
        self.engine = sim_engine(profile, seed, long_prefill_tokens)
        self.alive = True
        self.stepping = False

    @property
    def occupancy(self) -> float:
        return self.engine.kv_usage()

    def kill(self) -> list[SimRequest]:
        """The replica dies: every stream on it ends in an error."""
        self.alive = False
        return [req.handle for req in self.engine.requests.values()]


class FleetSim:
    def __init__(self, cfg: FleetConfig, profile: Profile) -> None:
        self.cfg = cfg
        self.profile = profile
        self.kv_bytes = profile.kv_bytes_per_token
        self.adm = cfg.admission()
        self.replicas = [
            _Replica(i, profile, cfg.seed * 7919 + i, cfg.replica_long_prefill_tokens(i))
            for i in range(cfg.replicas)
        ]
        self.now = 0.0
        self.gws = [
            _Gateway(
                cfg.replicas,
                profile,
                self.adm,
                cfg.seed * 1000 + g,
                lambda: self.now,
                reserved=cfg.reserved_replicas,
            )
            for g in range(cfg.gateways)
        ]
        self.rng = random.Random(cfg.seed)
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.series = Series()
        self.requests: list[SimRequest] = []
        # The retry budget is one shared window (Redis in production): (time, is_retry).
        self.window: list[tuple[float, bool]] = []
        self.window_head = 0
        self.attempts = 0
        self.gave_up = 0
        self.open_measured = 0  # measured arrivals (not heavy) not yet resolved
        self.tokens_at_warmup = np.zeros(cfg.replicas, dtype=np.int64)
        self._tick = {"arrivals": 0, "retries": 0, "rejected": 0, "rejected_first": 0, "errors": 0}
        self.long_refused = 0
        self.long_refused_by: dict[str, int] = {}
        self.placement_refusals: list[PlacementRefusal] = []
        # Per replica, its steps of TPOT_SLO_S or longer: (start, end, tokens, sequences).
        self.slow_steps: list[list[SlowStep]] = [[] for _ in range(cfg.replicas)]
        version = self.gws[0].version
        self.long_threshold = long_context_threshold(version)
        # The fleet's long-context ledger (Redis in production).
        self.ledger = LongContextLedger(version, cfg.replicas - cfg.reserved_replicas, self.adm,
                                        tells_waits=cfg.lc_told_wait)  # fmt: skip
        self.long_told_s: list[float] = []
        # Per replica, the long prefills in flight there (lease -> request): dispatched, no
        # first token yet (``long_prefill_contention``'s measurement).
        self.long_prefills: list[dict[str, SimRequest]] = [{} for _ in range(cfg.replicas)]
        # The designated replicas and those of them hosting long contexts at the last sample,
        # as gateway 0 sees them (``SimRequest.landed``)
        self.designated: frozenset[int] = frozenset()
        self.hosting: frozenset[int] = frozenset()

    # -- events ------------------------------------------------------------------------

    def push(self, t: float, kind: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, payload))

    def _generate(self) -> None:
        """The arrivals of [0, duration_s), then those of the drain (``drain_s``) from
        generators of their own, so that the first window's arrivals do not depend on it."""
        cfg = self.cfg
        rid = self._draw(0, 0.0, cfg.duration_s)
        if cfg.drain_s > 0:
            self._draw(rid, cfg.duration_s, cfg.duration_s + cfg.drain_s, salt=1_000_003)

    def _draw(self, rid: int, start: float, end: float, salt: int = 0) -> int:
        """Poisson arrivals of the shape and of the heavy tenants on [start, end), request ids
        from ``rid``; returns the next free id."""
        cfg = self.cfg
        rng = np.random.default_rng(cfg.seed + salt)
        times = poisson_arrivals(rng, cfg.rate_rps, start, end)
        prompts = DESIGN_PROMPT.sample(rng, len(times))
        outputs = DESIGN_OUTPUT.sample(rng, len(times))
        if cfg.literal:
            prompts[:] = 800
            outputs[:] = 300
        classes = rng.choice(3, size=len(times), p=np.asarray(cfg.class_mix))
        names = ("reserved", "standard", "best_effort")
        for i, t in enumerate(times):
            cls = names[int(classes[i])]
            r = SimRequest(
                rid=rid + i,
                tenant_class=cls,
                prompt=int(prompts[i]),
                output=int(outputs[i]),
                arrival=float(t),
                priority=VLLM_PRIORITY[cls],
            )
            r.tenant = f"t{(rid + i) % cfg.tenants}"
            self._add(r)
        rid += len(times)
        for h in range(cfg.heavy_tenants):
            rate = cfg.heavy_rates[h % len(cfg.heavy_rates)] if cfg.heavy_rates else cfg.heavy_rps
            for t, out in heavy_arrivals(cfg.seed * 101 + h + salt, rate, start, end):
                r = SimRequest(rid=rid, tenant_class="standard", prompt=HEAVY_PROMPT,
                               output=out, arrival=t, priority=VLLM_PRIORITY["standard"],
                               tenant=f"heavy-{h + 1}", heavy=True)  # fmt: skip
                rid += 1
                self._add(r)
        return rid

    def _add(self, r: SimRequest) -> None:
        self.requests.append(r)
        self.push(r.arrival, _ARRIVE, r)
        if not r.heavy and self.cfg.warmup_s <= r.arrival < self.cfg.duration_s:
            self.open_measured += 1

    def _resolve(self, r: SimRequest, at: float) -> None:
        """``r`` completed or its client gave up."""
        r.final = True
        r.ended = at
        if not r.heavy and self.cfg.warmup_s <= r.arrival < self.cfg.duration_s:
            self.open_measured -= 1

    # -- the gateway's decision ----------------------------------------------------------

    def _retry_counts(self, now: float) -> tuple[int, int]:
        w, lo = self.window, now - self.adm.retry_budget_window_s
        while self.window_head < len(w) and w[self.window_head][0] < lo:
            self.window_head += 1
        live = w[self.window_head :]
        return len(live), sum(1 for _, r in live if r)

    def _reject(self, r: SimRequest, now: float, retry_after_s: float, refusal: str) -> None:
        """A 503: the client retries at the retry-after, as the openai SDK does while it
        is within the SDK's bound (``bench.loadgen.sdk_should_retry``); past it, not at
        all. Every 503 here asks for a retry-after (``sdk_retry_delay`` honours it)."""
        self._tick["rejected"] += 1
        r.rejections += 1
        r.refusal = refusal
        if r.attempt == 0:
            self._tick["rejected_first"] += 1
        if not sdk_should_retry(503, retry_after_s, None):
            r.status = "rejected"
            self.gave_up += 1
            self._resolve(r, now)
            return
        self._client_retry(r, now + retry_after_s, status="rejected")

    def _client_retry(self, r: SimRequest, at: float, status: str) -> None:
        r.status = status
        if r.attempt + 1 >= self.cfg.max_attempts:
            self.gave_up += 1
            self._resolve(r, at)
            return
        r.attempt += 1
        r.first_token = None
        r.finished = None
        r.scheduled = None
        r.long_beside = r.long_beside_very = r.long_beside_max = -1
        self.push(at, _ARRIVE, r)

    def _arrive(self, r: SimRequest, now: float) -> None:
        cfg = self.cfg
        is_retry = r.attempt > 0
        self.attempts += 1
        self._tick["arrivals"] += 1
        if is_retry:
            self._tick["retries"] += 1
        g = self.rng.randrange(cfg.gateways)
        gw = self.gws[g]
        if cfg.r6:
            admitted, retries = self._retry_counts(now)
            storm = in_retry_storm(admitted, retries, self.adm)
            if sheds_retry(is_retry, r.tenant_class, storm):  # type: ignore[arg-type]
                wait = storm_retry_after_ms(self.adm, gw.rng) / 1000
                self._reject(r, now, wait, REFUSED_RETRY_BUDGET)
                return
        # The gateway's optimistic in-flight charge (gateway/admission/controller.py): prompt + max
        # output.
        est_bytes = (r.prompt + r.output) * self.kv_bytes
        long_context = self.adm.context_placement and r.prompt >= self.long_threshold
        lease = f"{r.rid}.{r.attempt}"
        if long_context and r.tenant_class != "reserved" and self.adm.enforces("long_context"):
            frees_in_ms = self._long_admit(r, lease, now)
            if frees_in_ms is not None:
                self.long_refused += 1
                self.long_refused_by[r.tenant] = self.long_refused_by.get(r.tenant, 0) + 1
                if cfg.lc_told_wait:  # the gateway's 503 (AdmissionController._refusal)
                    wait = long_context_retry_after_ms(frees_in_ms, gw.rng) / 1000
                else:
                    wait = capacity_retry_after_ms(self.adm, gw.rng) / 1000
                self.long_told_s.append(wait)
                self._reject(r, now, wait, REFUSED_LONG_BUDGET)
                return
        if self.adm.context_placement:
            gw.router.note_fleet_long(SIM_VERSION, self.ledger.fleet_bytes(but=lease))
            if cfg.place_shared:
                gw.router.note_placed_long(SIM_VERSION, self.ledger.placed_bytes(but=lease))
            if long_context and cfg.place_shared:
                gw.router.note_long_prefills(SIM_VERSION, self._prefills_by_replica())
        growth = r.output * self.kv_bytes if long_context else 0  # reserved, as the gateway
        record = gw.router.choose(
            gw.version,
            r.tenant_class,
            r.prompt * self.kv_bytes,
            long_context=long_context,
            growth_bytes=growth,
        )
        if record is None:
            if r.long_lease:
                self._placement_refused(gw, r, lease, now)
            self._long_release(r, lease)
            if cfg.r6:
                wait = capacity_retry_after_ms(self.adm, gw.rng) / 1000
            else:
                wait = cfg.unjittered_retry_after_s
            self._reject(r, now, wait, REFUSED_NO_REPLICA)
            return
        idx = int(record.replica_id)
        rep = self.replicas[idx]
        self.window.append((now, is_retry))
        if not rep.alive:
            # Connection refused until the scrape marks it unhealthy: the client retries
            # at once, as client libraries do on a transport error.
            self._long_release(r, lease)
            self._tick["errors"] += 1
            r.refusal = REFUSED_REPLICA_DOWN
            self._client_retry(r, now, status="error")
            return
        very_long = long_context and self.ledger.tier(r.prompt).very_long
        gw.router.on_dispatch(
            record,
            lease,
            est_bytes,
            long_context=long_context,
            growth_bytes=growth,
            very_long=very_long,
        )
        r.gateway = g
        r.sent = now
        r.status = "pending"
        r.replica = idx
        if not long_context and self.designated:
            r.landed = landed(idx, idx < cfg.reserved_replicas, self.designated, self.hosting)
        if long_context:
            self._note_long_prefill(r, lease, idx)
            self.ledger.placed(lease, record.replica_id)
        eng = rep.engine
        eng.advance_to(now)
        req = eng.add_request(
            f"{r.rid}.{r.attempt}",
            [4096 + r.rid % 100_000] * r.prompt,
            r.output,
            priority=r.priority,
            arrival_time=now,
            ignore_eos=True,
        )
        req.handle = r
        if not rep.stepping:
            rep.stepping = True
            self.push(now, _STEP, idx)

    def _long_admit(self, r: SimRequest, lease: str, now: float) -> int | None:
        """The admit script's long-context budget (``LongContextLedger.ask``): None,
        admitted; else the wait (ms) it answers."""
        need = (r.prompt + r.output) * self.kv_bytes  # prompt and output growth, as the gateway
        wait = self.ledger.ask(r.tenant, lease, need, r.prompt, now, output=r.output)
        r.long_lease = wait is None
        return wait

    def _placement_refused(self, gw: _Gateway, r: SimRequest, lease: str, now: float) -> None:
        """Record why placement refused a long context the budget admitted."""
        req = PlacementRequest(
            r.tenant_class,  # type: ignore[arg-type]
            r.prompt * self.kv_bytes,
            True,
            growth_bytes=r.output * self.kv_bytes,
            very_long=self.ledger.tier(r.prompt).very_long,
        )
        views = gw.router.views(gw.version)
        fleet = self.ledger.fleet_bytes(but=lease)
        self.placement_refusals.append(placement_refusal(views, req, self.adm, fleet, now))

    def _prefills_by_replica(self) -> dict[str, tuple[int, int]]:
        """The long prefills in flight per replica, all gateways' (all, very long)."""
        return {
            str(i): (len(d), sum(1 for o in d.values() if o.long_very))
            for i, d in enumerate(self.long_prefills)
            if d
        }

    def _note_long_prefill(self, r: SimRequest, lease: str, idx: int) -> None:
        """Record a long context dispatched to replica ``idx``: the long prefills already in
        flight there, its tier, its expected first token (its lease's record; a reserved one,
        outside the budget, its lone estimate) and its slot's safety expiry."""
        inflight = self.long_prefills[idx]
        tier = self.ledger.tier(r.prompt)
        held = self.ledger.leases.get(lease)
        r.long_beside = len(inflight)
        r.long_beside_very = sum(1 for o in inflight.values() if o.long_very)
        r.long_beside_max = len(inflight)
        r.long_very = tier.very_long
        due_ms = held.first_token_due_ms - held.admitted_ms if held else tier.prefill_ms
        r.long_expected_s = max(1, due_ms) / 1000
        r.long_hold_s = tier.hold_s
        inflight[lease] = r
        for other in inflight.values():
            other.long_beside_max = max(other.long_beside_max, len(inflight) - 1)

    def _long_release(self, r: SimRequest, lease: str) -> None:
        if r.long_lease:
            self.ledger.release(lease)
            r.long_lease = False

    # -- replicas ------------------------------------------------------------------------

    def _step(self, idx: int, now: float) -> None:
        rep = self.replicas[idx]
        if not rep.alive:
            rep.stepping = False
            return
        eng = rep.engine
        eng.advance_to(now)
        res = eng.step()
        if res.duration == 0.0:
            rep.stepping = False
            return
        end = res.end
        if res.duration >= TPOT_SLO_S:
            self.slow_steps[idx].append(
                (res.start, end, res.num_scheduled_tokens, res.num_scheduled_seqs)
            )
        for req in res.emitted:
            if req.num_output == 1:
                h = req.handle
                h.first_token = end
                h.scheduled = req.first_scheduled_time
                h.preempted_before_first = req.num_preemptions
                self.ledger.prefilled(req.request_id, end)
                self.long_prefills[idx].pop(req.request_id, None)
                gw = self.gws[req.handle.gateway]
                gw.router.on_first_token(gw.records[idx], req.request_id)
        for req in res.finished:
            r = req.handle
            gw = self.gws[r.gateway]
            gw.router.on_finish(gw.records[idx], req.request_id)
            self._long_release(r, req.request_id)
            self.long_prefills[idx].pop(req.request_id, None)
            r.finished = end
            r.preemptions = req.num_preemptions
            r.status = "ok"
            self._resolve(r, end)
        self.push(end, _STEP, idx)

    def _scrape(self, g: int, now: float) -> None:
        gw = self.gws[g]
        for rep, st in zip(self.replicas, gw.states, strict=True):
            if rep.alive:
                scrape(st, rep.engine, now)
            else:
                st.failures += 1
                if st.failures >= self.cfg.scrape_failures_unhealthy:
                    st.healthy = False
        self.push(now + self.cfg.scrape_s, _SCRAPE, g)

    def _kill(self, now: float) -> None:
        alive = [r for r in self.replicas if r.alive]
        for rep in alive[: self.cfg.kill_count]:
            for r in rep.kill():
                # The stream ends with an in-stream error (the gateway's terminal handler
                # settles it); the client retries at once.
                gw = self.gws[r.gateway]
                gw.router.on_finish(gw.records[rep.idx], f"{r.rid}.{r.attempt}")
                self._long_release(r, f"{r.rid}.{r.attempt}")
                self.long_prefills[rep.idx].pop(f"{r.rid}.{r.attempt}", None)
                self._tick["errors"] += 1
                r.refusal = REFUSED_REPLICA_DOWN
                self._client_retry(r, now, status="error")

    def _sample(self, now: float) -> None:
        s = self.series
        occ = np.array([r.occupancy if r.alive else np.nan for r in self.replicas])
        s.t.append(now)
        s.occ_all.append(occ)
        s.occ_max.append(float(np.nanmax(occ)))
        s.occ_mean.append(float(np.nanmean(occ)))
        s.running.append(sum(r.engine.num_running for r in self.replicas if r.alive))
        s.arrivals.append(self._tick["arrivals"])
        s.retries.append(self._tick["retries"])
        s.rejected.append(self._tick["rejected"])
        s.rejected_first.append(self._tick["rejected_first"])
        s.errors.append(self._tick["errors"])
        self._tick = dict.fromkeys(self._tick, 0)
        if self.adm.context_placement:
            # read-only: the views a choice would build (their pruning of settled in-flight
            # entries is what the next choice would do anyway)
            views = self.gws[0].router.views(self.gws[0].version)
            self.designated = frozenset(int(v.replica_id) for v in views if designated(v))
            self.hosting = frozenset(
                int(v.replica_id) for v in views if designated(v) and v.hosts_long
            )
            s.hosting.append(len(self.hosting))
            free = [v.occupancy for v in views if v.pool != "reserved" and not v.hosts_long]
            s.short_band_occ.append(float(np.mean(free)) if free else float("nan"))

    def _tokens(self) -> np.ndarray:
        return np.array([r.engine.stats.generation_tokens for r in self.replicas])

    # -- main loop ------------------------------------------------------------------------

    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        cfg = self.cfg
        started = time.perf_counter()
        self._generate()
        for g in range(cfg.gateways):
            self.push(cfg.scrape_s * g / cfg.gateways, _SCRAPE, g)
        if cfg.kill_at_s is not None:
            self.push(cfg.kill_at_s, _KILL, None)
        next_sample = cfg.sample_s
        warm_done = False
        end = cfg.duration_s + cfg.drain_s
        while self.events:
            t, kind, _, payload = heapq.heappop(self.events)
            if t > end or (t > cfg.duration_s and not self.open_measured):
                break
            self.now = t
            while t >= next_sample:
                self._sample(next_sample)
                if progress:
                    progress(next_sample)
                next_sample += cfg.sample_s
            if not warm_done and t >= cfg.warmup_s:
                warm_done = True
                self.tokens_at_warmup = self._tokens()
            if kind == _STEP:
                self._step(payload, t)  # type: ignore[arg-type]
            elif kind == _ARRIVE:
                self._arrive(payload, t)  # type: ignore[arg-type]
            elif kind == _SCRAPE:
                self._scrape(payload, t)  # type: ignore[arg-type]
            else:
                self._kill(t)
        return SimResult(
            cfg=cfg,
            requests=self.requests,
            series=self.series,
            tokens_out=self._tokens() - self.tokens_at_warmup,
            preemptions=sum(r.engine.stats.num_preemptions for r in self.replicas),
            wall_s=time.perf_counter() - started,
            attempts=self.attempts,
            gave_up=self.gave_up,
            long_refused=self.long_refused,
            long_refused_by=self.long_refused_by,
            long_admitted_at=self.ledger.admitted_at,
            long_told_s=self.long_told_s,
            slow_steps=self.slow_steps,
            placement_refusals=self.placement_refusals,
        )


def simulate(cfg: FleetConfig, profile: Profile | None = None, label: str = "") -> SimResult:
    from tqdm import tqdm

    bar = tqdm(
        total=int(cfg.duration_s),
        desc=f"fleet_sim {label or cfg.strategy}",
        unit="model-s",
        leave=False,
        disable=not sys.stderr.isatty(),
    )
    last = [0]

    def tick(t: float) -> None:
        bar.update(int(t) - last[0])
        last[0] = int(t)

    res = FleetSim(cfg, profile or get_profile(PROFILE)).run(progress=tick)
    bar.close()
    return res


__all__ = ["FleetConfig", "FleetSim", "SimResult", "simulate", "replace"]


# -- experiments ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scale:
    """Durations of the experiments (``quick`` for smoke tests)."""

    duration_s: float = 100.0
    warmup_s: float = 40.0
    kill_at_s: float = 60.0
    replicas: int = 44
    rate_rps: float = 333.0
    gateways: int = 4
    cliff_duration_s: float = 240.0
    cliff_warmup_s: float = 80.0
    drain_s: float = 0.0  # FleetConfig.drain_s
    long_prefill_tokens: int = 0  # FleetConfig.long_prefill_tokens

    def config(self, seed: int) -> FleetConfig:
        """The fleet at this scale: every experiment varies it."""
        return FleetConfig(
            replicas=self.replicas,
            rate_rps=self.rate_rps,
            duration_s=self.duration_s,
            warmup_s=self.warmup_s,
            gateways=self.gateways,
            seed=seed,
            drain_s=self.drain_s,
            long_prefill_tokens=self.long_prefill_tokens,
        )

    @classmethod
    def quick(cls) -> Scale:
        return cls(
            duration_s=16.0,
            warmup_s=6.0,
            kill_at_s=9.0,
            replicas=6,
            rate_rps=40.0,
            gateways=2,
            cliff_duration_s=30.0,
            cliff_warmup_s=10.0,
        )


def experiments(scale: Scale, seed: int = 1) -> dict[str, FleetConfig]:
    base = scale.config(seed)
    return {
        "design-literal": replace(base, literal=True),
        "p2c+inflight": base,
        "emptiest (stale)": replace(base, strategy="emptiest", optimistic=False),
        "round robin": replace(base, strategy="round_robin", optimistic=False),
        "kill, no retry rules": replace(base, kill_at_s=scale.kill_at_s, r6=False),
        "kill, retry rules": replace(base, kill_at_s=scale.kill_at_s, r6=True),
        # The same failure with headroom: 90 % of the rate, no free tier (whose 0.60 ceiling
        # sheds by design), so that any 503 after the kill is the kill's.
        "kill at 90 % load, retry rules": replace(
            base, rate_rps=0.9 * scale.rate_rps, class_mix=(0.1, 0.9, 0.0),
            kill_at_s=scale.kill_at_s, r6=True,
        ),
    }  # fmt: skip


# The two policies the isolation comparison runs side by side, as ``FleetConfig.isolation``.
POLICIES = {"old (P2C + in-flight)": False, "new (isolation)": True}


def isolation_experiments(
    scale: Scale,
    seed: int,
    heavy: int,
    heavy_rates: tuple[float, ...] = (),
    heavy_duration_s: float | None = None,
    chunk_cap: int = 0,
    reserved_pools: tuple[int, ...] = (),
    reserved_rule_off: bool = False,
    reserved_long_rule_on: bool = False,
    pool_caps: tuple[int, ...] = (),
    lc_before: bool = False,
    lane_off: bool = False,
    place_own: bool = False,
    place_shared: bool = False,
    place_fit: bool = False,
    fit_packed: bool = False,
) -> dict[str, FleetConfig]:
    """The several-heavy-tenants variant, old policy against new in one run: ``heavy``
    standard tenants flooding 128k prompts (at ``heavy_rates``, cycled) on top of the
    heavy-tailed shape, run for ``heavy_duration_s`` (long enough for a 128k request to
    finish). With ``chunk_cap``, also the new policy on replicas with that
    --long-prefill-token-threshold; with ``reserved_pools``, also the new policy with a
    reserved pool of each of those sizes out of the same replicas (on such replicas when
    ``chunk_cap`` is given); with ``reserved_rule_off``, also the new policy without
    ``reserved_off_long_replicas`` (reserved short traffic off the hosting replicas only);
    with ``reserved_long_rule_on``, each pool also with ``reserved_long_off_pool``
    (reserved long contexts on the designated shared replicas first, the pool last); with
    ``pool_caps``, each pool also with its replicas at each of those
    --long-prefill-token-threshold values (the shared replicas unchanged); with
    ``lc_before``, also the new policy with the simulated ledger as before it told waits
    (``FleetConfig.lc_told_wait`` off); with ``lane_off``, also the new policy without the
    long-context budget's lane (``FleetConfig.lane_slots`` 0: one tier); with ``place_own``,
    also the new policy placing long contexts by their prefill slots as each gateway knows
    its own (``FleetConfig.prefill_placement``); with ``place_shared``, also that with every
    gateway seeing all long prefills in flight per replica (``FleetConfig.place_shared``);
    with ``place_fit``, also that with the budget admitting only what some designated
    replica can hold whole (``FleetConfig.lc_fit``); with ``fit_packed``, also the new
    policy (packing by KV) with that rule."""
    base = scale.config(seed)
    if heavy_duration_s:
        base = replace(base, duration_s=heavy_duration_s, warmup_s=heavy_duration_s / 3)
    base = replace(base, heavy_tenants=heavy, heavy_rates=heavy_rates)
    out = {
        f"{name}, {heavy} heavy tenants": replace(base, isolation=iso)
        for name, iso in POLICIES.items()
    }
    new = replace(base, isolation=True)
    if lc_before:
        out[f"new, long-context 503s as before, {heavy} heavy tenants"] = replace(
            new, lc_told_wait=False
        )
    if lane_off:
        out[f"new, lane off, {heavy} heavy tenants"] = replace(new, lane_slots=0)
    if place_own:
        out[f"new, prefill slots per gateway, {heavy} heavy tenants"] = replace(
            new, prefill_placement=True
        )
    if place_shared:
        out[f"new, prefill slots fleet-wide, {heavy} heavy tenants"] = replace(
            new, prefill_placement=True, place_shared=True
        )
    if place_fit:
        out[f"new, prefill slots fleet-wide, whole-context budget, {heavy} heavy tenants"] = (
            replace(new, prefill_placement=True, place_shared=True, lc_fit=True)
        )
    if fit_packed:
        out[f"new, whole-context budget, {heavy} heavy tenants"] = replace(new, lc_fit=True)
    if reserved_rule_off:
        out[f"new, reserved on idle designated replicas, {heavy} heavy tenants"] = replace(
            new, reserved_off_long=False
        )
    if chunk_cap:
        new = replace(new, long_prefill_tokens=chunk_cap)
        out[f"new, chunk cap {chunk_cap:,}, {heavy} heavy tenants"] = new
    for k in reserved_pools:
        label = f"new, reserved pool {k}" + (f", chunk cap {chunk_cap:,}" if chunk_cap else "")
        out[f"{label}, {heavy} heavy tenants"] = replace(new, reserved_replicas=k)
        if reserved_long_rule_on:
            out[f"{label}, reserved long contexts off the pool, {heavy} heavy tenants"] = replace(
                new, reserved_replicas=k, reserved_long_off_pool=True
            )
        for c in pool_caps:
            out[f"{label}, pool chunk cap {c:,}, {heavy} heavy tenants"] = replace(
                new, reserved_replicas=k, pool_long_prefill_tokens=c
            )
    return out


@dataclass(frozen=True, slots=True)
class Probe:
    """One fleet size tried by ``fleet_sizing`` for one policy."""

    replicas: int
    ttft_p95: float  # from the first attempt's arrival; a request never served counts as inf
    tpot_p95: float
    attainment: float
    fullest_mean: float
    fullest_p99: float
    refused: float  # share of measured requests that ended refused (gave up)
    wall_s: float
    reserved: ClassSLO = ClassSLO(0, 0, 0, 0)  # the reserved class, all its requests
    reserved_feasible: ClassSLO = ClassSLO(0, 0, 0, 0)  # ... those that could meet TTFT
    censored: int = 0  # measured arrivals still unresolved at the end (``SimResult.censored``)
    # The measured requests never served, by what their last attempt ran into
    # (``never_served_by``).
    refused_by: dict[str, int] = field(default_factory=dict)

    @property
    def holds(self) -> bool:
        return self.ttft_p95 < TTFT_SLO_S and self.tpot_p95 < TPOT_SLO_S


def probe_of(res: SimResult) -> Probe:
    meas = [r for r in res.measured() if not r.heavy]
    ttft = [
        r.first_token - r.arrival if r.status == "ok" and r.first_token is not None else math.inf
        for r in meas
    ]
    occ = np.asarray(res.series.occ_max)[_series_window(res, res.cfg.warmup_s)]
    return Probe(
        replicas=res.cfg.replicas,
        ttft_p95=float(np.percentile(ttft, 95)) if ttft else math.nan,
        tpot_p95=_p(res.tpots(meas), 95),
        attainment=res.attainment(meas),
        fullest_mean=float(np.mean(occ)),
        fullest_p99=_p(list(occ), 99),
        refused=sum(1 for r in meas if r.status != "ok") / max(1, len(meas)),
        wall_s=res.wall_s,
        reserved=reserved_slo(res, feasible_only=False),
        reserved_feasible=reserved_slo(res, feasible_only=True),
        censored=res.censored(),
        refused_by=never_served_by(meas),
    )


def fleet_sizing(scale: Scale, seed: int, lo: int, hi: int, step: int,
                 workers: int = 2) -> dict[str, list[Probe]]:  # fmt: skip
    """Fewest replicas whose fleet holds TTFT p95 < 1 s and TPOT p95 < 50 ms at
    ``scale.rate_rps``, per policy: bisection between ``lo`` (assumed to miss) and ``hi``
    (checked first) down to ``step`` replicas. Each round runs every policy's probe at
    once; the probes of a policy all replay the same seeded arrivals."""
    bounds = {name: [lo, hi] for name in POLICIES}
    probes: dict[str, list[Probe]] = {name: [] for name in POLICIES}
    size = dict.fromkeys(POLICIES, hi)
    while size:
        cfgs = {
            f"{name} @ {n}": replace(scale.config(seed), replicas=n, isolation=POLICIES[name])
            for name, n in size.items()
        }
        for key, res in run_all(cfgs, workers=workers).items():
            name = key.rsplit(" @ ", 1)[0]
            pr = probe_of(res)
            probes[name].append(pr)
            print(f"[fleet_sim] sizing {key}: TTFT p95 {pr.ttft_p95 * 1000:.0f} ms, TPOT p95 "
                  f"{pr.tpot_p95 * 1000:.0f} ms -> {'holds' if pr.holds else 'misses'}",
                  flush=True)  # fmt: skip
            b = bounds[name]
            if pr.holds:
                b[1] = pr.replicas
            elif pr.replicas == hi:
                b[0] = b[1] = hi + 1  # even the top of the range misses: stop, say so
            else:
                b[0] = pr.replicas
        size = {name: (b[0] + b[1]) // 2 for name, b in bounds.items() if b[1] - b[0] > step}
    return probes


def needed(probes: list[Probe]) -> int | None:
    held = [p.replicas for p in probes if p.holds]
    return min(held) if held else None


def heavy_admits(res: SimResult, lo: float, end: float) -> dict[str, dict[str, float]]:
    """Per heavy tenant, the budget's admissions against what it asked for: arrivals
    (``demand``) and budget admissions (``admits``) over the whole run and in [lo, end)
    (``demand_win``, ``admits_win``), and the max-min fair share of the heavy tenants' admits
    given their arrivals (``share``, ``share_win``: a tenant asking for less than an equal
    split gets what it asks for, the others split the rest; ``bench.stats.max_min_shares``)."""
    out = {
        f"heavy-{h + 1}": dict.fromkeys(("demand", "demand_win", "admits", "admits_win"), 0.0)
        for h in range(res.cfg.heavy_tenants)
    }
    for r in res.requests:
        if r.heavy and r.tenant in out:
            out[r.tenant]["demand"] += 1
            out[r.tenant]["demand_win"] += lo <= r.arrival < end
    for t, row in out.items():
        times = res.long_admitted_at.get(t, [])
        row["admits"], row["admits_win"] = len(times), sum(lo <= x < end for x in times)
    for key in ("", "_win"):
        shares = max_min_shares(
            {t: row["demand" + key] for t, row in out.items()},
            sum(row["admits" + key] for row in out.values()),
        )
        for t, row in out.items():
            row["share" + key] = shares[t]
    return out


def _heavy_tenant_table(res: SimResult, lo: float, end: float) -> list[str]:
    """Per heavy tenant: offered, arrived, the budget's admissions against their max-min
    fair share of the heavy admits given what each asked for (``heavy_admits``), refused by
    the budget, requests whose client gave up (its attempts spent, or a retry-after past
    the SDK's bound), prefilled 128k prompts and their share of the prefilled long-context work,
    completed requests and goodput."""
    prefilled: dict[str, int] = {}
    done: dict[str, int] = {}
    gave_up: dict[str, int] = {}
    for r in res.requests:
        if not r.heavy:
            continue
        prefilled.setdefault(r.tenant, 0)
        done.setdefault(r.tenant, 0)
        gave_up[r.tenant] = gave_up.get(r.tenant, 0) + (r.final and r.status != "ok")
        if r.first_token is not None and lo <= r.first_token <= end:
            prefilled[r.tenant] += r.prompt
        if r.status == "ok" and r.finished is not None and lo <= r.finished <= end:
            done[r.tenant] += 1
    total = sum(prefilled.values())
    adm = heavy_admits(res, lo, end)
    rate = {
        f"heavy-{h + 1}": (res.cfg.heavy_rates[h % len(res.cfg.heavy_rates)]
                           if res.cfg.heavy_rates else res.cfg.heavy_rps)
        for h in range(res.cfg.heavy_tenants)
    }  # fmt: skip
    rows = [
        "| heavy tenant | offered req/s | arrived (whole run / in window) | budget admits "
        "(whole run / in window) | max-min share of the admits (whole run / in window) | "
        "budget 503s (whole run) | gave up (whole run) | 128k prefills done in window | "
        "share of long-context work served | completed in window | goodput req/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cells = [
        [t, f"{rate.get(t, 0):g}", f"{a['demand']:.0f} / {a['demand_win']:.0f}",
         f"{a['admits']:.0f} / {a['admits_win']:.0f}",
         (f"{a['share']:.1f} / {a['share_win']:.1f}" if a["share"] else "—"),
         res.long_refused_by.get(t, 0), gave_up.get(t, 0),
         prefilled.get(t, 0) // HEAVY_PROMPT,
         _pct(prefilled.get(t, 0) / total) if total else "—",
         done.get(t, 0), f"{done.get(t, 0) / (end - lo):.3f}"]
        for t, a in sorted(adm.items(), key=lambda x: int(x[0].split("-")[1]))
    ]  # fmt: skip
    rows.extend(_md_row(c) for c in cells)
    spans = []
    for key, where in (("", "whole run"), ("_win", "in window")):
        got = [a["admits" + key] / a["share" + key] for a in adm.values() if a["share" + key]]
        if got:
            spans.append(f"{min(got):.2f}–{max(got):.2f}× ({where})")
    if spans:
        rows += ["", "Budget admits over the max-min share, smallest–largest: " + ", ".join(spans)]
    return rows


def write_isolation_report(
    results: dict[str, SimResult],
    scale: Scale,
    command: str,
    out_dir: Path = RESULTS,
    sizing_probes: dict[str, list[Probe]] | None = None,
    load: str = "",
    report_name: str = "fleet_sim_isolation.md",
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    any_cfg = next(iter(results.values())).cfg
    rates = any_cfg.heavy_rates or (any_cfg.heavy_rps,)
    rows = [
        "# Fleet simulation — long-context isolation (new policy) against the old policy",
        "",
        f"Command: `{command}`",
        "",
        f"Emulator `Engine`s ({PROFILE}, realistic prefill"
        + (
            f"; every replica of every run, both policies and the sizing probes, with "
            f"--long-prefill-token-threshold {scale.long_prefill_tokens:,} as the platform's "
            "replica command sets it"
            + (
                ", except the reserved pool's replicas in the runs labelled 'pool chunk cap'"
                if any(r.cfg.pool_long_prefill_tokens for r in results.values())
                else ""
            )
            if scale.long_prefill_tokens
            else ""
        )
        + f") in virtual time (the machine's "
        f"load does not enter the figures{'; ' + load if load else ''}), {scale.rate_rps:g} "
        "req/s Poisson of the heavy-tailed shape (docs/design.md §2), classes 10 % reserved / "
        f"80 % standard / 10 % free, {scale.gateways} gateways, scrapes every 250 ms. "
        "**new** = the long-context budget (max-min fair shares of its KV and of its prefill "
        "slots, least recently served first while room is scarce), the ceilings counting "
        "each request's own prompt KV, long contexts packed onto the designated replicas "
        "(a quarter of the fleet) and short traffic kept off them; "
        "**old** = the same replicas and gateways with none of that: P2C + optimistic "
        "in-flight, no long-context budget, no context-aware placement. Both policies "
        "replay the same arrivals.",
        "",
    ]
    if sizing_probes:
        rows += [
            f"## Replicas needed for both SLOs at {scale.rate_rps:g} req/s, heavy-tailed shape",
            "",
            f"Bisection on the fleet size per policy ({scale.duration_s:g} model-s per probe, "
            f"statistics after {scale.warmup_s:g} s"
            + (
                f"; each probe goes on {scale.drain_s:g} model-s past its end, arrivals and "
                "all, so that the measured requests can finish"
                if scale.drain_s
                else ""
            )
            + "). A size holds when TTFT p95 < 1 s and TPOT "
            "p95 < 50 ms over the measured requests, TTFT counted from the first attempt's "
            "arrival (503 waits included) and a request never served counted as a miss. "
            "Never served: measured requests whose client gave up after its "
            f"{any_cfg.max_attempts} attempts, with how many by what their last attempt ran "
            "into (a 503 from the long-context budget, from placement — no replica under its "
            "class ceiling — or from the retry budget, or its replica down); requests still "
            "unresolved at the end are censored, not counted.",
            "",
        ]
        sizes = {p.replicas for probes in sizing_probes.values() for p in probes}
        single = len(sizes) == 1 and all(len(ps) == 1 for ps in sizing_probes.values())
        if single:
            rows += [
                f"One probe per policy at {sizes.pop()} replicas (--size-range left nothing "
                'to bisect): "holds" is that size\'s verdict, not the fewest replicas that '
                "hold.",
            ]
        for name, probes in sizing_probes.items():
            if single:
                break
            n = needed(probes)
            rows.append(
                f"- **{name}: {n} replicas** ({n * 4} GPUs)" if n else
                f"- **{name}: more than {max(p.replicas for p in probes)} replicas**"
            )  # fmt: skip
        rows += [
            "",
            "| policy | replicas | TTFT p95 ms | TPOT p95 ms | holds | attainment | mean of "
            "fullest replica | p99 of fullest | never served | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, probes in sizing_probes.items():
            for p in sorted(probes, key=lambda x: x.replicas):
                rows.append(
                    _md_row([
                        name, p.replicas, _ms(p.ttft_p95), _ms(p.tpot_p95),
                        "yes" if p.holds else "no", _pct(p.attainment),
                        f"{p.fullest_mean:.3f}", f"{p.fullest_p99:.3f}",
                        never_served_cell(p.refused, p.refused_by),
                        f"{p.wall_s:.0f}",
                    ])
                )  # fmt: skip
        rows.append("")
    rows += [
        f"## Several heavy tenants, {any_cfg.replicas} replicas",
        "",
        f"{any_cfg.heavy_tenants} standard tenants each send 128,000-token prompts (output: "
        f"the shape's, at most 3,000) at {', '.join(f'{r:g}' for r in rates)} req/s (cycled) "
        f"on top of the {scale.rate_rps:g} req/s; the simulation models no per-tenant rate "
        f"limits, so these are inside them. {any_cfg.duration_s:g} model-s per run, "
        f"statistics over [{any_cfg.warmup_s:g}, {any_cfg.duration_s:g}] s.",
        "",
        "| run | attainment (others) | others' TTFT p95 / p99 ms | others' TPOT p95 ms | "
        "standard TTFT / TPOT p95 | free TTFT / TPOT p95 | mean of fullest replica | p99 of "
        "fullest | 503 / attempts | long-context 503s | their retry-after p50 / p95 / max s "
        "| wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        lo = res.cfg.warmup_s
        meas = [r for r in res.measured() if not r.heavy]
        win = _series_window(res, lo)
        occ_max = np.asarray(res.series.occ_max)[win]
        rejected = int(np.sum(np.asarray(res.series.rejected)[win]))
        arrivals = int(np.sum(np.asarray(res.series.arrivals)[win]))

        def cls(c: str, meas: list[SimRequest] = meas, res: SimResult = res) -> str:
            sub = [r for r in meas if r.tenant_class == c]
            return f"{_ms(_p(res.ttfts(sub), 95))} / {_ms(_p(res.tpots(sub), 95))}"

        rows.append(
            _md_row([
                name, _pct(res.attainment(meas)),
                f"{_ms(_p(res.ttfts(meas), 95))} / {_ms(_p(res.ttfts(meas), 99))}",
                _ms(_p(res.tpots(meas), 95)), cls("standard"), cls("best_effort"),
                f"{float(np.mean(occ_max)):.3f}", f"{_p(list(occ_max), 99):.3f}",
                f"{rejected} / {arrivals}", res.long_refused, _told_cell(res.long_told_s),
                f"{res.wall_s:.0f}",
            ])
        )  # fmt: skip
    for name, res in results.items():
        rows += ["", f"**{name}** — heavy tenants:", ""]
        rows += _heavy_tenant_table(res, res.cfg.warmup_s, res.cfg.duration_s)
    rows += _reserved_section(results, sizing_probes)
    rows += _pooled_reserved_section(results)
    rows += _pooled_bands_section(results)
    if any(r.cfg.isolation for r in results.values()):
        rows += _contention_section(results)
        rows += _placement_refusal_section(results)
        rows += _landing_section(results)
    path = out_dir / report_name
    path.write_text("\n".join(rows) + "\n")
    return path


LANDED_POOL = "reserved pool"
LANDED_HOSTING = "designated, hosting long"
LANDED_IDLE = "designated, hosting none"
LANDED_OTHER = "other shared"
LANDINGS = (LANDED_POOL, LANDED_OTHER, LANDED_IDLE, LANDED_HOSTING)


def landed(idx: int, pool: bool, designated: frozenset[int], hosting: frozenset[int]) -> str:
    """Which placement band replica ``idx`` was in for short traffic (``SimRequest.landed``):
    the reserved pool, a shared replica not designated for long contexts, a designated one
    hosting none, or one hosting some (short traffic's last band, ``placement.score``)."""
    if pool:
        return LANDED_POOL
    if idx in hosting:
        return LANDED_HOSTING
    return LANDED_IDLE if idx in designated else LANDED_OTHER


@dataclass(frozen=True, slots=True)
class LandingRow:
    """``short_landing``'s figures for one band."""

    band: str
    n: int
    share: float  # of the measured short requests that reached a replica
    ttft_p95: float  # s, from this attempt's dispatch (``SimResult.ttfts``)
    ttft_p99: float


def short_landing(res: SimResult) -> list[LandingRow]:
    """Where the others' measured requests that are not long contexts were dispatched (the
    last attempt; ``SimRequest.landed``), per band, with their TTFT there: how much of the
    short traffic the replicas hosting long contexts pushed elsewhere."""
    meas = [r for r in res.measured() if not r.heavy and r.landed and r.first_token is not None]
    out = []
    for band in LANDINGS:
        sub = [r for r in meas if r.landed == band]
        t = res.ttfts(sub)
        out.append(
            LandingRow(band, len(sub), len(sub) / len(meas) if meas else 0.0,
                       _p(t, 95) if t else float("nan"), _p(t, 99) if t else float("nan"))
        )  # fmt: skip
    return out


def _landing_section(results: dict[str, SimResult]) -> list[str]:
    """``short_landing`` for every run with context placement, and how many designated
    replicas hosted long contexts."""
    runs = {k: v for k, v in results.items() if v.series.hosting}
    if not runs:
        return []
    rows = [
        "",
        "## Where short requests landed",
        "",
        "The others' measured requests that are not long contexts, by the placement band of "
        "the replica their last attempt went to (`bench.fleet_sim.short_landing`; the "
        "designated replicas and which of them host long contexts as gateway 0 saw them at "
        "the last 1-s sample): share and TTFT p95 / p99 (from dispatch); and, over the "
        "measured window, the mean number of designated replicas hosting long contexts and "
        "the mean scraped occupancy of the shared replicas hosting none (short traffic's "
        "first band).",
        "",
        "| run | designated hosting (mean) | occupancy of the rest | "
        + " | ".join(f"{b}: share, TTFT p95 / p99 ms" for b in LANDINGS)
        + " |",
        "|---|---|---|" + "---|" * len(LANDINGS),
    ]
    for name, res in runs.items():
        win = _series_window(res, res.cfg.warmup_s)
        hosting = np.asarray(res.series.hosting, dtype=float)[win]
        occ = np.asarray(res.series.short_band_occ, dtype=float)[win]
        cells = [
            f"{_pct(x.share)} ({x.n}), {_ms(x.ttft_p95)} / {_ms(x.ttft_p99)}" if x.n else "–"
            for x in short_landing(res)
        ]
        rows.append(
            _md_row([name, f"{float(np.nanmean(hosting)):.1f}", f"{float(np.nanmean(occ)):.3f}",
                     *cells])
        )  # fmt: skip
    return rows


@dataclass(frozen=True, slots=True)
class ContentionRow:
    """``long_prefill_contention``'s figures for one tier and one count of long prefills
    already in flight on the replica at dispatch."""

    very_long: bool
    beside: int  # other long prefills in flight there at dispatch (the last row: this or more)
    n: int
    ratio_p50: float  # first token / expected first token (its lease's record)
    ratio_p90: float
    after_expiry: int  # first token after its prefill slot's safety expiry


def long_prefill_contention(requests: list[SimRequest], max_beside: int = 3) -> list[ContentionRow]:
    """Long contexts sent to a replica whose prefill produced a first token (every attempt
    kept is the last one of its request; the whole run): per tier and per count of other
    long prefills in flight on the replica when it was dispatched (``SimRequest.long_beside``,
    ``max_beside`` and more in one row), how long its first token took against the time its
    lease expects (``long_expected_s``), and how many came after the slot's safety expiry
    (``long_hold_s``): a prefill the budget no longer counts while the replica runs it.
    A row per tier with ``beside`` -1 covers all counts."""
    out: list[ContentionRow] = []
    for very in (True, False):
        done = [
            r
            for r in requests
            if r.long_beside >= 0 and r.long_very == very and r.first_token is not None
        ]
        groups: list[tuple[int, list[SimRequest]]] = [(-1, done)]
        groups += [
            (b, [r for r in done if min(r.long_beside, max_beside) == b])
            for b in range(max_beside + 1)
        ]
        for b, rs in groups:
            if not rs:
                continue
            waits = [(r.first_token or 0.0) - r.sent for r in rs]
            ratios = [w / r.long_expected_s for w, r in zip(waits, rs, strict=True)]
            late = sum(1 for w, r in zip(waits, rs, strict=True) if w > r.long_hold_s)
            out.append(ContentionRow(very, b, len(rs), _p(ratios, 50), _p(ratios, 90), late))
    return out


def _contention_section(results: dict[str, SimResult]) -> list[str]:
    """``long_prefill_contention`` for every run that placed long contexts."""
    rows = [
        "",
        "## Long prefills sharing a replica",
        "",
        "Every long context sent to a replica whose first token came (whole run): the other "
        "long prefills in flight on its replica when it was dispatched (dispatched, no first "
        "token yet), its first token over the one its lease expects, and how many came after "
        "the prefill slot's safety expiry, when the budget no longer counts the prefill the "
        "replica still runs (`bench.fleet_sim.long_prefill_contention`).",
        "",
        "| run | tier | long prefills beside it at dispatch | n | first token / expected p50 / "
        "p90 | after the safety expiry |",
        "|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        for c in long_prefill_contention(res.requests):
            beside = "all" if c.beside < 0 else f"{c.beside}+" if c.beside == 3 else c.beside
            rows.append(
                _md_row([
                    name, "very long" if c.very_long else "shorter", beside, c.n,
                    f"{c.ratio_p50:.1f} / {c.ratio_p90:.1f}", c.after_expiry,
                ])
            )  # fmt: skip
    return rows


def _placement_refusal_section(results: dict[str, SimResult]) -> list[str]:
    """``placement_refusal`` for every run: the long contexts the budget admitted that
    placement refused, by the check that refused them."""
    rows = [
        "",
        "## Admitted long contexts placement refused",
        "",
        "Long contexts the budget admitted (whole run) for which placement found no designated "
        "replica under the ceiling (`bench.fleet_sim.placement_refusal`): refused by the "
        "long-context floor (some designated replica passed the ceiling check without its "
        "floor, `ReplicaView.long_floor`), by the scrape and in-flight KV alone, or before the "
        "first scrape; and, at the refusals, the medians of the designated replicas that "
        "passed it without the floor, of the floors' sum and of the loads' sum without them "
        "(replicas' worth of occupancy), of the fleet's long-context KV in flight "
        "(replicas filled to the standard ceiling), of the refused request's KV with its "
        "output growth, of the largest room a designated replica had left under the class "
        "ceiling with its floor, and of the sum of those rooms (occupancy).",
        "",
        "| run | refused | by the floor | by scrape + in-flight | before a scrape | "
        "median: fit without the floor / designated | floors' sum | loads' sum | "
        "fleet's long KV | the request's KV | largest room | rooms' sum |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        refs = res.placement_refusals
        by: dict[str, int] = {}
        for x in refs:
            by[x.cause] = by.get(x.cause, 0) + 1
        scraped = [x for x in refs if x.designated]

        def med(field: str, xs: list[PlacementRefusal] = scraped) -> str:
            return f"{float(np.median([getattr(x, field) for x in xs])):.1f}" if xs else "–"

        def med2(field: str, xs: list[PlacementRefusal] = scraped) -> str:
            return f"{float(np.median([getattr(x, field) for x in xs])):.2f}" if xs else "–"

        rows.append(
            _md_row([
                name, len(refs), by.get(FLOOR_REFUSAL, 0), by.get(CEILING_REFUSAL, 0),
                by.get(UNSCRAPED_REFUSAL, 0),
                f"{med('fit_without_floor')} / {med('designated')}", med("floor_sum"),
                med("load_sum"), med("fleet_replicas"), med2("need"), med2("largest_room"),
                med("room_sum"),
            ])
        )  # fmt: skip
    return rows


def _told_cell(told_s: list[float]) -> str:
    """The retry-after (s) the long-context 503s asked for: p50 / p95 / max."""
    if not told_s:
        return "—"
    return f"{_p(told_s, 50):.1f} / {_p(told_s, 95):.1f} / {max(told_s):.1f}"


def _causes_cell(c: ClassSLO) -> str:
    return "; ".join(f"{name}: {n}" for name, n in c.causes) or "—"


def _slo_cells(c: ClassSLO) -> list[object]:
    """attainment (n), its exact one-sided 95 % lower bound, missed, of which TTFT / TPOT,
    by cause."""
    return [
        f"{_pct(c.attainment, 2)} ({c.n})", _pct(clopper_pearson_lower(c.met, c.n), 2),
        c.missed, f"{c.ttft_missed} / {c.tpot_missed}", _causes_cell(c),
    ]  # fmt: skip


def _reserved_section(
    results: dict[str, SimResult], sizing_probes: dict[str, list[Probe]] | None
) -> list[str]:
    """The reserved class's attainment of both SLOs per request, over all its measured
    requests and over the feasible ones (the promise: 99.9 % of these), with the misses
    split by SLO and cause, for every sizing probe and every heavy-tenant run."""
    any_cfg = next(iter(results.values())).cfg
    rows = [
        "",
        "## Reserved class (enterprise under its floor): both SLOs per request",
        "",
        "The promise (docs/operations.md, Capacity): both SLOs on 99.9 % of the requests whose "
        "prompt could meet the TTFT SLO on this hardware model at all — its lone prefill on "
        f"{PROFILE} under 1 s (`bench.stats.lone_prefill_feasible`: prompts under "
        f"{_feasible_limit():,} tokens). Per request: TTFT < 1 s counted from the first "
        "attempt's arrival (503 waits included; never served = a TTFT miss) and mean TPOT < "
        "50 ms. A request that missed both counts under each SLO and each cause. Causes: "
        "TTFT — the largest of the 503 retry-after waits, the wait in the replica's queue (to "
        "its first scheduled step) and the prefill's excess over its lone prefill time, or a "
        "preemption before the first token; TPOT — a preemption while decoding, else which "
        "kind of replica step of 50 ms or more took more of its decode time: steps carrying "
        "a prefill chunk or decode-only ones. The lower bound: exact (Clopper-Pearson), "
        "one-sided, 95 % (`bench.stats.clopper_pearson_lower`). "
        + (
            f"Each run goes on {any_cfg.drain_s:g} model-s past its end with the same "
            "arrivals so that the measured requests can finish; censored = measured arrivals "
            "still unresolved then (not counted either way)."
            if any_cfg.drain_s
            else "Censored = measured arrivals still streaming at the end of the run (not "
            "counted either way: the cut keeps short outputs and drops long ones)."
        ),
        "",
        "| run | replicas (reserved pool) | replica chunk cap | reserved: attainment (n) | "
        "feasible: attainment (n) | feasible: 95 % lower bound | feasible missed | of which "
        "TTFT / TPOT | feasible misses by cause | censored (all classes) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cap(cfg: FleetConfig) -> str:
        shared = f"{cfg.long_prefill_tokens:,}" if cfg.long_prefill_tokens else "none"
        if cfg.reserved_replicas and cfg.pool_long_prefill_tokens:
            return f"{shared} (pool {cfg.pool_long_prefill_tokens:,})"
        return shared

    for name, probes in (sizing_probes or {}).items():
        for p in sorted(probes, key=lambda x: x.replicas):
            feas = _slo_cells(p.reserved_feasible)
            rows.append(
                _md_row([
                    f"{name} (sizing probe)", p.replicas, cap(any_cfg),
                    f"{_pct(p.reserved.attainment, 2)} ({p.reserved.n})", *feas, p.censored,
                ])
            )  # fmt: skip
    for name, res in results.items():
        cfg = res.cfg
        reps = f"{cfg.replicas}" + (f" ({cfg.reserved_replicas})" if cfg.reserved_replicas else "")
        every = reserved_slo(res, feasible_only=False)
        feas = _slo_cells(reserved_slo(res, feasible_only=True))
        rows.append(
            _md_row([
                name, reps, cap(cfg), f"{_pct(every.attainment, 2)} ({every.n})", *feas,
                res.censored(),
            ])
        )  # fmt: skip
    return rows


SEED_SUFFIX = re.compile(r", seed \d+$")


def _pooled_reserved_section(results: dict[str, SimResult]) -> list[str]:
    """With runs of several seeds (labels ending ", seed N"), each arm's reserved class over
    all its seeds as one sample: nothing when every arm ran once."""
    arms: dict[str, list[SimResult]] = {}
    for name, res in results.items():
        arms.setdefault(SEED_SUFFIX.sub("", name), []).append(res)
    if all(len(runs) == 1 for runs in arms.values()):
        return []
    rows = [
        "",
        "## Reserved class pooled over seeds",
        "",
        "Each arm's runs above (one per seed, each its own arrivals) counted as one sample.",
        "",
        "| arm | seeds | reserved: attainment (n) | feasible: attainment (n) | feasible: 95 % "
        "lower bound | feasible missed | of which TTFT / TPOT | feasible misses by cause | "
        "censored (all classes) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, runs in arms.items():
        every = pool_slo([reserved_slo(r, feasible_only=False) for r in runs])
        feas = pool_slo([reserved_slo(r, feasible_only=True) for r in runs])
        seeds = ", ".join(str(r.cfg.seed) for r in runs)
        rows.append(
            _md_row([
                arm, seeds, f"{_pct(every.attainment, 2)} ({every.n})", *_slo_cells(feas),
                sum(r.censored() for r in runs),
            ])
        )  # fmt: skip
    return rows


# The bands of the lone prefill (seconds) the pooled reserved class is split by, and the
# feasibility margin reported beside the promise's 1 s.
LONE_BANDS = ((0.0, 0.5), (0.5, 0.8), (0.8, TTFT_SLO_S))
FEASIBLE_MARGIN_S = 0.8


def _band_cell(c: ClassSLO) -> str:
    return f"{_pct(c.attainment, 2)} ({c.missed} of {c.n})"


def _pooled_bands_section(results: dict[str, SimResult]) -> list[str]:
    """Each arm's reserved class over all its seeds by its prompts' lone prefill: the
    feasible bands, the promise under a margin (lone prefill < FEASIBLE_MARGIN_S), and the
    prompts that cannot meet the TTFT SLO (their first-token times: what the pool's own
    settings cost them). Also with one seed: counts that several reports sum exactly."""
    arms: dict[str, list[SimResult]] = {}
    for name, res in results.items():
        arms.setdefault(SEED_SUFFIX.sub("", name), []).append(res)
    bands = " | ".join(f"lone {lo:g}-{hi:g} s: attainment (missed of n)" for lo, hi in LONE_BANDS)
    rows = [
        "",
        "## Reserved class by the prompt's lone prefill (each arm over its seeds)",
        "",
        f"The same requests by their prompt's lone prefill on {PROFILE} "
        "(`Profile.prefill_seconds`; the promise counts those under 1 s). The margin column "
        f"is the promise with a feasibility limit of {FEASIBLE_MARGIN_S:g} s instead of 1 s, "
        "with its exact one-sided 95 % lower bound. Not feasible: the class's prompts whose "
        "lone prefill is 1 s or more, TTFT from the first attempt's arrival (never served "
        "= infinite).",
        "",
        f"| arm | {bands} | margin {FEASIBLE_MARGIN_S:g} s: attainment (n) | margin: 95 % "
        "lower bound | not feasible: n | not feasible: TTFT p50 / p95 s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, runs in arms.items():
        cells = [_band_cell(pool_slo([reserved_band_slo(r, lo, hi) for r in runs]))
                 for lo, hi in LONE_BANDS]  # fmt: skip
        margin = pool_slo([reserved_band_slo(r, 0.0, FEASIBLE_MARGIN_S) for r in runs])
        long_ttft = [
            (r.first_token - r.arrival) if r.first_token is not None else math.inf
            for res in runs
            for r in res.measured()
            if r.tenant_class == "reserved" and not r.heavy and not lone_prefill_feasible(r.prompt)
        ]
        ttft = f"{_p(long_ttft, 50):.1f} / {_p(long_ttft, 95):.1f}" if long_ttft else "—"
        rows.append(
            _md_row([
                arm, *cells, f"{_pct(margin.attainment, 2)} ({margin.n})",
                _pct(clopper_pearson_lower(margin.met, margin.n), 2), len(long_ttft), ttft,
            ])
        )  # fmt: skip
    return rows


def _feasible_limit(profile: Profile = LLAMA_70B_TP4_H100) -> int:
    """The shortest prompt that is not feasible (``lone_prefill_feasible``)."""
    lo, hi = 1, profile.max_model_len
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if lone_prefill_feasible(mid, profile):
            lo = mid
        else:
            hi = mid
    return hi


def _run_named(item: tuple[str, FleetConfig]) -> tuple[str, SimResult]:
    name, cfg = item
    return name, FleetSim(cfg, get_profile(PROFILE)).run()


def run_all(configs: dict[str, FleetConfig], workers: int = 2) -> dict[str, SimResult]:
    """Run the simulations, ``workers`` at a time, with one progress bar over them."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from tqdm import tqdm

    out: dict[str, SimResult] = {}
    bar = tqdm(total=len(configs), desc="fleet_sim runs", unit="run", file=sys.stderr)
    if workers <= 1:
        for item in configs.items():
            name, res = _run_named(item)
            out[name] = res
            bar.update(1)
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(_run_named, item) for item in configs.items()]
            for fut in as_completed(futures):
                name, res = fut.result()
                out[name] = res
                bar.update(1)
    bar.close()
    return {name: out[name] for name in configs}


# -- report -----------------------------------------------------------------------------


def _md_row(cells: list[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _after(res: SimResult, t: float) -> list[SimRequest]:
    """Resolved requests that were in the system after ``t`` (ended after it)."""
    return [r for r in res.requests if r.final and r.ended > t]


def _series_window(res: SimResult, lo: float) -> np.ndarray:
    t = np.asarray(res.series.t)
    return (t >= lo) & (t <= res.cfg.duration_s)


def sizing(profile: Profile, scale: Scale, seed: int = 1) -> tuple[float, list[CliffPoint]]:
    """Highest per-replica rate whose TTFT p95 < 1 s and TPOT p95 < 50 ms (bisection)."""
    lo, hi = 0.5, 12.0
    probes: list[CliffPoint] = []
    for _ in range(7):
        mid = (lo + hi) / 2
        pt = run_engine(profile, mid, scale.cliff_duration_s, scale.cliff_warmup_s, seed)
        probes.append(pt)
        if pt.tpot_p95 < TPOT_SLO_S and pt.ttft_p95 < TTFT_SLO_S:
            lo = mid
        else:
            hi = mid
    return lo, probes


def cliff_sweep(profile: Profile, scale: Scale, seed: int = 1) -> list[CliffPoint]:
    rates = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 6.5, 7.0, 7.5, 8.0, 9.0, 11.0)
    return [
        run_engine(profile, r, scale.cliff_duration_s, scale.cliff_warmup_s, seed) for r in rates
    ]


# The routing herd's arms and the replica-failure arms, as ``experiments`` names them.
HERD_ARMS = ("p2c+inflight", "emptiest (stale)", "round robin")
STORM_ARMS = ("kill, no retry rules", "kill, retry rules", "kill at 90 % load, retry rules")


def write_report(
    results: dict[str, SimResult],
    cliff: list[CliffPoint],
    per_replica_rate: float,
    scale: Scale,
    command: str,
    out_dir: Path = RESULTS,
) -> Path:
    """fleet_sim.md (one function per section), its three plots and the headline lines."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = [
        *_intro_section(scale, command),
        *_arithmetic_section(results, per_replica_rate, scale),
        *_cliff_section(cliff),
        *_herd_section(results, scale),
        *_storm_section(results, scale),
        "Plots: [cliff](fleet_sim_cliff.png) · [herd](fleet_sim_herd.png) · "
        "[storm](fleet_sim_storm.png)\n",
    ]
    caption = f"{command} — model time"
    _plot_cliff(cliff, out_dir, caption)
    _plot_herd(results, out_dir, caption)
    _plot_storm(results, out_dir, caption)
    path = out_dir / "fleet_sim.md"
    path.write_text("\n".join(md) + "\n")
    (out_dir / "fleet_sim_headline.md").write_text(
        "\n".join(highlights(results, per_replica_rate, scale, command)) + "\n"
    )
    return path


def _intro_section(scale: Scale, command: str) -> list[str]:
    """The title, the command and what was simulated."""
    out: list[str] = []
    w = out.append
    w("# Scenario 4 — fleet-scale simulation\n")
    w(f"Command: `{command}`  ")
    w(
        f"{scale.replicas} emulator `Engine`s ({PROFILE}) stepped in virtual time, "
        f"{scale.rate_rps:g} req/s Poisson, the token shape of docs/design.md §2 (prompt p50 "
        "800 / p95 6,000, output p50 300 / p95 1,200), classes 10 % reserved / 80 % standard "
        f"/ 10 % free, {scale.gateways} gateways each with its own optimistic in-flight view, "
        "occupancy scraped every 250 ms. Routing and admission are the `gateway.admission` policy "
        f"modules themselves. {scale.duration_s:g} model-s per run, statistics after "
        f"{scale.warmup_s:g} s of "
        "fill-up. All times are model time.\n"
    )
    return out


def _arithmetic_section(
    results: dict[str, SimResult], per_replica_rate: float, scale: Scale
) -> list[str]:
    """Fleet arithmetic (docs/design.md §2) against both token shapes, and the sizing."""
    out: list[str] = []
    w = out.append
    # Fleet arithmetic.
    lit, heavy = results["design-literal"], results["p2c+inflight"]
    meas_s = scale.duration_s - scale.warmup_s
    w("## Fleet arithmetic (docs/design.md §2)\n")
    w(
        "| | docs/design.md §2 | simulated: every request 800 in / 300 out | simulated: heavy-tailed shape |"  # noqa: E501
    )
    w("|---|---|---|---|")
    mean_out = float(np.mean([r.output for r in heavy.requests]))
    w(f"| output tokens per request | 300 (the p50) | 300 | mean {mean_out:.0f} |")
    w(
        f"| decode demand at {scale.rate_rps:g} req/s | {scale.rate_rps * 300:,.0f} tok/s | "
        f"{scale.rate_rps * 300:,.0f} tok/s | {scale.rate_rps * mean_out:,.0f} tok/s |"
    )
    w(
        "| out tok/s per replica | ≈2,259 (40 % of 5,647) | "
        f"{lit.tokens_out.mean() / meas_s:,.0f} | {heavy.tokens_out.mean() / meas_s:,.0f} |"
    )
    for label, fn in (
        (
            "mean KV occupancy",
            lambda r: _pct(
                float(np.mean(np.asarray(r.series.occ_mean)[_series_window(r, scale.warmup_s)]))
            ),
        ),
        ("TTFT p95 (ms)", lambda r: _ms(_p(r.ttfts(), 95))),
        (
            "TPOT p50 / p95 (ms)",
            lambda r: f"{_ms(_p(r.tpots(), 50))} / {_ms(_p(r.tpots(), 95))}",
        ),
        ("SLO attainment (TTFT < 1 s and TPOT < 50 ms)", lambda r: _pct(r.attainment())),
        (
            "requests refused 503 (free tier above 0.60 first)",
            lambda r: _pct(
                sum(1 for q in r.measured() if q.status == "rejected") / max(1, len(r.measured()))
            ),
        ),
        ("preemptions", lambda r: f"{r.preemptions}"),
    ):
        design = {
            "mean KV occupancy": "—",
            "TTFT p95 (ms)": "< 1,000",
            "TPOT p50 / p95 (ms)": "≈31 / < 50",
        }.get(label, "—")
        w(f"| {label} | {design} | {fn(lit)} | {fn(heavy)} |")
    need = math.ceil(scale.rate_rps / per_replica_rate) if per_replica_rate > 0 else 0
    w(
        f"\nSizing from the same Engine: one replica holds TTFT p95 < 1 s and TPOT p95 < 50 ms "
        f"up to **{per_replica_rate:.2f} req/s** of the heavy-tailed shape (bisection on a "
        f"single Engine, {scale.cliff_duration_s:g} model-s per probe), so {scale.rate_rps:g} "
        f"req/s needs **{need} replicas** ({need * 4} GPUs) — "
        f"{need / 44:.1f}× the design's 44, before the 15 % failure headroom (docs/design.md R6).\n"
    )
    mean_prompt = float(np.mean([r.prompt for r in heavy.requests]))
    w(
        f"Reading: with every request at the median, {scale.replicas} replicas carry "
        f"{scale.rate_rps:g} req/s at {lit.tokens_out.mean() / meas_s:,.0f} out tok/s each with "
        f"TPOT p95 {_ms(_p(lit.tpots(), 95))} ms — the design's arithmetic, reproduced. With the "
        f"heavy tail the mean output is {mean_out:.0f} tokens, not 300, and the mean prompt "
        f"{mean_prompt:,.0f}, not 800 (prefill demand {scale.rate_rps * mean_prompt:,.0f} tok/s): "
        f"the same fleet runs at TPOT p95 {_ms(_p(heavy.tpots(), 95))} ms. This is the "
        "design's own warning that a mean-based (here: median-based) capacity model is "
        "wrong, quantified.\n"
    )
    return out


def _cliff_section(cliff: list[CliffPoint]) -> list[str]:
    """The occupancy cliff (docs/design.md §7): one replica against offered load."""
    out: list[str] = []
    w = out.append
    # The occupancy cliff.
    w("## The occupancy cliff: one replica, no admission control (docs/design.md §7)\n")
    w(
        "| offered req/s | mean KV occupancy | TPOT p50 (ms) | TPOT p95 (ms) | TTFT p95 (ms) | preemptions/min | out tok/s |"  # noqa: E501
    )
    w("|---|---|---|---|---|---|---|")
    for c in cliff:
        w(
            f"| {c.rate_rps:g} | {_pct(c.occupancy)} | {_ms(c.tpot_p50)} | {_ms(c.tpot_p95)} | "
            f"{_ms(c.ttft_p95)} | {c.preemptions_per_min:.1f} | {c.out_tokens_per_s:,.0f} |"
        )
    w("")
    return out


def _herd_section(results: dict[str, SimResult], scale: Scale) -> list[str]:
    """The routing herd (docs/design.md C5, R5): the arms on 250 ms stale occupancy."""
    out: list[str] = []
    w = out.append
    # The routing herd.
    w("## Routing herd on 250 ms stale occupancy (docs/design.md C5, R5)\n")
    w(
        "| routing | mean occupancy | mean of per-second max | max − mean p95 | TTFT p99 (ms) | TPOT p95 (ms) | 503 share | preemptions |"  # noqa: E501
    )
    w("|---|---|---|---|---|---|---|---|")
    for name in HERD_ARMS:
        r = results[name]
        m = _series_window(r, scale.warmup_s)
        mx = np.asarray(r.series.occ_max)[m]
        mean = np.asarray(r.series.occ_mean)[m]
        meas = r.measured()
        rej = sum(1 for q in meas if q.status == "rejected") / max(1, len(meas))
        w(
            f"| {name} | {_pct(float(mean.mean()))} | {_pct(float(mx.mean()))} | "
            f"{_pct(_p(mx - mean, 95))} | {_ms(_p(r.ttfts(), 99))} | "
            f"{_ms(_p(r.tpots(), 95))} | {_pct(rej)} | {r.preemptions} |"
        )
    w("")
    return out


def _storm_section(results: dict[str, SimResult], scale: Scale) -> list[str]:
    """One replica dies (docs/design.md C6, R6): the arms' retries, 503s and recovery."""
    out: list[str] = []
    w = out.append
    # The retry storm.
    k = scale.kill_at_s
    w(f"## One replica dies at t = {k:g} s (docs/design.md C6, R6)\n")
    w(
        "Its streams end in an error and their clients retry at once. Without the retry rules "
        "every 503 says `Retry-After: 5` and every client honours it exactly; with them the "
        "503 says 5 s + uniform[0, 5 s] and the retry budget sheds non-reserved retries with "
        "30–60 s once retries pass 20 % of admitted traffic. Clients give up after 4 attempts. The "
        f"third arm repeats the failure at {0.9 * scale.rate_rps:.0f} req/s without the free "
        "tier, below the 0.85 ceiling (keep headroom for a failure).\n"
    )
    win = min(20.0, k - scale.warmup_s)
    w(
        f"Rates are per second over the {win:g} s before the kill and the {win:g} s after it "
        "(same run, same seeds); the first row is the same fleet and seeds with no failure "
        "(the herd section's P2C run), i.e. what those windows hold anyway.\n"
    )
    w(
        _md_row([
            "arm", "streams lost", "offered req/s before → after", "retries/s before → after",
            "503/s before → after", "peak 503/s", "503s to first attempts after",
            "gave up after", "completed after", "TTFT p99 after (ms)", "max occupancy after",
        ])
    )  # fmt: skip
    w("|---" * 11 + "|")
    # The same seeds without the failure: what the fleet does in those windows anyway.
    for name in ("p2c+inflight", *STORM_ARMS):
        r = results[name]
        t = np.asarray(r.series.t)
        before, after = (t > k - win) & (t <= k), (t > k) & (t <= k + win)

        def rate(series: list[int], mask: np.ndarray) -> str:
            return f"{np.asarray(series)[mask].mean():.0f}" if mask.any() else "—"

        rejected = np.asarray(r.series.rejected)
        errors = int(np.asarray(r.series.errors)[(t > k) & (t <= k + 1.0)].sum())
        reqs = [q for q in _after(r, k) if q.ended <= k + win]
        done = sum(1 for q in reqs if q.status == "ok") / max(1, len(reqs))
        gave_up = sum(1 for q in reqs if q.status != "ok")
        ttft = [q.first_token - q.sent for q in reqs if q.first_token is not None]
        peak_occ = float(np.nanmax(np.asarray(r.series.occ_max)[after], initial=0))
        label = "no failure (reference, retry rules)" if name == "p2c+inflight" else name
        w(
            _md_row([
                label, errors,
                f"{rate(r.series.arrivals, before)} → {rate(r.series.arrivals, after)}",
                f"{rate(r.series.retries, before)} → {rate(r.series.retries, after)}",
                f"{rate(r.series.rejected, before)} → {rate(r.series.rejected, after)}",
                int(rejected[after].max(initial=0)),
                int(np.asarray(r.series.rejected_first)[after].sum()), gave_up, _pct(done),
                _ms(_p(ttft, 99)), _pct(peak_occ),
            ])
        )  # fmt: skip
    w("")
    return out


def _plot_cliff(cliff: list[CliffPoint], out_dir: Path, caption: str) -> None:
    """fleet_sim_cliff.png: the occupancy cliff against mean occupancy."""
    from bench.plots import Series as Line
    from bench.plots import lines

    lines(
        [
            (
                "TPOT (ms)",
                [
                    Line(
                        "p95",
                        [c.occupancy * 100 for c in cliff],
                        [c.tpot_p95 * 1000 for c in cliff],
                        {"marker": "o"},
                    ),
                    Line(
                        "p50",
                        [c.occupancy * 100 for c in cliff],
                        [c.tpot_p50 * 1000 for c in cliff],
                        {"marker": "."},
                    ),
                ],
            ),
            (
                "preemptions / min",
                [
                    Line(
                        "preemptions",
                        [c.occupancy * 100 for c in cliff],
                        [c.preemptions_per_min for c in cliff],
                        {"marker": "o", "color": "tab:red"},
                    ),
                ],
            ),
            (
                "TTFT p95 (s)",
                [
                    Line(
                        "TTFT p95",
                        [c.occupancy * 100 for c in cliff],
                        [c.ttft_p95 for c in cliff],
                        {"marker": "o", "color": "tab:purple"},
                    ),
                ],
            ),
        ],
        out_dir / "fleet_sim_cliff.png",
        caption,
        xlabel="mean KV occupancy (%)",
        logy=[False, False, True],
        hlines=[[TPOT_SLO_S * 1000], [], [TTFT_SLO_S]],
    )


def _plot_herd(results: dict[str, SimResult], out_dir: Path, caption: str) -> None:
    """fleet_sim_herd.png: fullest replica and fleet mean per herd arm."""
    from bench.plots import Series as Line
    from bench.plots import lines

    herd_panels = []
    for name in HERD_ARMS:
        r = results[name]
        herd_panels.append(
            (
                f"{name}\noccupancy %",
                [
                    Line(
                        "max replica",
                        r.series.t,
                        np.asarray(r.series.occ_max) * 100,
                        {"color": "tab:red"},
                    ),
                    Line(
                        "fleet mean",
                        r.series.t,
                        np.asarray(r.series.occ_mean) * 100,
                        {"color": "tab:blue"},
                    ),
                ],
            )
        )
    lines(
        herd_panels,
        out_dir / "fleet_sim_herd.png",
        caption,
        xlabel="model s",
        hlines=[[85]] * len(HERD_ARMS),
    )


def _plot_storm(results: dict[str, SimResult], out_dir: Path, caption: str) -> None:
    """fleet_sim_storm.png: offered load, retries and 503s per failure arm."""
    from bench.plots import Series as Line
    from bench.plots import lines

    storm_panels = []
    for name in STORM_ARMS:
        r = results[name]
        storm_panels.append(
            (
                f"{name}\nper second",
                [
                    Line("offered", r.series.t, r.series.arrivals, {"color": "gray"}),
                    Line("retries", r.series.t, r.series.retries, {"color": "tab:red"}),
                    Line("503", r.series.t, r.series.rejected, {"color": "tab:orange"}),
                ],
            )
        )
    lines(storm_panels, out_dir / "fleet_sim_storm.png", caption, xlabel="model s")


def highlights(
    results: dict[str, SimResult], per_replica_rate: float, scale: Scale, command: str
) -> list[str]:
    """A few measured sentences for the results index."""
    lit, heavy = results["design-literal"], results["p2c+inflight"]
    meas_s = scale.duration_s - scale.warmup_s
    need = math.ceil(scale.rate_rps / per_replica_rate) if per_replica_rate > 0 else 0

    def herd(name: str) -> tuple[float, float]:
        r = results[name]
        m = _series_window(r, scale.warmup_s)
        return float(np.mean(np.asarray(r.series.occ_max)[m])), _p(r.ttfts(), 99)

    k = scale.kill_at_s
    win = min(20.0, k - scale.warmup_s)

    def after_rate(name: str, series: str) -> float:
        r = results[name]
        t = np.asarray(r.series.t)
        m = (t > k) & (t <= k + win)
        return float(np.asarray(getattr(r.series, series))[m].mean()) if m.any() else math.nan

    def excess(name: str, series: str) -> float:
        return after_rate(name, series) - after_rate("p2c+inflight", series)

    p2c_max, p2c_ttft = herd("p2c+inflight")
    emp_max, emp_ttft = herd("emptiest (stale)")
    return [
        f"Measured by `{command}` ({scale.replicas} emulator Engines, {scale.rate_rps:g} req/s, "
        "virtual time; routing and admission are the gateway's own code).\n",
        "- Fleet arithmetic: with every request at the median, "
        f"{lit.tokens_out.mean() / meas_s:,.0f} out tok/s per replica at TPOT p95 "
        f"{_ms(_p(lit.tpots(), 95))} ms (design: ≈2,259); with "
        f"the heavy-tailed shape the same fleet runs at TPOT p95 {_ms(_p(heavy.tpots(), 95))} "
        f"ms; one replica holds the SLO up to {per_replica_rate:.2f} req/s, so "
        f"{scale.rate_rps:g} req/s needs {need} replicas (design: 44).",
        f"- Routing herd: the fullest replica averages {_pct(emp_max)} under pick-emptiest on "
        f"250 ms stale data vs {_pct(p2c_max)} under P2C + optimistic in-flight; TTFT p99 "
        f"{_ms(emp_ttft)} vs {_ms(p2c_ttft)} ms; preemptions "
        f"{results['emptiest (stale)'].preemptions} vs {heavy.preemptions}.",
        f"- Replica failure: one replica dies at t = {k:g} s; over the next {win:g} s the "
        f"failure adds {excess('kill, no retry rules', 'rejected'):.0f} 503/s and "
        f"{excess('kill, no retry rules', 'retries'):.0f} retries/s without the retry rules, "
        f"{excess('kill, retry rules', 'rejected'):.0f} 503/s and "
        f"{excess('kill, retry rules', 'retries'):.0f} retries/s with them (each against the "
        f"same seeds without the failure); at {0.9 * scale.rate_rps:.0f} req/s without the free "
        "tier the same failure leaves "
        f"{after_rate('kill at 90 % load, retry rules', 'rejected'):.0f} 503/s.",
    ]


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.fleet_sim", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--isolation",
        action="store_true",
        help="only the long-context isolation comparison (fleet_sim_isolation.md)",
    )
    ap.add_argument("--replicas", type=int, default=None, help="fleet size (isolation runs)")
    ap.add_argument("--heavy-tenants", type=int, default=4)
    ap.add_argument(
        "--heavy-rps",
        default="0.4",
        help="comma-separated 128k req/s per heavy tenant, cycled (isolation runs)",
    )
    ap.add_argument("--duration", type=float, default=None, help="model seconds per run")
    ap.add_argument(
        "--heavy-duration",
        type=float,
        default=None,
        help="model seconds of the heavy-tenant runs (default: --duration)",
    )
    ap.add_argument(
        "--drain",
        type=float,
        default=0.0,
        help="model seconds each isolation run goes on after its end, arrivals and all, so "
        "that the measured requests can finish (FleetConfig.drain_s)",
    )
    ap.add_argument(
        "--chunk-cap",
        type=int,
        default=0,
        help="isolation runs: also run the new policy on replicas with this "
        "--long-prefill-token-threshold (the platform's: 5242)",
    )
    ap.add_argument(
        "--replica-cap",
        type=int,
        default=0,
        help="isolation runs: every run, both policies and the sizing probes, on replicas "
        "with this --long-prefill-token-threshold (the platform's: 5242); --chunk-cap only "
        "adds a capped arm of the new policy",
    )
    ap.add_argument(
        "--reserved-pools",
        default="",
        help="isolation runs: comma-separated reserved-pool sizes, each also run with the new "
        "policy (out of the same replicas)",
    )
    ap.add_argument(
        "--reserved-rule-off",
        action="store_true",
        help="isolation runs: also run the new policy without reserved_off_long_replicas "
        "(the placement before it)",
    )
    ap.add_argument(
        "--reserved-long-rule-on",
        action="store_true",
        help="isolation runs: also run each reserved pool with reserved_long_off_pool "
        "(reserved long contexts on the designated shared replicas first, the pool last)",
    )
    ap.add_argument(
        "--lc-before",
        action="store_true",
        help="isolation runs: also run the new policy with the simulated long-context ledger "
        "as before it told the gateway's waits (503s told the fleet-full retry-after, no "
        "due-backs, waiting entries for the demand window)",
    )
    ap.add_argument(
        "--lane-off",
        action="store_true",
        help="isolation runs: also run the new policy without the long-context budget's lane "
        "(short_long_prefill_slots_per_replica 0: every long prefill in the one slot per "
        "designated replica, the one-tier rule)",
    )
    ap.add_argument(
        "--place-own",
        action="store_true",
        help="isolation runs: also run the new policy placing long contexts on designated "
        "replicas with a prefill slot of their tier free (long_prefill_placement), each "
        "gateway knowing its own long prefills in flight",
    )
    ap.add_argument(
        "--place-shared",
        action="store_true",
        help="isolation runs: also run --place-own's policy with every gateway seeing all "
        "gateways' long prefills in flight per replica (Router.note_long_prefills from the "
        "simulated ledger) and charging each designated replica the long-context KV leased "
        "there (Router.note_placed_long), not only its own",
    )
    ap.add_argument(
        "--place-fit",
        action="store_true",
        help="isolation runs: also run --place-shared's policy with the long-context budget "
        "admitting only what some designated replica can hold whole (long_context_fit)",
    )
    ap.add_argument(
        "--fit-packed",
        action="store_true",
        help="isolation runs: also run the new policy (packing by KV) with the long-context "
        "budget admitting only what some designated replica can hold whole "
        "(long_context_fit)",
    )
    ap.add_argument(
        "--skip-arm",
        action="append",
        default=[],
        metavar="TEXT",
        help="isolation runs: leave out the heavy-tenant arms whose label contains TEXT "
        "(repeatable), to fit a run in the time at hand",
    )
    ap.add_argument(
        "--seeds",
        default="",
        help="isolation runs: comma-separated seeds, every heavy-tenant arm once per seed "
        "(labels end ', seed N'), the reserved class also pooled over them (not with "
        "--size-range)",
    )
    ap.add_argument(
        "--report",
        default="fleet_sim_isolation.md",
        help="file name of the isolation report under --out",
    )
    ap.add_argument(
        "--pool-caps",
        default="",
        help="isolation runs: comma-separated --long-prefill-token-threshold values for the "
        "reserved pool's replicas only, each run with every --reserved-pools size (the "
        "shared replicas keep --replica-cap)",
    )
    ap.add_argument(
        "--size-range",
        default="",
        help="LO,HI[,STEP]: also bisect the replicas each policy needs for both SLOs "
        "(isolation runs; LO assumed to miss, HI checked first)",
    )
    args = ap.parse_args(argv)
    scale = Scale.quick() if args.quick else Scale()
    if args.isolation:
        if args.replicas:
            scale = replace(scale, replicas=args.replicas)
        if args.duration:
            scale = replace(scale, duration_s=args.duration, warmup_s=args.duration * 0.4)
        try:
            heavy_rates = tuple(float(x) for x in args.heavy_rps.split(",") if x.strip())
            bounds = [int(x) for x in args.size_range.split(",") if x.strip()]
            pools = tuple(int(x) for x in args.reserved_pools.split(",") if x.strip())
            seeds = tuple(int(x) for x in args.seeds.split(",") if x.strip())
            pool_caps = tuple(int(x) for x in args.pool_caps.split(",") if x.strip())
        except ValueError:
            ap.error(
                "--heavy-rps takes numbers, --size-range integers LO,HI[,STEP], "
                "--reserved-pools, --seeds and --pool-caps integers"
            )
        if pool_caps and (not pools or min(pool_caps) < 1):
            ap.error("--pool-caps takes positive integers and needs --reserved-pools")
        if seeds and bounds:
            ap.error("--seeds runs the heavy-tenant arms only: leave out --size-range")
        scale = replace(scale, drain_s=args.drain, long_prefill_tokens=args.replica_cap)
        if args.replica_cap and args.chunk_cap:
            ap.error("--chunk-cap adds a capped arm; with --replica-cap every arm is capped")
        if args.size_range and not (len(bounds) in (2, 3) and 0 < bounds[0] < bounds[1]):
            ap.error("--size-range takes LO,HI[,STEP] with 0 < LO < HI")
        command = "python -m bench.fleet_sim " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        load = "1-minute load average at the start " + _loadavg()
        exps = {}
        for seed in seeds or (args.seed,):
            arms = isolation_experiments(
                scale, seed, args.heavy_tenants, heavy_rates, args.heavy_duration,
                chunk_cap=args.chunk_cap, reserved_pools=pools,
                reserved_rule_off=args.reserved_rule_off,
                reserved_long_rule_on=args.reserved_long_rule_on, pool_caps=pool_caps,
                lc_before=args.lc_before, lane_off=args.lane_off,
                place_own=args.place_own, place_shared=args.place_shared,
                place_fit=args.place_fit, fit_packed=args.fit_packed,
            )  # fmt: skip
            exps.update({k + (f", seed {seed}" if seeds else ""): v for k, v in arms.items()})
        exps = {k: v for k, v in exps.items() if not any(t in k for t in args.skip_arm)}
        if not exps:
            # checked before the sizing probes, which take minutes
            ap.error("--skip-arm left no arm to run")
        probes = None
        if bounds:
            step = bounds[2] if len(bounds) == 3 else 1
            probes = fleet_sizing(scale, args.seed, bounds[0], bounds[1], step, args.workers)
        res = run_all(exps, workers=args.workers)
        load += ", at the end " + _loadavg()
        path = write_isolation_report(res, scale, command, args.out, probes, load, args.report)
        print(f"[fleet_sim] wrote {path}", flush=True)
        return 0
    command = (
        "python -m bench.fleet_sim"
        + (" --quick" if args.quick else "")
        + (f" --seed {args.seed}" if args.seed != 1 else "")
    )
    print(f"[fleet_sim] {scale}", flush=True)
    profile = get_profile(PROFILE)
    results = run_all(experiments(scale, args.seed), workers=args.workers)
    cliff = cliff_sweep(profile, scale, args.seed)
    rate, _ = sizing(profile, scale, args.seed)
    path = write_report(results, cliff, rate, scale, command, args.out)
    print(f"[fleet_sim] wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
