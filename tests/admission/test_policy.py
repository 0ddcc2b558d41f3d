"""Unit tests of the pure admission policy modules (gateway/admission/: config, estimates,
classes, routing, retry, ratelimit, early)."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts import formulas
from gateway.admission import classes, config, early, estimates, ratelimit, retry, router, routing
from gateway.admission.config import AdmissionConfig
from gateway.admission.routing import ReplicaView
from gateway.errors import RETRY_AFTER_CAP_MS

CFG = AdmissionConfig()
KIB = 1024


# -- quota estimates (docs/design.md §6) ---------------------------------------------------


def test_tokens_estimate_is_prompt_plus_min_of_max_tokens_and_max_output() -> None:
    assert estimates.tokens_estimate(800, 4096, 2048) == 800 + 2048
    assert estimates.tokens_estimate(800, 100, 2048) == 900
    assert estimates.tokens_estimate(800, None, 2048) == 2848  # no max_tokens: the plan's max


def test_est_out_defaults_to_max_output_and_honours_a_cap() -> None:
    assert estimates.est_out_for_kv(4096) == 4096
    assert estimates.est_out_for_kv(4096, cap=1200) == 1200
    assert estimates.est_out_for_kv(300, cap=1200) == 300


def test_kv_estimate_matches_the_design_worked_example() -> None:
    # docs/design.md §6's example: TPOT 40 ms, 320 KiB/token, 128k prompt, 1,000 output tokens.
    gib_s = formulas.kv_gib_seconds(128_000, 1000, 320 * KIB, 0.040)
    assert gib_s == pytest.approx((128_000 + 500) * 320 * KIB * 1000 * 0.040 / 2**30)
    small = formulas.kv_gib_seconds(200, 100, 320 * KIB, 0.040)
    # output appears squared: twice the output holds ~twice the memory twice as long
    assert formulas.kv_gib_seconds(0, 200, 320 * KIB, 0.04) == pytest.approx(
        4 * formulas.kv_gib_seconds(0, 100, 320 * KIB, 0.04)
    )
    assert gib_s / small > 1000
    assert estimates.to_milli(0.0001) == 1 and estimates.to_milli(2.5) == 2500


@pytest.mark.parametrize(
    ("measured", "age", "expected"),
    [
        (0.020, 1.0, 0.040),  # faster than target: floored at target (never optimistic)
        (0.070, 1.0, 0.070),  # measured inside the band: used as is
        (0.500, 1.0, 0.160),  # one stuck replica: clamped at 4 x target
        (0.070, 61.0, 0.080),  # measurement stale (> 60 s): 2 x target
        (None, 0.0, 0.080),  # no measurement at all: 2 x target
    ],
)
def test_tpot_estimate_clamps_and_falls_back(
    measured: float | None, age: float, expected: float
) -> None:
    assert estimates.tpot_estimate(measured, age, 0.040) == pytest.approx(expected)


# -- classes, ceilings and the reserved pool (docs/design.md §7, R2) -----------------------


@pytest.mark.parametrize(
    ("cls", "load", "ok"),
    [
        ("standard", 0.84, True),
        ("standard", 0.85, False),
        ("best_effort", 0.59, True),
        ("best_effort", 0.60, False),
        ("reserved", 0.92, True),
        ("reserved", 0.921, False),
    ],
)
def test_class_thresholds(cls: config.EffectiveClass, load: float, ok: bool) -> None:
    assert classes.replica_admits(cls, load, CFG) is ok


def test_reserved_tenant_is_reserved_only_under_its_own_floor() -> None:
    assert classes.effective_class("reserved", 0, 5000) == "reserved"
    assert classes.effective_class("reserved", 4999, 5000) == "reserved"
    assert classes.effective_class("reserved", 5000, 5000) == "standard"
    assert classes.effective_class("reserved", 0, 0) == "standard"  # no floor sold
    assert classes.effective_class("best_effort", 0, 5000) == "best_effort"


def test_reserved_pool_admits_only_floor_traffic() -> None:
    assert classes.pool_admits("reserved", "reserved")
    assert not classes.pool_admits("standard", "reserved")
    assert not classes.pool_admits("best_effort", "reserved")
    assert classes.pool_admits("best_effort", "shared")


def test_reserved_pool_sizing_uses_the_written_oversubscription_ratio() -> None:
    # Floors of 10,000 GiB·s x 0.6 / 48 s = 125 GiB held; a 172.5 GiB replica holds
    # 158.7 GiB under 0.92 -> one replica. Twice the floors -> two.
    assert classes.reserved_pool_replicas_needed([6000, 4000], replica_kv_gib=172.5, cfg=CFG) == 1
    assert classes.reserved_pool_replicas_needed([20_000], replica_kv_gib=172.5, cfg=CFG) == 2
    assert classes.reserved_pool_replicas_needed([], replica_kv_gib=172.5, cfg=CFG) == 0
    full = AdmissionConfig(reserved_oversubscription=1.0)
    assert classes.reserved_pool_replicas_needed([20_000], replica_kv_gib=172.5, cfg=full) == 3
    assert (
        classes.check_reserved_floors([20_000], pool_replicas=2, replica_kv_gib=172.5, cfg=CFG)
        is None
    )
    problem = classes.check_reserved_floors(
        [20_000], pool_replicas=1, replica_kv_gib=172.5, cfg=CFG
    )
    assert problem is not None and "need 2" in problem


def test_config_rejects_inconsistent_ceilings() -> None:
    with pytest.raises(ValueError, match="best_effort <= standard <= reserved"):
        AdmissionConfig(standard_max_occupancy=0.95)
    with pytest.raises(ValueError, match="lease_renew_s"):
        AdmissionConfig(lease_renew_s=8, lease_ttl_s=15)


# -- routing (docs/design.md R5) -----------------------------------------------------------


def view(rid: str, occ: float, inflight: int = 0, pool: str = "shared") -> ReplicaView:
    return ReplicaView(rid, pool, occ, inflight, capacity_bytes=1000)


def test_p2c_picks_the_less_loaded_of_two_distinct_samples() -> None:
    views = [view("a", 0.1), view("b", 0.5), view("c", 0.7)]
    rng = random.Random(1)
    picks = Counter(routing.choose_p2c(views, rng).replica_id for _ in range(3000))  # type: ignore[union-attr]
    # c is the max of every pair it is in: never chosen; a wins both its pairs (2/3).
    assert picks["c"] == 0
    assert picks["a"] == pytest.approx(2000, rel=0.1)
    assert picks["b"] == pytest.approx(1000, rel=0.15)
    assert routing.choose_p2c([views[2]], rng) is views[2]
    assert routing.choose_p2c([], rng) is None


def test_optimistic_inflight_counts_in_the_score() -> None:
    # Scraped emptier, but this router already sent 0.5 of a replica there since.
    a, b = view("a", 0.10, inflight=500), view("b", 0.30)
    assert a.load() == pytest.approx(0.60) and a.load(optimistic=False) == 0.10
    rng = random.Random(0)
    assert all(routing.choose_p2c([a, b], rng) is b for _ in range(50))
    assert routing.choose_emptiest([a, b], optimistic=False) is a  # the blind spot


def test_route_applies_class_ceilings_and_says_none_when_full() -> None:
    views = [view("a", 0.70), view("b", 0.80)]
    rng = random.Random(0)
    assert router.route(views, "best_effort", CFG, rng) is None
    assert router.route(views, "standard", CFG, rng) is not None
    full = [view("a", 0.95), view("b", 0.93)]
    assert router.route(full, "reserved", CFG, rng) is None  # told the truth: 503


def test_route_sends_floor_traffic_to_the_reserved_pool_first_then_shared() -> None:
    rng = random.Random(0)
    views = [view("r1", 0.50, pool="reserved"), view("s1", 0.10), view("s2", 0.20)]
    assert router.route(views, "reserved", CFG, rng).replica_id == "r1"  # type: ignore[union-attr]
    # standard never enters the pool even when it is the emptiest
    quiet_pool = [view("r1", 0.0, pool="reserved"), view("s1", 0.84)]
    assert router.route(quiet_pool, "standard", CFG, rng).replica_id == "s1"  # type: ignore[union-attr]
    # pool above 0.92: try another -> shared
    hot_pool = [view("r1", 0.95, pool="reserved"), view("s1", 0.90)]
    assert router.route(hot_pool, "reserved", CFG, rng).replica_id == "s1"  # type: ignore[union-attr]


def test_round_robin_and_emptiest_strategies() -> None:
    views = [view("a", 0.3), view("b", 0.1), view("c", 0.2)]
    rr = AdmissionConfig(strategy="round_robin")
    picks = [
        router.route(views, "standard", rr, random.Random(0), turn=t).replica_id  # type: ignore[union-attr]
        for t in range(4)
    ]
    assert picks == ["a", "b", "c", "a"]
    em = AdmissionConfig(strategy="emptiest")
    assert router.route(views, "standard", em, random.Random(0)).replica_id == "b"  # type: ignore[union-attr]


# -- jitter and the retry budget (docs/design.md R6) ---------------------------------------


@given(st.floats(min_value=0, max_value=120_000), st.integers(0, 2**32))
def test_quota_retry_after_is_at_least_when_the_limit_frees(frees: float, seed: int) -> None:
    """... unless that is past the 60 s cap (``test_no_retry_after_is_ever_above_60_s``):
    then it is within the cap's spread below it."""
    ms = retry.quota_retry_after_ms(frees, CFG, random.Random(seed))
    width = max(CFG.quota_jitter_min_ms, frees * 0.5)
    if frees + width <= CAP:
        assert frees <= ms <= frees + width + 1
    else:
        assert min(frees, CAP - retry.CAPPED_SPREAD_MS) <= ms <= CAP


