"""The long-context budget: how much of a version's fleet long prompts may hold at once,
and each tenant's max-min fair share of it (the admit script in
gateway/admission/quota.py decides the same in Redis).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from contracts.schema import ModelVersionRecord as ModelVersionLike
from gateway.admission.classes import occupancy_ceiling
from gateway.admission.config import AdmissionConfig, EffectiveClass
from gateway.admission.placement import long_context_replicas


def long_context_budget(
    version: ModelVersionLike, shared_replicas: int, cls: EffectiveClass, cfg: AdmissionConfig
) -> tuple[int, int]:
    """The fleet's long-context budget for one class of a version: (KV bytes, concurrent
    long prefills). The designated replicas' KV up to the class ceiling, and one long
    prefill per designated replica at a time (vLLM runs ``--max-long-partial-prefills``
    of them per step; more only share the same compute and stretch every step longer)."""
    n = long_context_replicas(shared_replicas, cfg)
    capacity = version.kv_capacity_tokens * version.kv_bytes_per_token
    kv = math.floor(n * capacity * occupancy_ceiling(cls, cfg))
    return kv, n * cfg.long_prefill_slots_per_replica


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


def long_context_admits(
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
) -> bool:
    """The long-context budget's decision: the fleet total and the concurrent long
    prefills (``prefilling``; ``prefills``: how many of them each tenant runs) stay within
    the budget (an empty budget runs any one request, alone), and a tenant already holding
    some may not go past its max-min fair share of the KV, nor one already running long
    prefills past its max-min fair share of the prefill slots (``fair_level`` of each, over
    the same waiting tenants; ``slot_share_reached``). When the room left would not cover
    the tenants waiting ahead of this one, it goes to them, least recently served first
    (``yields_to_waiting``)."""
    waiting = set(waiting)
    total = sum(usage.values())
    if total + need > budget or prefilling >= slots:
        return total <= 0
    if yields_to_waiting(
        tenant,
        waiting,
        served or {},
        usage,
        need=need,
        slots_left=slots - prefilling - 1,
        kv_left=budget - total - need,
    ):
        return False
    if slot_share_reached(tenant, slots, prefills or {}, waiting):
        return False
    mine = usage.get(tenant, 0)
    if mine <= 0:
        return True
    return mine + need <= fair_level(budget, usage, waiting, tenant)


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
    *,
    need: int,
    slots_left: int,
    kv_left: int,
) -> bool:
    """Whether ``tenant`` must leave the room to the tenants waiting ahead of it (W,
    ``waiting_ahead``): it yields exactly when W is not empty and admitting it would leave
    fewer free long-prefill slots than |W| (``slots_left``: free slots after this
    admission) or less of the budget's KV than |W| requests of this size (``kv_left``: free
    KV bytes after it; a waiter's own size is not recorded, this request's ``need`` stands
    in for it).

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

    The KV clause: a prefill slot frees at the first token but the request's KV stays until
    it ends, so with long outputs the KV can run short while slots are free, and the same
    lottery would decide who gets it. In the fleet simulation's sizing probes and its
    six-heavy-tenant run it never decided an ask (0 of ~350 and of 2,915 that reached it;
    the slot clause refused 0-5 and 2,143): the designated replicas' KV holds several 128k
    requests per prefill slot, so there the slots run short first
    (bench/results/fleet_sim_isolation_yield.md)."""
    ahead = len(waiting_ahead(tenant, waiting, served, usage))
    return ahead > 0 and (slots_left < ahead or kv_left < ahead * need)
