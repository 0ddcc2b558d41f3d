"""The noisy-neighbour bench's offered load, derived from the replica profile.

The design sizes a fleet in two steps (docs/design.md §2 and R6; docs/operations.md,
"Capacity"): first the rate one replica carries with both SLOs held (TTFT p95 < 1 s,
TPOT p95 < 50 ms) for the design's token shape, then a fleet that runs at 85 % of it, the
headroom that lets a lost replica's load spread without reaching the cliff. The bench's
tenant rates follow the same two steps instead of constants:

1. ``replica_capacity_rps``: the highest Poisson rate of the design's token shape that ONE
   replica of the bench's own kind — the coarse-grained profile, its chunked-prefill budget
   and long-prefill threshold, priority scheduling — serves with TTFT p95 < 1 s and TPOT p95
   < 50 ms. Measured on the emulator's ``Engine`` in virtual time (no wall clock, so the
   shared machine's load cannot move it), with the bench's own conversion of coarse
   tokens back to real ones (``bench.noisy_neighbour._real_outcome``), by bisection.
2. ``derive_rates``: the design's utilisation (0.85) of that capacity on every replica:
   the shared pool's rate split among the shared tenants in fixed proportions (four
   standard tenants at 3.5 to the free tenant's 1, the bench's original mix).
3. The reserved pool is sized for its own promise, not the shared pool's: enterprise is
   promised both SLOs on 99.9 % of the requests that can meet them at all (the prompt's
   lone prefill under the TTFT target). A replica at the shared pool's rate gives ~97 % of
   them (the heavy tail's queueing), so ``replica_capacity_rps(reserved=True)`` bisects
   for the highest rate at which one replica, alone in virtual time, serves 99.9 % of
   feasible requests within both SLOs; the enterprise tenant is offered the same 85 % of
   that per reserved replica. A reserved replica therefore carries several times fewer
   requests than a shared one: that is what the reserved tier's price pays for
   (docs/operations.md).

The flooding tenants are not part of the sized load: they are the disturbance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from bench.stats import TPOT_SLO_S, TTFT_SLO_S, lone_prefill_feasible, percentile
from bench.workload import DESIGN_OUTPUT, DESIGN_PROMPT
from emulator.engine import Engine
from emulator.profiles import Profile
from emulator.replica_flags import platform_engine_config

# docs/operations.md "Capacity" / docs/design.md R6: the fleet is sized at 85 % of what the
# load needs, so each replica runs at 0.85 of the rate it holds the SLOs at.
DESIGN_UTILISATION = 0.85
RESERVED_ATTAINMENT = 0.999  # enterprise: both SLOs on 99.9 % of feasible requests


@dataclass(frozen=True, slots=True)
class Probe:
    rate_rps: float
    ttft_p95_s: float
    tpot_p95_s: float
    completed: int
    # share of the requests whose prompt's lone prefill on the real profile is under the
    # TTFT target (``bench.stats.lone_prefill_feasible``) that met both SLOs
    feasible_attainment: float = math.nan

    @property
    def holds(self) -> bool:
        return self.ttft_p95_s < TTFT_SLO_S and self.tpot_p95_s < TPOT_SLO_S

    @property
    def holds_reserved(self) -> bool:
        """The reserved tier's promise: the p95s, and both SLOs on ``RESERVED_ATTAINMENT``
        of the feasible requests (NaN, nothing feasible measured, does not hold)."""
        return self.holds and self.feasible_attainment >= RESERVED_ATTAINMENT


def probe_replica(
    profile: Profile,
    rate: float,
    *,
    k: int,
    long_prefill_tokens: int,
    duration_s: float = 600.0,
    warmup_s: float = 40.0,
    seeds: Sequence[int] = (1, 2, 3, 4, 5),
) -> Probe:
    """One coarse replica fed Poisson arrivals of the design's shape at ``rate`` (real
    requests per model second); TTFT and TPOT in real tokens, as the bench reports them,
    pooled over ``seeds`` (one run each): the shape's heavy tail makes one short run's p95
    jump by tenths of a second between neighbouring rates."""
    ttfts: list[float] = []
    tpots: list[float] = []
    feasible: list[bool] = []
    for seed in seeds:
        _run(profile, rate, k, long_prefill_tokens, duration_s, warmup_s, seed, ttfts, tpots,
             feasible)  # fmt: skip
    return Probe(
        rate,
        percentile(ttfts, 95) if ttfts else math.inf,
        percentile(tpots, 95) if tpots else math.inf,
        len(ttfts),
        sum(feasible) / len(feasible) if feasible else math.nan,
    )


def _run(
    profile: Profile,
    rate: float,
    k: int,
    long_prefill_tokens: int,
    duration_s: float,
    warmup_s: float,
    seed: int,
    ttfts: list[float],
    tpots: list[float],
    feasible: list[bool],
) -> None:
    eng = Engine(
        profile,
        platform_engine_config(
            enable_prefix_caching=False, long_prefill_token_threshold=long_prefill_tokens
        ),
        seed=seed,
    )
    rng = np.random.default_rng([seed, int(rate * 1000)])
    n = int(rate * duration_s * 1.3) + 50
    times = np.cumsum(rng.exponential(1.0 / rate, size=n))
    times = times[times < duration_s]
    prompts = DESIGN_PROMPT.sample(rng, len(times))
    outputs = DESIGN_OUTPUT.sample(rng, len(times))
    real_prompt: dict[str, int] = {}
    i = 0
    while True:
        while i < len(times) and times[i] <= eng.now:
            eng.add_request(
                f"r{i}",
                [4096 + i % 100_000] * max(1, math.ceil(int(prompts[i]) / k)),
                max(1, math.ceil(int(outputs[i]) / k)),
                priority=1,
                arrival_time=float(times[i]),
                ignore_eos=True,
            )
            real_prompt[f"r{i}"] = int(prompts[i])
            i += 1
        if eng.now >= duration_s:
            break
        if not eng.has_work():
            if i >= len(times):
                break
            eng.advance_to(float(times[i]))
            continue
        for req in eng.step().finished:
            if req.arrival_time < warmup_s or req.first_token_time is None:
                continue
            ttft = req.first_token_time - req.arrival_time
            tpot = None
            if req.num_output > 1:
                # one emulated token is k real ones (bench.noisy_neighbour._real_outcome)
                tpot = (req.finish_time - req.first_token_time) / (req.num_output - 1) / k
                tpots.append(tpot)
                ttft = max(0.0, ttft - (k - 1) * tpot)
            ttfts.append(ttft)
            if lone_prefill_feasible(real_prompt[req.request_id]):
                feasible.append(ttft < TTFT_SLO_S and (tpot is None or tpot < TPOT_SLO_S))


def bisect_rate(holds: Callable[[float], bool], lo: float, hi: float, steps: int) -> float:
    """The highest rate in [lo, hi] that ``holds``, to (hi - lo) / 2**steps, assuming the SLOs
    hold below some rate and fail above it; ``lo`` itself if even that fails."""
    if not 0 < lo < hi:
        raise ValueError("need 0 < lo < hi")
    if not holds(lo):
        return lo
    for _ in range(steps):
        mid = (lo + hi) / 2
        if holds(mid):
            lo = mid
        else:
            hi = mid
    return lo


def replica_capacity_rps(
    profile: Profile,
    *,
    k: int,
    long_prefill_tokens: int,
    lo: float = 0.25,
    hi: float = 8.0,
    steps: int = 6,
    reserved: bool = False,
    log: Callable[[Probe], None] | None = None,
) -> float:
    """The SLO-holding rate of one bench replica (see the module doc); with ``reserved``,
    the rate that also keeps the reserved tier's attainment (``Probe.holds_reserved``)."""

    def holds(rate: float) -> bool:
        p = probe_replica(profile, rate, k=k, long_prefill_tokens=long_prefill_tokens)
        if log is not None:
            log(p)
        return p.holds_reserved if reserved else p.holds

    return bisect_rate(holds, lo, hi, steps)


