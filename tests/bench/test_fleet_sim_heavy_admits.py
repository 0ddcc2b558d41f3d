"""The fleet simulation's heavy-tenant accounting: each tenant's budget admissions (whole run
and in the statistics window) against its max-min fair share of them given what it asked
for, so that a tenant asking for less than an equal split is judged by what it asked."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.fleet_sim import (
    FleetConfig,
    Series,
    SimRequest,
    SimResult,
    _heavy_tenant_table,
    heavy_admits,
)
from bench.stats import max_min_shares


def test_max_min_shares_give_small_demands_what_they_ask() -> None:
    assert max_min_shares({"a": 2, "b": 30, "c": 30}, 20) == {"a": 2, "b": 9, "c": 9}
    assert max_min_shares({"a": 2, "b": 3}, 20) == {"a": 2, "b": 3}  # room for all
    assert max_min_shares({"a": 5, "b": 5}, 6) == {"a": 3, "b": 3}
    assert max_min_shares({}, 5) == {}


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 50)), st.integers(0, 200))
def test_max_min_shares_are_water_filling(demand: dict[str, int], capacity: int) -> None:
    shares = max_min_shares(demand, capacity)
    assert sum(shares.values()) <= min(capacity, sum(demand.values())) + 1e-9
    assert abs(sum(shares.values()) - min(capacity, sum(demand.values()))) < 1e-9
    level = max(shares.values(), default=0.0)
    for who, d in demand.items():
        assert shares[who] <= d + 1e-9
        # either it got what it asked for, or it sits at the common level, the largest
        assert abs(shares[who] - d) < 1e-9 or abs(shares[who] - level) < 1e-9


def _result() -> SimResult:
    """Two heavy tenants, statistics over [4, 10): heavy-1 asked twice (once in the window)
    and was admitted once (before it); heavy-2 asked five times (three in the window) and
    was admitted four times (two in the window)."""
    cfg = FleetConfig(replicas=4, duration_s=10.0, warmup_s=4.0, heavy_tenants=2,
                      heavy_rates=(0.1, 1.0))  # fmt: skip
    asks = [("heavy-1", 1.0), ("heavy-2", 1.0), ("heavy-2", 2.0), ("heavy-2", 5.0),
            ("heavy-2", 6.0), ("heavy-2", 7.0), ("heavy-1", 8.0)]  # fmt: skip
    reqs = [
        SimRequest(
            rid=i,
            tenant_class="standard",
            prompt=128_000,
            output=10,
            arrival=t,
            tenant=who,
            heavy=True,
        )  # fmt: skip
        for i, (who, t) in enumerate(asks)
    ]
    reqs.append(SimRequest(rid=99, tenant_class="standard", prompt=500, output=10, arrival=5.0))
    return SimResult(
        cfg, reqs, Series(), np.zeros(4), 0, 0.0,
        long_admitted_at={"heavy-1": [1.0], "heavy-2": [1.5, 2.0, 5.0, 6.5]},
    )  # fmt: skip


def test_heavy_admits_count_the_run_and_the_window_against_the_demand() -> None:
    adm = heavy_admits(_result(), 4.0, 10.0)
    assert adm["heavy-1"] == {"demand": 2, "demand_win": 1, "admits": 1, "admits_win": 0,
                              "share": 2, "share_win": 1}  # fmt: skip
    # 5 admitted in all: heavy-1 asked for 2 (< 2.5), heavy-2 gets the other 3 of its share
    assert adm["heavy-2"] == {"demand": 5, "demand_win": 3, "admits": 4, "admits_win": 2,
                              "share": 3, "share_win": 1}  # fmt: skip


def test_the_heavy_tenant_table_shows_admits_against_the_fair_share() -> None:
    rows = _heavy_tenant_table(_result(), 4.0, 10.0)
    assert "max-min share of the admits (whole run / in window)" in rows[0]
    assert rows[2].startswith("| heavy-1 | 0.1 | 2 / 1 | 1 / 0 | 2.0 / 1.0 |")
    assert rows[3].startswith("| heavy-2 | 1 | 5 / 3 | 4 / 2 | 3.0 / 1.0 |")
    assert rows[-1].endswith("0.50–1.33× (whole run), 0.00–2.00× (in window)")
