"""The long-context budget: how much of a version's fleet long prompts may hold at once,
and each tenant's max-min fair share of it (the admit script in
gateway/admission/quota.py decides the same in Redis).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from contracts.schema import ModelVersionRecord as ModelVersionLike
from gateway.admission.classes import occupancy_ceiling
from gateway.admission.config import AdmissionConfig, EffectiveClass
from gateway.admission.estimates import (
    attention_share,
    prefill_bound_seconds,
    prefill_expected_seconds,
)
from gateway.admission.placement import long_context_replicas
from gateway.admission.retry import long_context_retry_latest_ms


def long_context_budget(
    version: ModelVersionLike,
    shared_replicas: int,
    cls: EffectiveClass,
    cfg: AdmissionConfig,
    need: int | None = None,
) -> tuple[int, int]:
    """The fleet's long-context budget for one class of a version: (KV bytes, concurrent
    long prefills). The designated replicas' KV up to the class ceiling, and one long
    prefill per designated replica at a time (vLLM runs ``--max-long-partial-prefills``
    of them per step; more only share the same compute and stretch every step longer).
    With ``long_context_fit`` and the ask's ``need`` (its KV bytes), the KV an ask of that
    size is judged against (``fit_budget``)."""
    n = long_context_replicas(shared_replicas, cfg)
    capacity = version.kv_capacity_tokens * version.kv_bytes_per_token
    kv = math.floor(n * capacity * occupancy_ceiling(cls, cfg))
    if cfg.long_context_fit and need is not None:
        kv = fit_budget(kv, need, n)
    return kv, n * cfg.long_prefill_slots_per_replica


def fit_budget(budget: int, need: int, designated: int) -> int:
    """The long-context budget an ask of ``need`` KV bytes is judged against so that, once
    admitted, some designated replica can hold it whole (``long_context_fit``): ``budget``
    (``floor(n * cap * C)``: ``n = designated`` replicas of ``cap`` bytes each, filled to
    the class ceiling ``C``) less ``(n - 1) * need`` and one byte, never below 0.

    The rule: admit (``total + need <= fit_budget``, the budget's KV clause with this
    budget) only when the fleet's long-context KV in flight before the ask, ``total``,
    satisfies ``total + n * need < n * cap * C``, i.e. ``total < n * (cap * C - need)``.
    Why that suffices (pigeonhole): placement fits the ask on a designated replica whose
    long-context KV ``L_i`` (its floor, ``placement.long_floors``) leaves
    ``L_i + need < cap * C`` (``placement.fits_ceiling``, strict for the budget's
    classes). If no replica did, every ``L_i >= cap * C - need``, so the floors would sum
    to at least ``n * (cap * C - need) > total``; but the floors charge the fleet's
    long-context KV in flight and never more (each lease where it is recorded placed, the
    rest packed onto the room left), so they sum to at most ``total``. The ask's own size
    is enough, no largest context is needed: the argument is about this ask fitting, and
    each later ask is judged by its own size against the total it finds. The one byte
    makes the inequality strict (``floor`` already keeps ``budget <= n * cap * C``). An
    empty budget still runs any one request alone (``long_context_refusal``): with nothing
    in flight every floor is 0.

    It bounds the long-context floors only: a designated replica's scraped and in-flight
    KV (short traffic sent there, ``ReplicaView.load``) can still be over it, and a
    replica with room need not have a prefill slot free (``prefill_slot_free`` only orders
    the candidates). The cost: against the whole pool the budget gives up
    ``(n - 1) * need``, about ``n * need``: with 128k contexts at 0.23 of a replica and
    ``C`` 0.85, 0.62 of each designated replica's KV instead of 0.85, where packing whole
    contexts could hold 0.69 (three of them)."""
    return max(0, budget - max(0, designated - 1) * max(0, need) - 1)


def long_context_lane_slots(shared_replicas: int, cfg: AdmissionConfig) -> int:
    """The budget's extra prefill slots for long contexts that are not very long: the
    designated replicas' ``short_long_prefill_slots_per_replica`` (vLLM's
    ``--max-num-partial-prefills`` less ``--max-long-partial-prefills``)."""
    return long_context_replicas(shared_replicas, cfg) * cfg.short_long_prefill_slots_per_replica


def is_very_long(prefill_expected_s: float, ttft_target_ms: int, cfg: AdmissionConfig) -> bool:
    """Whether a long context is very long: its expected prefill
    (``estimates.prefill_expected_seconds``) is over ``very_long_prefill_ttft_factor`` TTFT
    targets. Only very long ones are limited to the long prefill slots; the others may also
    use the lane (``long_context_lane_slots``)."""
    return prefill_expected_s * 1000 > cfg.very_long_prefill_ttft_factor * max(1, ttft_target_ms)


def lane_prefill_seconds(
    prompt_tokens: int, version: ModelVersionLike, cfg: AdmissionConfig
) -> float:
    """How long a lane prompt's prefill is expected to take beside a very long prefill on
    the same replica. The very long one takes its cap of every step
    (``long_prefill_step_share`` of the budget) and its chunk, attending over a long
    context, sets the step's length; the lane prompt gets the rest of the step. So it
    advances ``(1 - share) / share`` tokens per token of the very long one, at the very
    long one's pace (a context-length prompt's expected prefill per token). Alone it would
    take a fraction of that: in the noisy-neighbour bench 13-32k prompts beside a 128k
    prefill reached their first token after 2-14 s (model time) against 1-3 s alone, and a
    refusal for the busy lane told the lone estimate ran out of retries
    (bench/results/nn_lane/README.md)."""
    ctx = max(1, version.context_length)
    share_of_attention = attention_share(version, cfg.long_prefill_attention_share)
    pace = prefill_expected_seconds(ctx, version, share_of_attention) / ctx
    share = cfg.long_prefill_step_share
    return max(0, prompt_tokens) * pace * share / (1 - share)


@dataclass(frozen=True, slots=True)
class LongContextTier:
    """A long-context ask's tier and the times its lease records (ms), as
    ``long_context_tier`` computes them for the gateway's ``LongContextAsk`` and the fleet
    simulation's ledger alike."""

    very_long: bool  # ``is_very_long``: limited to the very long slots
    prefill_ms: int  # its expected first token alone (``prefill_expected_seconds``)
    # its expected first token beside a very long prefill (``lane_prefill_seconds``); 0 when
    # it is very long itself or there is no lane
    beside_ms: int
    # its prefill slot's safety expiry (s), for a release that never comes (``hold_ms``)
    hold_s: float

    @property
    def hold_ms(self) -> int:
        """The safety expiry as the ask sends it (ms, at least 1)."""
        return max(1, math.ceil(self.hold_s * 1000))

    def first_token_ms(self, long_prefilling: int) -> int:
        """Its expected first token from admission as the admit script records it
        (gateway/admission/quota.py's ``lc_refusal``): beside a running very long prefill
        (``long_prefilling`` of them run) a shorter ask's lane estimate if that is later,
        else its lone one. What the backfill, its due-back and its lease use."""
        if not self.very_long and long_prefilling > 0:
            return max(self.prefill_ms, self.beside_ms)
        return self.prefill_ms