def derive_rates(
    capacity_rps: float,
    *,
    shared_replicas: int,
    reserved_replicas: int,
    shared_weights: Mapping[str, float],
    reserved_weights: Mapping[str, float],
    utilisation: float = DESIGN_UTILISATION,
) -> dict[str, float]:
    """Each tenant's rate: every replica offered ``utilisation`` x its capacity, a pool's
    rate split among that pool's tenants by weight."""
    if capacity_rps <= 0 or not 0 < utilisation <= 1:
        raise ValueError("capacity > 0 and 0 < utilisation <= 1")
    out: dict[str, float] = {}
    for replicas, weights in ((shared_replicas, shared_weights),
                              (reserved_replicas, reserved_weights)):  # fmt: skip
        total = sum(weights.values())
        if replicas <= 0 or total <= 0:
            continue
        pool_rate = utilisation * capacity_rps * replicas
        for tenant, w in weights.items():
            out[tenant] = pool_rate * w / total
    return out


# The bench's tenant mix within a pool (its original rates' proportions): each standard
# tenant 3.5 to the free tenant's 1 on the shared pool; the enterprise tenant alone on the
# reserved pool.
STANDARD_WEIGHT = 3.5
FREE_WEIGHT = 1.0


@dataclass(frozen=True, slots=True)
class DerivedLoad:
    capacity_rps: float  # one bench replica's SLO-holding rate (replica_capacity_rps)
    reserved_capacity_rps: float  # the same at the reserved tier's attainment
    utilisation: float
    standard_rps: float  # each standard tenant
    free_rps: float
    enterprise_rps: float
    # the same replica alone in virtual time at the enterprise tenant's rate: what the
    # hardware model gives without any gateway, other tenant or wall clock
    reference: Probe

    def describe(self) -> str:
        r = self.reference
        return (
            f"Offered load derived from the replica profile (bench/nn_capacity.py): one bench "
            f"replica holds TTFT p95 < 1 s and TPOT p95 < 50 ms up to "
            f"{self.capacity_rps:.2f} req/s of the design's token shape (bisection on the "
            f"emulator's Engine in virtual time); every replica is offered "
            f"{self.utilisation:.0%} of that (docs/operations.md, Capacity): each standard "
            f"tenant {self.standard_rps:.2f} req/s, free {self.free_rps:.2f}. The reserved pool "
            f"is sized for enterprise's promise, both SLOs on {RESERVED_ATTAINMENT:.1%} of "
            f"feasible requests: one replica keeps it up to "
            f"{self.reserved_capacity_rps:.2f} req/s (same bisection), and enterprise is "
            f"offered {self.utilisation:.0%} of that, {self.enterprise_rps:.2f} req/s. "
            f"Reference, the same replica alone in virtual time at "
            f"{r.rate_rps:.2f} req/s: TTFT p95 {r.ttft_p95_s * 1000:.0f} ms, TPOT p95 "
            f"{r.tpot_p95_s * 1000:.1f} ms, attainment over feasible prompts "
            f"{r.feasible_attainment:.2%}: what the hardware model gives enterprise at this "
            f"load without any gateway, other tenant or wall clock."
        )