CAP = RETRY_AFTER_CAP_MS


@given(
    st.floats(min_value=0, max_value=10_000_000),
    st.floats(min_value=0, max_value=10_000_000),
    st.integers(0, 2**32),
)
def test_no_retry_after_is_ever_above_60_s(base: float, width: float, seed: int) -> None:
    """The openai SDK ignores a retry-after above 60 s and retries sooner (its own backoff):
    no wait the gateway tells is longer, whatever the quota, the long-context budget or the
    configured storm and capacity waits say, and its headers say the same capped wait."""
    rng = random.Random(seed)
    lo, hi = retry.told_range(base, width)
    told = retry.jittered_ms(base, width, rng)
    assert 1 <= told <= CAP == 60_000
    assert lo <= hi <= CAP
    assert max(1, math.floor(lo)) <= told <= max(1, math.ceil(hi))
    if base + width <= CAP:  # below the cap: base + jitter, as before
        assert (lo, hi) == (base, base + width)
    else:  # past it: still spread, over the jitter's width up to CAPPED_SPREAD_MS
        assert hi == CAP and hi - lo >= min(width, retry.CAPPED_SPREAD_MS) - 1e-6
    assert retry.quota_retry_after_ms(base, CFG, rng) <= CAP
    assert retry.long_context_retry_after_ms(base, rng) <= CAP
    assert (
        retry.long_context_retry_earliest_ms(int(base))
        <= retry.long_context_retry_latest_ms(int(base))
        <= CAP
    )
    wide = replace(
        CFG,
        storm_retry_after_s=(base / 1000 + 0.001, (base + width) / 1000 + 0.001),
        capacity_retry_base_ms=int(base),
        capacity_jitter_ms=int(width),
    )
    assert retry.storm_retry_after_ms(wide, rng) <= CAP
    assert retry.capacity_retry_after_ms(wide, rng) <= CAP
    headers = retry.retry_headers(int(base + width))
    assert int(headers["retry-after-ms"]) <= CAP and int(headers["retry-after"]) <= CAP // 1000
    assert int(headers["retry-after"]) == math.ceil(int(headers["retry-after-ms"]) / 1000)