def long_context_tier(
    prompt_tokens: int, version: ModelVersionLike, cfg: AdmissionConfig
) -> LongContextTier:
    """The tier of a ``prompt_tokens`` long context and its expected prefill: very long
    (``is_very_long``) or not, its expected first token alone (attention included, with
    the version's ``attention_share``), beside a very long prefill when it may take the
    lane (``lane_prefill_seconds``; 0 without a lane,
    ``short_long_prefill_slots_per_replica`` 0, so that a budget without a lane is the
    one-tier rule exactly), and its prefill slot's safety expiry
    (``long_prefill_hold_factor`` times the larger of ``prefill_bound_seconds`` and the lane
    estimate). One function for the controller (``AdmissionController.long_context_ask``)
    and the fleet simulation's ledger (bench/sim.py), so that the two cannot drift."""
    prefill_s = prefill_expected_seconds(
        prompt_tokens, version, attention_share(version, cfg.long_prefill_attention_share)
    )
    very_long = is_very_long(prefill_s, version.ttft_target_ms, cfg)
    lane = cfg.short_long_prefill_slots_per_replica > 0
    # a lane prompt beside a very long prefill runs in what that one leaves of each step
    beside_s = lane_prefill_seconds(prompt_tokens, version, cfg) if lane and not very_long else 0.0
    bound_s = max(prefill_bound_seconds(prompt_tokens, version), beside_s)
    return LongContextTier(
        very_long=very_long,
        prefill_ms=max(1, math.ceil(prefill_s * 1000)),
        beside_ms=math.ceil(beside_s * 1000),
        hold_s=cfg.long_prefill_hold_factor * bound_s,
    )


