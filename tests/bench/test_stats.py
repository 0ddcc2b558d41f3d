"""Percentiles, SLO attainment and goodput as the reports compute them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.stats import Dist, GroupStats, Outcome, percentile, rolling_percentile, within


def _o(i: int, status: int = 200, ttft: float | None = 0.2, tpot: float | None = 0.03) -> Outcome:
    return Outcome(
        request_id=f"r{i}",
        tenant_id="t",
        admission_class="standard",
        status=status,
        sent_s=float(i),
        ttft_s=ttft if status == 200 else None,
        tpot_s=tpot if status == 200 else None,
        completion_tokens=100 if status == 200 else 0,
    )


def test_percentile_interpolates_and_handles_empty() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert math.isnan(percentile([], 95))
    d = Dist.of([None, 1.0, 3.0])
    assert d.n == 2 and d.p50 == 2.0


def test_slo_attainment_counts_refusals_and_slow_requests_as_misses() -> None:
    outs = [
        _o(0),
        _o(1, ttft=1.5),  # TTFT miss
        _o(2, tpot=0.06),  # TPOT miss
        _o(3, status=429),
        _o(4, status=503),
        _o(5, tpot=None),  # one-token answer: only TTFT applies
    ]
    outs.append(Outcome("r6", "t", "standard", 200, 6.0, error="boom"))
    g = GroupStats.of("t", outs, duration_s=10.0)
    assert (g.sent, g.completed, g.refused_429, g.refused_503, g.failed) == (7, 4, 1, 1, 1)
    assert g.attainment == pytest.approx(2 / 7)
    assert g.goodput_rps == pytest.approx(0.2)
    assert g.goodput_tps == pytest.approx(20.0)
    assert g.ttft.p50 == pytest.approx(0.2)


def test_within_tolerance() -> None:
    assert within(1.09, 1.0, 0.10)
    assert not within(1.11, 1.0, 0.10)
    assert not within(math.nan, 1.0, 0.10)


def test_rolling_percentile_window() -> None:
    t = np.arange(100, dtype=float)
    v = np.where(t < 50, 1.0, 10.0)
    gx, gy = rolling_percentile(list(t), list(v), window_s=10, q=95, step_s=5)
    assert gy[gx < 45].max() == 1.0
    assert gy[gx > 65].min() == 10.0


def test_ratio_interval_covers_the_true_ratio_and_narrows_with_more_requests() -> None:
    from bench.stats import ratio_interval

    rng = np.random.default_rng(1)
    quiet = rng.lognormal(-1.0, 0.5, 2000)
    slower = rng.lognormal(-1.0, 0.5, 2000) * 1.2  # a real 20 %
    lo, hi = ratio_interval(slower, quiet)
    assert lo < 1.2 < hi and lo > 1.0  # told apart from no difference
    small_lo, small_hi = ratio_interval(slower[:100], quiet[:100])
    assert small_hi - small_lo > 2 * (hi - lo)  # 100 requests: a much wider interval
    same_lo, same_hi = ratio_interval(quiet[:200], quiet[200:400])
    assert same_lo < 1.0 < same_hi  # two samples of one distribution
    assert ratio_interval(slower, quiet) == (lo, hi)  # seeded: the same every time
    assert all(math.isnan(x) for x in ratio_interval([], quiet))


def test_clopper_pearson_lower_bound() -> None:
    from bench.stats import clopper_pearson_lower

    # every trial a success: the closed form (1 - level) ** (1 / n)
    assert clopper_pearson_lower(3, 3) == pytest.approx(0.05 ** (1 / 3))
    assert clopper_pearson_lower(2995, 2995) >= 0.999 > clopper_pearson_lower(2994, 2994)
    assert clopper_pearson_lower(0, 5) == 0.0
    assert math.isnan(clopper_pearson_lower(0, 0))
    with pytest.raises(ValueError):
        clopper_pearson_lower(6, 5)
    # the bound is where seeing at least k successes has probability 1 - level, by the
    # binomial tail summed with exact integer coefficients
    for k, n in [(5, 10), (17, 20), (1279, 1280), (95, 200)]:
        lo = clopper_pearson_lower(k, n)
        tail = sum(math.comb(n, j) * lo**j * (1 - lo) ** (n - j) for j in range(k, n + 1))
        assert tail == pytest.approx(0.05, rel=1e-6)
        assert lo < k / n
    assert clopper_pearson_lower(5, 10) == pytest.approx(0.2224, abs=1e-4)  # tables' value
    # more misses, a lower bound; a higher level, a lower bound
    assert clopper_pearson_lower(1278, 1280) < clopper_pearson_lower(1279, 1280)
    assert clopper_pearson_lower(1279, 1280, level=0.99) < clopper_pearson_lower(1279, 1280)