def test_a_429_whose_quota_frees_past_60_s_is_told_the_cap_spread_below_it() -> None:
    """The decision for 429s: a per-minute bucket can free in 90 s. Told 90 s, the SDK
    ignores it and spends its retries within seconds, each refused; told at most 60 s, it
    waits, and its retry is refused at worst once more, told the rest (under 40 s). So the
    429 is capped like every other retry-after, its jitter kept below the cap."""
    rng = random.Random(3)
    told = [retry.quota_retry_after_ms(90_000, CFG, rng) for _ in range(500)]
    assert all(CAP - retry.CAPPED_SPREAD_MS <= t <= CAP for t in told)
    assert max(told) - min(told) > 0.9 * retry.CAPPED_SPREAD_MS  # spread, not all at 60 s
    # the retry at <= 60 s finds the rest of the wait, told without the cap's help
    rest = 90_000 - max(told)
    assert rest <= retry.quota_retry_after_ms(rest, CFG, rng) < CAP
    # under the cap: as before, from when the limit frees plus jitter
    assert 20_000 <= retry.quota_retry_after_ms(20_000, CFG, rng) <= 30_000


def test_jitter_bounds_and_spread() -> None:
    rng = random.Random(7)
    storm = [retry.storm_retry_after_ms(CFG, rng) for _ in range(500)]
    assert all(30_000 <= s <= 60_001 for s in storm)
    assert max(storm) - min(storm) > 20_000  # spread across the window, not clumped
    cap = [retry.capacity_retry_after_ms(CFG, rng) for _ in range(500)]
    assert all(5_000 <= c <= 10_001 for c in cap)
    assert len(set(cap)) > 450  # no two clients told the same instant (ms resolution)
    assert retry.retry_headers(1001) == {"retry-after": "2", "retry-after-ms": "1001"}
    assert retry.retry_headers(1) == {"retry-after": "1", "retry-after-ms": "1"}