def fair_level(budget: int, usage: Mapping[str, int], waiting: Iterable[str], tenant: str) -> float:
    """Max-min fair share of the long-context budget for ``tenant``: it and every waiting
    tenant (refused within the demand window) want more than they hold; the others want
    what they hold. Water-filling: the level L with sum(min(demand, L)) = budget. A lone
    tenant's level is the whole budget. (The admit script in gateway/admission/quota.py computes
    the same; tests check them against each other.)"""
    waiting = set(waiting)
    fixed = sorted(u for who, u in usage.items() if who != tenant and who not in waiting)
    open_ = 1 + sum(1 for who in waiting if who != tenant)
    left = float(budget)
    for i, u in enumerate(fixed):
        level = left / (open_ + len(fixed) - i)
        if u > level:
            return level
        left -= u
    return left / open_


class LongContextClause(IntEnum):
    """Which clause of the long-context budget refused an ask (``long_context_refusal``; the
    admit script returns the same numbers, ``LEDGER_LUA``'s ``LC_*`` locals are made from
    these). Stable: the refusal metric's ``clause`` label, the 503's
    ``x-fairway-refusal-clause`` header and the benchmark traces use the lower-case names.
    When several hold, the first in this order is reported."""

    KV_FULL = 1  # the budget's KV would overflow
    SLOTS_FULL = 2  # every prefill slot, the lane's included, is running a prefill
    LONG_SLOTS_FULL = 3  # a very long ask, every very long slot busy (the lane may be free)
    YIELD_SLOT = 4  # leaves a prefill slot to the waiters ahead (turn order)
    YIELD_KV = 5  # leaves the budget's KV to the waiters ahead (turn order)
    SLOT_SHARE = 6  # past its max-min share of the prefill slots
    LONG_SLOT_SHARE = 7  # a very long ask past its share of the very long slots
    KV_SHARE = 8  # past its max-min share of the budget's KV

    @property
    def label(self) -> str:
        return self.name.lower()


# The long-context 503's header naming the clause that refused it (a ``LongContextClause``
# label; "unknown" if the store gave none), beside the stable error code
# ``long_context_capacity``.
REFUSAL_CLAUSE_HEADER = "x-fairway-refusal-clause"


def long_context_admits(**ledger: Any) -> bool:
    """Whether the long-context budget admits the ask: ``long_context_refusal`` (same
    arguments) finds no clause refusing it."""
    return long_context_refusal(**ledger) is None


