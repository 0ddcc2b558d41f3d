"""The noisy-neighbour bench's load derivation (bench/nn_capacity.py): the rate split and
the bisection are pure and property-tested; the replica probe runs a short virtual-time
engine."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.nn_capacity import (
    DESIGN_UTILISATION,
    Probe,
    bisect_rate,
    derive_rates,
    probe_replica,
)
from bench.noisy_neighbour import NNConfig, coarse_profile
from emulator.profiles import LLAMA_70B_TP4_H100

weights = st.dictionaries(
    st.text(min_size=1, max_size=4), st.floats(0.1, 10.0), min_size=1, max_size=6
)


@given(
    capacity=st.floats(0.05, 50.0),
    shared=st.integers(1, 64),
    reserved=st.integers(0, 8),
    shared_w=weights,
    util=st.floats(0.1, 1.0),
)
def test_every_replica_is_offered_the_utilisation_of_its_capacity(
    capacity: float, shared: int, reserved: int, shared_w: dict[str, float], util: float
) -> None:
    rates = derive_rates(
        capacity,
        shared_replicas=shared,
        reserved_replicas=reserved,
        shared_weights=shared_w,
        reserved_weights={"reserved-tenant": 1.0},
        utilisation=util,
    )
    shared_total = sum(rates[t] for t in shared_w)
    assert math.isclose(shared_total, util * capacity * shared, rel_tol=1e-9)
    if reserved:
        assert math.isclose(rates["reserved-tenant"], util * capacity * reserved, rel_tol=1e-9)
    else:
        assert "reserved-tenant" not in rates
    # the split follows the weights
    a, b = next(iter(shared_w)), list(shared_w)[-1]
    assert math.isclose(rates[a] * shared_w[b], rates[b] * shared_w[a], rel_tol=1e-9)


def test_rates_scale_with_capacity_not_with_a_constant() -> None:
    kw = dict(shared_replicas=4, reserved_replicas=1, shared_weights={"s": 3.5, "f": 1.0},
              reserved_weights={"e": 1.0})  # fmt: skip
    one = derive_rates(1.0, **kw)  # type: ignore[arg-type]
    two = derive_rates(2.0, **kw)  # type: ignore[arg-type]
    assert all(math.isclose(two[t], 2 * one[t]) for t in one)
    assert math.isclose(one["e"], DESIGN_UTILISATION)
    with pytest.raises(ValueError):
        derive_rates(0.0, **kw)  # type: ignore[arg-type]


@given(threshold=st.floats(0.3, 7.9), steps=st.integers(1, 12))
def test_bisection_brackets_a_monotone_threshold(threshold: float, steps: int) -> None:
    lo, hi = 0.25, 8.0
    got = bisect_rate(lambda r: r < threshold, lo, hi, steps)
    assert got < threshold  # never a rate that fails
    assert threshold - got <= (hi - lo) / 2**steps + 1e-12


def test_bisection_returns_the_floor_when_nothing_holds() -> None:
    assert bisect_rate(lambda r: False, 0.5, 4.0, 5) == 0.5


def test_probe_of_the_bench_replica_reports_real_token_latencies() -> None:
    cfg = NNConfig()
    profile = coarse_profile(LLAMA_70B_TP4_H100, cfg.k, cfg.chunk_tokens)
    light = probe_replica(profile, 0.5, k=cfg.k, long_prefill_tokens=cfg.long_prefill_tokens,
                          duration_s=120.0, warmup_s=10.0, seeds=(1,))  # fmt: skip
    heavy = probe_replica(profile, 6.0, k=cfg.k, long_prefill_tokens=cfg.long_prefill_tokens,
                          duration_s=120.0, warmup_s=10.0, seeds=(1,))  # fmt: skip
    assert light.completed > 20
    # a lone replica's decode step is ~26 ms per real token (docs/design.md §2)
    assert 0.020 < light.tpot_p95_s < 0.050
    assert light.holds and 0.9 < light.feasible_attainment <= 1.0
    assert not heavy.holds  # 6 req/s is past the occupancy cliff (bench/results/fleet_sim.md)


def test_the_reserved_tier_holds_only_at_its_attainment_and_the_p95s() -> None:
    ok = Probe(1.0, 0.8, 0.040, 1000, feasible_attainment=0.999)
    assert ok.holds_reserved
    assert not Probe(1.0, 0.8, 0.040, 1000, feasible_attainment=0.998).holds_reserved
    assert not Probe(1.0, 1.2, 0.040, 1000, feasible_attainment=1.0).holds_reserved
    assert not Probe(1.0, 0.8, 0.040, 0).holds_reserved  # nothing feasible measured