def derived_load(
    profile: Profile,
    *,
    k: int,
    long_prefill_tokens: int,
    shared_replicas: int,
    reserved_replicas: int,
    standard_tenants: int,
    utilisation: float = DESIGN_UTILISATION,
) -> DerivedLoad:
    """The bench's rates for ``profile`` (the coarse one the bench's replicas run)."""
    capacity = replica_capacity_rps(profile, k=k, long_prefill_tokens=long_prefill_tokens)
    reserved = replica_capacity_rps(
        profile, k=k, long_prefill_tokens=long_prefill_tokens, lo=0.02, hi=capacity,
        reserved=True,
    )  # fmt: skip
    shared = {f"std-{i + 1}": STANDARD_WEIGHT for i in range(standard_tenants)}
    shared["free"] = FREE_WEIGHT
    rates = derive_rates(
        capacity,
        shared_replicas=shared_replicas,
        reserved_replicas=0,
        shared_weights=shared,
        reserved_weights={},
        utilisation=utilisation,
    )
    ent = derive_rates(
        reserved,
        shared_replicas=0,
        reserved_replicas=reserved_replicas,
        shared_weights={},
        reserved_weights={"ent": 1.0},
        utilisation=utilisation,
    ).get("ent", 0.0)
    reference = probe_replica(
        profile, max(ent / max(1, reserved_replicas), 1e-3), k=k,
        long_prefill_tokens=long_prefill_tokens,
    )  # fmt: skip
    return DerivedLoad(
        capacity_rps=capacity,
        reserved_capacity_rps=reserved,
        utilisation=utilisation,
        standard_rps=rates.get("std-1", 0.0),
        free_rps=rates["free"],
        enterprise_rps=ent,
        reference=reference,
    )