def long_context_refusal(
    *,
    tenant: str,
    need: int,
    budget: int,
    slots: int,
    usage: Mapping[str, int],
    prefilling: int,
    waiting: Iterable[str],
    served: Mapping[str, float] | None = None,
    prefills: Mapping[str, int] | None = None,
    first_token_at: int | None = None,
    due: Mapping[str, int] | None = None,
    very_long: bool = True,
    lane_slots: int = 0,
    long_prefilling: int | None = None,
    long_prefills: Mapping[str, int] | None = None,
    short_waiters: Iterable[str] = (),
) -> LongContextClause | None:
    """The clause of the long-context budget that refuses an ask (None: admitted; the admit
    script returns the same, ``LongContextClause``). The budget's decision: the fleet total
    and the concurrent long prefills (``prefilling``; ``prefills``: how many of them each
    tenant runs) stay within the budget (an empty budget runs any one request, alone), and a
    tenant already holding some may not go past its max-min fair share of the KV, nor one
    already running long prefills past its max-min fair share of the prefill slots
    (``fair_level`` of each, over the same waiting tenants; ``slot_share_reached``). When
    the room left would not cover the tenants waiting ahead of this one, it goes to them,
    least recently served first (``yields_to_waiting``; ``first_token_at``: when this ask's
    first token is expected, ``due``: when each waiting tenant is due back, as the ledger
    records them).

    Two tiers (vLLM's ``--max-long-partial-prefills`` within ``--max-num-partial-prefills``):
    the budget runs ``slots + lane_slots`` long prefills in all, of which at most ``slots``
    very long ones (``very_long``: this ask's tier, ``is_very_long``; ``long_prefilling``
    and ``long_prefills``: the very long ones running, in all and per tenant; None: every
    running prefill is very long). A very long ask needs a free slot of both kinds and
    its share of both; a shorter one only of the total. ``short_waiters``: the waiting
    tenants whose last refused ask was not very long (the others wait for a long slot).
    The defaults are the one-tier rule."""
    waiting = set(waiting)
    total = sum(usage.values())
    all_slots = slots + lane_slots
    long_running = prefilling if long_prefilling is None else long_prefilling
    long_runs = prefills if long_prefills is None else long_prefills
    if total > 0 and total + need > budget:
        return LongContextClause.KV_FULL
    if total > 0 and prefilling >= all_slots:
        return LongContextClause.SLOTS_FULL
    if total > 0 and very_long and long_running >= slots:
        return LongContextClause.LONG_SLOTS_FULL
    slot_free = prefilling < all_slots and (not very_long or long_running < slots)
    if total + need > budget or not slot_free:
        return None  # an empty budget runs any one request, alone
    yielded = yield_clause(
        tenant,
        waiting,
        served or {},
        usage,
        need=need,
        slots_left=all_slots - prefilling - 1,
        kv_left=budget - total - need,
        first_token_at=first_token_at,
        due=due,
        very_long=very_long,
        long_slots_left=slots - long_running - int(very_long),
        short_waiters=short_waiters,
    )
    if yielded is not None:
        return yielded
    if slot_share_reached(tenant, all_slots, prefills or {}, waiting):
        return LongContextClause.SLOT_SHARE
    if very_long and slot_share_reached(
        tenant, slots, long_runs or {}, waiting - set(short_waiters)
    ):
        return LongContextClause.LONG_SLOT_SHARE
    mine = usage.get(tenant, 0)
    if mine > 0 and mine + need > fair_level(budget, usage, waiting, tenant):
        return LongContextClause.KV_SHARE
    return None


def slot_share_reached(
    tenant: str, slots: int, prefills: Mapping[str, int], waiting: Iterable[str]
) -> bool:
    """Whether one more long prefill would take ``tenant`` past its max-min fair share of
    the budget's prefill slots: the water-filling level over the tenants that want more
    (it and every waiting tenant) and what the others run (``prefills``: each tenant's
    long prefills still running). A tenant running none is never refused by it, and with
    nobody waiting the level is every slot the others leave free.

    Why: a 128k prefill holds its slot for tens of seconds, so a tenant asking every second
    runs many more of them than one asking every four seconds, and the turn order
    (``yields_to_waiting``) only protects the room that the waiters ahead are short of: a
    slot that frees while the lighter tenant's retry is still 5-10 s away goes to whichever
    heavier tenant asks in between and was served before it. In the fleet simulation's
    six-heavy-tenant runs that left the 0.25 req/s tenant a fraction of its max-min share
    of the admissions; with the slot share, a tenant already running its share is refused
    while another waits, and the slot stays free for the waiter's retry
    (bench/results/fleet_sim_isolation_split.md)."""
    runs = prefills.get(tenant, 0)
    return runs > 0 and runs + 1 > fair_level(slots, prefills, waiting, tenant)


def waiting_ahead(
    tenant: str,
    waiting: Iterable[str],
    served: Mapping[str, float],
    usage: Mapping[str, int] | None = None,
) -> set[str]:
    """The tenants ``tenant`` would leave room to: each refused within the demand window
    (``waiting``), holding no more of the budget than ``tenant`` does (``usage``; so the
    fair share would not refuse it first) and last admitted before ``tenant`` was
    (``served``: each tenant's last admission, absent = never)."""
    usage = usage or {}
    mine, held = served.get(tenant, -1), usage.get(tenant, 0)
    return {
        w for w in waiting if w != tenant and served.get(w, -1) < mine and usage.get(w, 0) <= held
    }


def yields_to_waiting(
    tenant: str,
    waiting: Iterable[str],
    served: Mapping[str, float],
    usage: Mapping[str, int] | None = None,
    **ask: Any,
) -> bool:
    """Whether ``tenant`` must leave the room to the tenants waiting ahead of it:
    ``yield_clause`` (same arguments) names a clause."""
    return yield_clause(tenant, waiting, served, usage, **ask) is not None