@pytest.mark.parametrize(
    ("admitted", "retries", "storm"),
    [
        (100, 20, False),  # exactly 20 %: within budget
        (100, 21, True),
        (10, 9, False),  # too little traffic to call it a storm
        (20, 5, True),
        (0, 0, False),
    ],
)
def test_retry_budget(admitted: int, retries: int, storm: bool) -> None:
    assert retry.in_retry_storm(admitted, retries, CFG) is storm


def test_only_non_reserved_retries_are_shed() -> None:
    assert retry.sheds_retry(True, "standard", True)
    assert retry.sheds_retry(True, "best_effort", True)
    assert not retry.sheds_retry(True, "reserved", True)
    assert not retry.sheds_retry(False, "standard", True)
    assert not retry.sheds_retry(True, "standard", False)


def test_retry_window_slides() -> None:
    w = retry.WindowCounts(window_s=60, slots=6)
    for i in range(10):
        w.record(100.0 + i, flagged=i % 2 == 0)
    assert w.counts(110.0) == (10, 5)
    assert w.counts(165.0) == (0, 0)  # a minute later it is all gone


# -- headers -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0ms"),
        (12, "12ms"),
        (999, "999ms"),
        (1000, "1s"),
        (1500, "1.5s"),
        (6.02, "7ms"),
        (360_000, "6m0s"),
        (61_250, "1m1.25s"),
        (3_723_000, "1h2m3s"),
    ],
)
def test_reset_durations_are_formatted_like_openai(ms: float, text: str) -> None:
    assert ratelimit.format_reset(ms) == text


def test_rate_limit_headers() -> None:
    h = ratelimit.RateLimitState(60, 59, 1000, 150_000, -20, 360_000).headers()
    assert h == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-limit-tokens": "150000",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-reset-tokens": "6m0s",
    }


