"""The simulation core of the routing scenarios (bench/herd.py, bench/fleet_sim.py,
bench/prefix_routing.py): the emulator's own ``Engine`` stepped in virtual time, and the
gateway's own ``gateway.admission.router.Router`` fed the way the gateway feeds it — occupancy only
through a scrape every ``scrape_s``, first tokens and finishes as the relay reports them.
Arrivals come from ``bench.workload.poisson_arrivals``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bench.workload import DESIGN_OUTPUT, poisson_arrivals
from contracts import schema
from emulator.engine import Engine, StepResult
from emulator.profiles import Profile, prefill_attention_share
from emulator.replica_flags import platform_engine_config
from gateway.admission.config import AdmissionConfig
from gateway.admission.estimates import prefill_bound_seconds
from gateway.admission.long_context import long_context_admits, long_context_budget
from gateway.admission.replicas import ReplicaState
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
class LongContextLedger:
    """The fleet's long-context ledger (Redis in production, read by the admit script of
    gateway/admission/quota.py) and the budget's decisions on it
    (``long_context.long_context_admits``): leases (lease -> tenant, KV bytes, the time its
    prefill slot is held until), tenants refused within the demand window (-> when), each
    tenant's last admission, and the admissions per tenant (and when each was). It records
    no due-backs: its clients retry on their own schedule, not at the retry-after, so every
    waiter counts as due now and the turn order has no backfill (``yields_to_waiting``)."""

    version: schema.ModelVersionRecord
    shared_replicas: int
    adm: AdmissionConfig
    leases: dict[str, tuple[str, int, float]] = field(default_factory=dict)
    waiting: dict[str, float] = field(default_factory=dict)
    served: dict[str, float] = field(default_factory=dict)
    admitted_at: dict[str, list[float]] = field(default_factory=dict)

    @property
    def admitted_by(self) -> dict[str, int]:
        """The admissions per tenant."""
        return {who: len(at) for who, at in self.admitted_at.items()}

    def admit(self, tenant: str, lease: str, need: int, prompt: int, now: float) -> bool:
        """Whether the budget admits ``need`` KV bytes (prompt and output growth, as the
        gateway charges them) of a ``prompt``-token long context for ``tenant``; if so the
        lease is held until ``release``, its prefill slot until ``prefilled``."""
        window = self.adm.long_context_demand_window_s
        for who, at in list(self.waiting.items()):
            if at < now - window:
                del self.waiting[who]
        usage: dict[str, int] = {}
        prefill_by: dict[str, int] = {}
        for who, b, pend in self.leases.values():
            usage[who] = usage.get(who, 0) + b
            if pend > now:
                prefill_by[who] = prefill_by.get(who, 0) + 1
        shared = self.shared_replicas
        budget, slots = long_context_budget(self.version, shared, "standard", self.adm)
        ok = long_context_admits(tenant=tenant, need=need, budget=budget, slots=slots,
                                 usage=usage, prefilling=sum(prefill_by.values()),
                                 waiting=self.waiting.keys(), served=self.served,
                                 prefills=prefill_by)  # fmt: skip
        if ok:
            self.admitted_at.setdefault(tenant, []).append(now)
            self.served[tenant] = now
            # The prefill slot is held until the first token (``prefilled``); the bound is
            # only the gateway's safety expiry for a release that never comes.
            hold = self.adm.long_prefill_hold_factor * prefill_bound_seconds(prompt, self.version)
            self.leases[lease] = (tenant, need, now + hold)
            self.waiting.pop(tenant, None)
        else:
            self.waiting[tenant] = now
        return ok

    def prefilled(self, lease: str, at: float) -> None:
        """The first token reached the gateway: the long prefill gives its slot back (its KV
        stays leased until the request ends), as the gateway's ``prefill_done``."""
        held = self.leases.get(lease)
        if held is not None:
            self.leases[lease] = (held[0], held[1], at)

    def release(self, lease: str) -> None:
        self.leases.pop(lease, None)

    def fleet_bytes(self, but: str = "") -> int:
        """The long-context KV leased fleet-wide, but lease ``but``'s own (what the router's
        ``note_fleet_long`` is told with a budget answer)."""
        return sum(b for lease, (_, b, _) in self.leases.items() if lease != but)


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