def yield_clause(
    tenant: str,
    waiting: Iterable[str],
    served: Mapping[str, float],
    usage: Mapping[str, int] | None = None,
    *,
    need: int,
    slots_left: int,
    kv_left: int,
    first_token_at: int | None = None,
    due: Mapping[str, int] | None = None,
    very_long: bool = True,
    long_slots_left: int | None = None,
    short_waiters: Iterable[str] = (),
) -> LongContextClause | None:
    """Whether ``tenant`` must leave the room to the tenants waiting ahead of it (W,
    ``waiting_ahead``): it yields exactly when W is not empty and admitting it would leave
    fewer free long-prefill slots than the waiters ahead it would displace (``slots_left``:
    free slots after this admission; ``displaced``) or less of the budget's KV than |W|
    requests of this size (``kv_left``: free KV bytes after it; a waiter's own size is not
    recorded, this request's ``need`` stands in for it).

    Why: a long prefill holds a replica for many seconds and the budget runs only a few at
    once, so the KV share alone cannot be fair when room is scarce: whoever asks first after
    a prefill ends would take the slot, and the served counts would be a lottery of arrival
    times. Least recently served first makes them take turns. But while the room left after
    this admission still covers every tenant ahead (each retries within its retry-after),
    admitting costs them nothing, and holding the room back only leaves it idle and turns
    this tenant into a waiter too: when long prompts come from many tenants in turn nearly
    every arrival then finds someone ahead, and the fleet simulation's budget refused long
    prompts with most of it free until their clients gave up
    (bench/results/fleet_sim_isolation_drain.md). A lone tenant (nobody ahead) never
    yields.

    Backfill (as EASY-backfilling schedulers fill a reservation's gap): the slot clause
    counts only the waiters ahead that are due back (``due``: the ledger's refusal time
    plus the wait it was told, before jitter) no later than this ask's expected first token
    (``first_token_at``: now plus ``LongContextAsk.prefill_ms``). A prefill slot frees at
    the first token, so an ask that will be done prefilling before a waiter can come back
    takes nothing from it: it runs in the gap that would otherwise be idle (the
    noisy-neighbour benchmark found one slot held empty for seconds while two tenants were
    refused eight times yielding to a third not yet due back,
    bench/results/nn_retry_after/README.md). A waiter with no due-back recorded, or no
    ``first_token_at`` given (the herd simulation's ledger: its refused requests never
    come back), counts as due now: the rule as before. An estimate that runs long can
    still be in the slot when the waiter returns; it then waits for that prefill's first token
    (``long_context_wait_ms``), as it would for any running prefill.

    The KV clause keeps every waiter ahead: a prefill slot frees at the first token but the
    request's KV stays until it ends (tens of seconds of decode, unknown output length), so
    an ask done prefilling before a waiter returns still holds the KV the waiter needs, and
    the gap argument does not hold for it. With long outputs the KV can run short while
    slots are free, and the same lottery would decide who gets it. In the fleet
    simulation's sizing probes and its six-heavy-tenant run it never decided an ask (0 of
    ~350 and of 2,915 that reached it; the slot clause refused 0-5 and 2,143): the
    designated replicas' KV holds several 128k requests per prefill slot, so there the slots
    run short first (bench/results/fleet_sim_isolation_yield.md).

    Tiers (``long_context_admits``): the slot clause compares how many of the waiters
    ahead the free slots could run before and after this ask (``seatable``;
    ``long_slots_left``: free very long slots after it, None: ``slots_left``;
    ``short_waiters``: those waiting for a shorter prompt). With one tier that is the
    rule above; with two, a shorter ask is not refused for a 128k waiter ahead while only
    the lane is free (the 128k one could not run there)."""
    ahead = waiting_ahead(tenant, waiting, served, usage)
    early = displaced(ahead, first_token_at, due or {})
    short = early & set(short_waiters)
    long_left = slots_left if long_slots_left is None else long_slots_left
    slot = takes_a_waiters_slot(
        len(early - short), len(short), very_long=very_long, slots_left=slots_left,
        long_slots_left=long_left,
    )  # fmt: skip
    if not ahead:
        return None
    if slot:
        return LongContextClause.YIELD_SLOT
    return LongContextClause.YIELD_KV if kv_left < len(ahead) * need else None