def test_token_bucket_arithmetic() -> None:
    assert ratelimit.bucket_level(None, None, 5, 600) == 600  # absent = full
    assert ratelimit.bucket_level(0.0, 0, 30_000, 600) == 300  # half a minute refills half
    assert ratelimit.bucket_level(500.0, 0, 60_000, 600) == 600  # never above capacity
    assert ratelimit.bucket_reset_ms(300, 600) == 30_000
    b = ratelimit.LocalBucket(100)
    assert b.take(40, 0) == 60
    b.give(100, 0)
    assert b.level == 100


def test_vllm_priority_orders_classes() -> None:
    p = config.VLLM_PRIORITY
    assert p["reserved"] < p["standard"] < p["best_effort"]


def test_best_effort_floor_keeps_free_traffic_above_zero() -> None:
    # the first of a window always passes, then at most 5 % of admissions
    assert classes.best_effort_floor_allows(0, 0, CFG)
    assert not classes.best_effort_floor_allows(10, 1, CFG)
    assert classes.best_effort_floor_allows(100, 4, CFG)
    assert not classes.best_effort_floor_allows(100, 5, CFG)


def test_config_from_env_reads_every_knob_and_names_bad_input() -> None:
    env = {
        "GATEWAY_ADMISSION_STANDARD_MAX_OCCUPANCY": "0.8",
        "GATEWAY_ADMISSION_LAYERS": "requests,capacity",
        "GATEWAY_ADMISSION_STORM_RETRY_AFTER_S": "10,20",
        "GATEWAY_ADMISSION_OPTIMISTIC_INFLIGHT": "false",
        "GATEWAY_ADMISSION_STRATEGY": "round_robin",
        "GATEWAY_ADMISSION_EST_OUT_CAP": "1200",
    }
    cfg = AdmissionConfig.from_env(env)
    assert cfg.standard_max_occupancy == 0.8 and cfg.est_out_cap == 1200
    assert cfg.layers == frozenset({"requests", "capacity"}) and not cfg.enforces("tokens")
    assert cfg.storm_retry_after_s == (10.0, 20.0) and not cfg.optimistic_inflight
    assert cfg.strategy == "round_robin"
    assert AdmissionConfig.from_env({}) == AdmissionConfig()
    with pytest.raises(ValueError, match="GATEWAY_ADMISSION_LEASE_TTL_S"):
        AdmissionConfig.from_env({"GATEWAY_ADMISSION_LEASE_TTL_S": "soon"})
    with pytest.raises(ValueError, match="unknown layers"):
        AdmissionConfig.from_env({"GATEWAY_ADMISSION_LAYERS": "requests,vibes"})
    with pytest.raises(ValueError, match="strategy"):
        AdmissionConfig.from_env({"GATEWAY_ADMISSION_STRATEGY": "fastest"})


def test_capacity_layer_off_makes_every_replica_eligible() -> None:
    off = AdmissionConfig(layers=frozenset({"requests"}))
    views = [view("r1", 0.99, pool="reserved"), view("s1", 0.97)]
    assert len(routing.eligible(views, "best_effort", off)) == 2
    assert router.route(views, "best_effort", off, random.Random(0)) is not None


# -- early dispatch ------------------------------------------------------------------------


def _allowed(
    headroom: early.Headroom,
    undecided: early.Undecided | None = None,
    *,
    now: float = 10.0,
    cfg: AdmissionConfig | None = None,
    **request: int,
) -> bool:
    q = {"rpm": 100, "tpm": 10_000, "kv_cap_milli": 1_000_000, "est_tokens": 100}
    q.update({"est_kv_milli": 10_000, **request})
    return early.early_dispatch_allowed(
        headroom, undecided or early.Undecided(), now=now, cfg=cfg or AdmissionConfig(), **q
    )


