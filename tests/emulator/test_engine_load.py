"""TTFT and TPOT rise monotonically with offered load (70B profile, model time, same seeds)."""

from __future__ import annotations

import statistics

from emulator.engine import Engine
from emulator.profiles import get_profile
from emulator.workload import poisson_arrivals, run_arrivals


def test_ttft_and_tpot_grow_with_offered_load() -> None:
    profile = get_profile("llama-70b-tp4-h100")
    rows = []
    for rate in (0.5, 2.0, 4.0, 6.0):
        engine = Engine(profile, seed=7)
        arrivals = poisson_arrivals(rate, duration=90.0, seed=11)
        requests = run_arrivals(engine, arrivals)
        ttfts = [r.ttft for r in requests if r.ttft is not None]
        tpots = [r.tpot for r in requests if r.tpot is not None]
        assert len(ttfts) == len(requests)
        rows.append((rate, statistics.fmean(ttfts), statistics.fmean(tpots)))
    for (_, ttft_lo, tpot_lo), (_, ttft_hi, tpot_hi) in zip(rows, rows[1:], strict=False):
        assert ttft_hi > ttft_lo, rows
        assert tpot_hi > tpot_lo, rows
    # The light end sits near the calibration points: ~26 ms/token, prefill-bound TTFT.
    assert 0.026 < rows[0][2] < 0.035, rows