def takes_a_waiters_slot(
    very_long_waiters: int,
    shorter_waiters: int,
    *,
    very_long: bool,
    slots_left: int,
    long_slots_left: int,
) -> bool:
    """The slot clause of ``yields_to_waiting``: whether an ask (``very_long``: its tier)
    taking its slot lowers how many of the waiters ahead that it would displace
    (``very_long_waiters`` and ``shorter_waiters`` of them) the free prefill slots could
    run (``seatable``; ``slots_left`` and ``long_slots_left``: free slots in all and free
    very long ones after it). The admit script's ``slot_yield``; with one tier, whether the
    slots left are fewer than the waiters."""
    vl = int(very_long)
    before = seatable(very_long_waiters, shorter_waiters, long_slots_left + vl, slots_left + 1)
    after = seatable(very_long_waiters, shorter_waiters, long_slots_left, slots_left)
    return after < before


def seatable(very_long: int, shorter: int, long_free: int, free: int) -> int:
    """How many waiters (``very_long`` of them waiting for a very long prompt, ``shorter``
    for a shorter long context) the free prefill slots can run: ``free`` in all, of which
    ``long_free`` may take a very long one. An ask yields on the slots exactly when taking
    its slot lowers this (``yields_to_waiting``): with one tier, when the slots left after
    it are fewer than the waiters; with two, a shorter ask does not yield to very long
    waiters that could not run anyway (the long slots are busy), and a very long ask
    yields to a shorter waiter only for the last slot of all."""
    return max(0, min(free, shorter + min(very_long, max(0, long_free))))


def displaced(ahead: Iterable[str], first_token_at: int | None, due: Mapping[str, int]) -> set[str]:
    """The waiters ahead that an ask expected to finish prefilling at ``first_token_at``
    would keep from a slot: each due back no later than that (``due``; absent, or no
    ``first_token_at``: due now, displaced)."""
    return {w for w in ahead if first_token_at is None or w not in due or due[w] <= first_token_at}


def yield_wait_ms(slot_wait_ms: int, ahead_back: Iterable[tuple[int, int]], now: int) -> int:
    """How long a tenant that yielded to the waiters ahead is told to wait: until the room
    is expected for it, when every waiter ahead has come back and had its prefill
    (``ahead_back``: each one's due-back and its last ask's ``prefill_ms``, as the ledger
    records them; a waiter with none recorded counts as due now with no prefill), and at
    least the slot or KV wait it would be told anyway (``slot_wait_ms``,
    ``long_context_wait_ms``). The approximation: a waiter's prefill is the estimate of
    the ask it was refused for, it is assumed to come back at the earliest it was told
    (jitter only makes it later) and to take the slot then, and waiters ahead are not
    assumed to share the free slots: the latest of them bounds the wait. It is not told 1 s
    with the slot idle and the waiter not due for seconds (its retries would run out)."""
    back = max((at + prefill for at, prefill in ahead_back), default=now)
    return max(slot_wait_ms, back - now)


# -- when a refused ask should come back ---------------------------------------------------

# A prefill past its expected first token is told to need a quarter of the time it has run
# so far again (an honest guess that grows the longer it overruns; the estimate was wrong,
# and the asker's own estimate has nothing to do with it).
OVERRUN_DIVISOR = 4
# A refused tenant that holds none of the budget stays waiting until the latest retry its
# 503 asks for, plus this (its client's send and the gateway's own work before the ask).
WAITING_GRACE_MS = 2000


@dataclass(frozen=True, slots=True)
class LeaseTimes:
    """One long-context lease's times as the ledger records them (ms, the store's clock;
    the admit script in gateway/admission/quota.py reads the same from its lease and its
    admission record)."""

    prefill_end: int  # its prefill slot's safety expiry, or when its first token came
    expected_end: int  # when it is expected to end (its decode at the TPOT estimate)
    admitted: int = -1  # when it was admitted (-1: not recorded)
    first_token_due: int = -1  # when its first token is expected (-1: not recorded)
    very_long: bool = True  # its tier (a lease recorded without one: very long)
    kv: int = 0  # its KV bytes (the lease's first field)
    expires: int = -1  # its lease expiry, renewed while it runs (-1: not recorded)


def prefill_frees_at(lease: LeaseTimes, now: int) -> int:
    """When a lease still prefilling is expected to give its prefill slot back: at its
    expected first token; once past it (the estimate was short), ``now`` plus a quarter of
    the time it has prefilled so far (``OVERRUN_DIVISOR``); without a recorded estimate, at
    its safety expiry. Never after the safety expiry, when the slot frees anyway."""
    if lease.first_token_due > now:
        at = lease.first_token_due
    elif lease.first_token_due >= 0 and lease.admitted >= 0:
        at = now + (now - lease.admitted) // OVERRUN_DIVISOR
    else:
        at = lease.prefill_end
    return min(at, lease.prefill_end)


