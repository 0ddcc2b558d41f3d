"""The simulation core of the routing scenarios (bench/herd.py, bench/fleet_sim.py,
bench/prefix_routing.py): the emulator's own ``Engine`` stepped in virtual time, and the
gateway's own ``gateway.admission.router.Router`` fed the way the gateway feeds it — occupancy only
through a scrape every ``scrape_s``, first tokens and finishes as the relay reports them.
Arrivals come from ``bench.workload.poisson_arrivals``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from contracts import schema
from emulator.engine import Engine, StepResult
from emulator.profiles import Profile
from gateway.admission.replicas import ReplicaState
from gateway.admission.router import Router


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
    n: int, name: Callable[[int], str] = "r{}".format
) -> list[schema.ReplicaRecord]:
    """``n`` shared replicas as the read model lists them (addresses are never dialled)."""
    return [schema.ReplicaRecord(name(i), f"sim://{name(i)}", "shared") for i in range(n)]


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
