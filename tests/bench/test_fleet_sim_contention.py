"""``fleet_sim.long_prefill_contention``: the measurement behind
bench/results/fleet_sim_isolation_place.md — per tier and per count of other long prefills in
flight on its replica at dispatch, a long context's first token over the one its lease
expects, and how many came after the prefill slot's safety expiry."""

from __future__ import annotations

import pytest

from bench.fleet_sim import SimRequest, long_prefill_contention


def _long(beside: int, very: bool, took_s: float, expected_s: float, hold_s: float) -> SimRequest:
    r = SimRequest(rid=0, tenant_class="standard", prompt=128_000, output=10, arrival=0.0)
    r.sent, r.first_token = 1.0, 1.0 + took_s
    r.long_beside, r.long_very = beside, very
    r.long_expected_s, r.long_hold_s = expected_s, hold_s
    return r


def test_rows_per_tier_and_count_beside() -> None:
    reqs = [
        _long(0, True, 20.0, 20.0, 100.0),
        _long(1, True, 40.0, 20.0, 100.0),
        _long(5, True, 120.0, 20.0, 100.0),  # past its safety expiry; counted under 3+
        _long(0, False, 2.0, 2.0, 10.0),
        _long(4, False, 30.0, 2.0, 10.0),  # past its safety expiry
    ]
    short = SimRequest(rid=1, tenant_class="standard", prompt=100, output=10, arrival=0.0)
    short.first_token = 0.5  # not a long context: long_beside -1, left out
    unfinished = _long(0, True, 0.0, 20.0, 100.0)
    unfinished.first_token = None  # no first token: left out
    rows = {(r.very_long, r.beside): r for r in long_prefill_contention([*reqs, short, unfinished])}
    whole = rows[(True, -1)]
    assert (whole.n, whole.after_expiry) == (3, 1)
    assert whole.ratio_p50 == pytest.approx(2.0) and whole.ratio_p90 == pytest.approx(5.2)
    assert rows[(True, 0)].n == 1 and rows[(True, 0)].ratio_p50 == pytest.approx(1.0)
    assert rows[(True, 1)].ratio_p50 == pytest.approx(2.0)
    assert rows[(True, 3)].n == 1 and rows[(True, 3)].after_expiry == 1
    assert (True, 2) not in rows  # no request in that group: no row
    assert rows[(False, -1)].n == 2 and rows[(False, -1)].after_expiry == 1
    assert rows[(False, 3)].ratio_p50 == pytest.approx(15.0)