def lease_ends_at(lease: LeaseTimes, now: int) -> int:
    """When a lease is expected to end and give its KV back: at its expected end; once
    past it (its decode ran longer than the estimate), ``now`` plus a quarter of its life
    so far (``OVERRUN_DIVISOR``, the slot wait's overrun rule), never past its lease expiry
    (it frees then if nobody renews it; a lease still within its estimate is renewed while it
    runs, so its expiry does not bound it); without an admission recorded, at its expiry,
    or without either at its expected end."""
    if lease.expected_end > now:
        return lease.expected_end
    if lease.admitted >= 0:
        at = now + (now - lease.admitted) // OVERRUN_DIVISOR
        return at if lease.expires < 0 else min(at, lease.expires)
    return lease.expires if lease.expires >= 0 else lease.expected_end


def kv_frees_at(leases: Iterable[LeaseTimes], now: int, kv_short: int) -> int:
    """When enough leases are expected to have ended (``lease_ends_at``) for ``kv_short``
    more bytes to fit: the first end, in end order, by which the leases ended free at least
    that much (``kv_short`` <= 0: the first lease's end; the KV·seconds layer's wait in the
    same admit script counts the same way). Never enough (the leases hold less): the last
    end, when the budget is empty and runs any one request alone. No lease: ``now`` + 1 s."""
    got, at = 0, now + 1000
    for end, kv in sorted((lease_ends_at(x, now), x.kv) for x in leases):
        got, at = got + kv, end
        if got >= kv_short:
            break
    return at


def long_context_wait_ms(
    leases: Iterable[LeaseTimes],
    now: int,
    *,
    slots_bound: bool,
    kv_bound: bool,
    long_only: bool = False,
    kv_short: int = 0,
) -> int:
    """How long (ms, at least 1 s) a refused long-context ask should wait before asking
    again: until a prefill slot frees (``slots_bound``: every slot was busy, the slot left
    went to a tenant waiting ahead, or the tenant runs its share of the slots,
    ``slot_share_reached``) — the first of the running prefills expected to
    end (``prefill_frees_at``), not when some lease's decode ends nor the asker's own
    prefill estimate — and/or until KV frees (``kv_bound``: the budget's KV, or the fair
    share), when enough leases are expected to have ended (``kv_frees_at``) for the
    ``kv_short`` bytes the ask lacks (``total + need - budget`` for ``kv_full``; <= 0, any
    other KV refusal: the first lease's end), each past its expected end by the overrun
    rule (``lease_ends_at``). Both: the later. Nothing to wait for
    (no lease of that kind): 1 s. A tenant that yielded to the waiters ahead is told
    the later of this and ``yield_wait_ms``. ``long_only``: a very long ask refused for
    the very long slots waits for a very long prefill (a lane prompt ending frees no slot
    it may take)."""
    leases = list(leases)
    slot_at = min(
        (
            prefill_frees_at(x, now)
            for x in leases
            if x.prefill_end > now and (x.very_long or not long_only)
        ),
        default=now + 1000,
    )
    kv_at = kv_frees_at(leases, now, kv_short)
    if slots_bound and kv_bound:
        at = max(slot_at, kv_at)
    elif slots_bound:
        at = slot_at
    else:
        at = kv_at
    return max(1000, at - now)


def waiting_score(now: int, wait_ms: int, window_ms: int, *, holds: bool) -> int:
    """A refused tenant's entry among those waiting (the ledger's ``w``, scored so that it
    counts until its score plus the demand window). A tenant that holds some of the budget
    waits for the demand window from its refusal, as before. One that holds none is
    waiting until its client comes back: it stays at least until the latest retry its 503
    asks for (``long_context_retry_latest_ms``) plus ``WAITING_GRACE_MS``, so that a
    refusal told to wait longer than the window still finds itself ahead when it retries.
    A later refusal never shortens an entry (the script adds with ``ZADD GT``)."""
    if holds:
        return now
    return max(now, now + long_context_retry_latest_ms(wait_ms) + WAITING_GRACE_MS - window_ms)