def test_early_dispatch_needs_a_margin_on_every_limit_a_recent_answer_and_few_pending() -> None:
    roomy = early.Headroom(at=9.5, requests=50, tokens=5_000, inflight_kv_milli=100_000)
    assert _allowed(roomy)
    # each layer keeps 25 % of its limit free after this request and the undecided ones
    assert _allowed(replace(roomy, requests=26)) and not _allowed(replace(roomy, requests=25))
    assert _allowed(replace(roomy, tokens=2_600)) and not _allowed(replace(roomy, tokens=2_599))
    assert _allowed(roomy, est_kv_milli=650_000)
    assert not _allowed(roomy, est_kv_milli=650_001)
    assert not _allowed(roomy, early.Undecided(requests=25, tokens=0, kv_milli=0))
    assert not _allowed(roomy, early.Undecided(requests=1, tokens=2_401, kv_milli=0))
    # an unlimited layer (0) never stands in the way
    assert _allowed(replace(roomy, requests=0, tokens=0), rpm=0, tpm=0, kv_cap_milli=0)
    # the answer must be recent, and only so many may be awaiting theirs
    assert _allowed(roomy, now=10.5) and not _allowed(roomy, now=10.6)
    assert not _allowed(roomy, early.Undecided(requests=8))
    assert not _allowed(roomy, cfg=AdmissionConfig(early_dispatch=False))


def test_early_dispatch_knobs_from_the_environment() -> None:
    cfg = AdmissionConfig.from_env(
        {
            "GATEWAY_ADMISSION_EARLY_DISPATCH": "0",
            "GATEWAY_ADMISSION_EARLY_DISPATCH_MARGIN": "0.5",
            "GATEWAY_ADMISSION_EARLY_DISPATCH_MAX_AGE_S": "2.5",
        }
    )
    assert not cfg.early_dispatch
    assert cfg.early_dispatch_margin == 0.5 and cfg.early_dispatch_max_age_s == 2.5
    with pytest.raises(ValueError, match="early_dispatch_margin"):
        AdmissionConfig(early_dispatch_margin=1.5)


def test_the_headers_report_the_tighter_of_a_keys_limits_and_its_tenants() -> None:
    tenant = ratelimit.RateLimitState(100, 40, 36_000, 10_000, 9_000, 6_000)
    key = ratelimit.RateLimitState(10, 3, 42_000, 50_000, 49_000, 1_200)
    both = ratelimit.tighter_state(tenant, key)
    # requests: the key has less left; tokens: the tenant has
    assert (both.limit_requests, both.remaining_requests, both.reset_requests_ms) == (
        10,
        3,
        42_000,
    )
    assert (both.limit_tokens, both.remaining_tokens, both.reset_tokens_ms) == (
        10_000,
        9_000,
        6_000,
    )
    assert ratelimit.tighter_state(tenant, None) is tenant
    # an unlimited side (0) never binds: an unlimited tenant reports the key's limit
    open_tenant = ratelimit.RateLimitState(0, 0, 0, 0, 0, 0)
    assert ratelimit.tighter_state(open_tenant, key) == key
    no_rates = ratelimit.RateLimitState(0, 0, 0, 0, 0, 0)
    assert ratelimit.tighter_state(tenant, no_rates) == tenant


_state = st.builds(
    ratelimit.RateLimitState,
    st.integers(0, 1000),
    st.integers(0, 1000),
    st.integers(0, 60_000),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.integers(0, 60_000),
)


@given(_state, _state)
def test_the_tighter_state_reports_the_least_remaining_of_the_limited_sides(
    tenant: ratelimit.RateLimitState, key: ratelimit.RateLimitState
) -> None:
    both = ratelimit.tighter_state(tenant, key)
    for limit, rem in (
        ("limit_requests", "remaining_requests"),
        ("limit_tokens", "remaining_tokens"),
    ):
        limited = [s for s in (tenant, key) if getattr(s, limit) > 0]
        if limited:
            assert getattr(both, rem) == min(getattr(s, rem) for s in limited)
            assert getattr(both, limit) > 0
        else:
            assert getattr(both, limit) == 0
