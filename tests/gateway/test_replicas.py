"""Replica /metrics parsing, histogram quantiles and the TPOT p95 window. No I/O."""

from __future__ import annotations

import math
import time
from collections import deque

import pytest

from contracts import schema
from gateway.admission.replicas import (
    ReplicaRegistry,
    ReplicaState,
    histogram_quantile,
    parse_metrics,
)
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics

METRICS = """# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 10.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.05",model_name="m"} 90.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.1",model_name="m"} 100.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 100.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100.0
"""


def test_parse_metrics_picks_the_four_series() -> None:
    scrape = parse_metrics(METRICS)
    assert (scrape.kv_usage, scrape.running, scrape.waiting) == (0.25, 3, 1)
    assert scrape.itl_bounds == (0.01, 0.05, 0.1, math.inf)
    assert scrape.itl_counts == (10.0, 90.0, 100.0, 100.0)


def test_parse_metrics_of_the_real_emulator_exposition() -> None:
    from emulator.driver import EngineDriver
    from emulator.engine import Engine
    from emulator.metrics import MetricsRenderer
    from emulator.profiles import get_profile

    engine = Engine(get_profile("llama-8b-tp1-h100"))
    text = MetricsRenderer(engine, "m", EngineDriver(engine, 1.0)).render().decode()
    scrape = parse_metrics(text)
    assert scrape.kv_usage == 0.0 and scrape.running == 0
    assert scrape.itl_bounds and math.isinf(scrape.itl_bounds[-1])


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    bounds = (0.01, 0.05, 0.1, math.inf)
    assert histogram_quantile(0.5, bounds, (10, 90, 100, 100)) == pytest.approx(0.01 + 0.04 * 0.5)
    assert histogram_quantile(0.95, bounds, (10, 90, 100, 100)) == pytest.approx(0.075)
    assert histogram_quantile(0.99, bounds, (0, 0, 0, 5)) == 0.1  # only +Inf: top finite bound
    assert histogram_quantile(0.95, bounds, (0, 0, 0, 0)) is None


def test_tpot_p95_uses_the_window_delta_across_replicas() -> None:
    registry = ReplicaRegistry(GatewayConfig(), GatewayMetrics())
    record = schema.ReplicaRecord("a", "http://127.0.0.1:1", "shared")
    version = schema.ModelVersionRecord(
        version="v1",
        family="f",
        context_length=1,
        kv_bytes_per_token=1,
        tpot_target_ms=50,
        kv_capacity_tokens=1,
        replicas=(record, schema.ReplicaRecord("b", "http://x", "shared")),
    )
    registry.sync(schema.Catalog(families={"f": "v1"}, versions={"v1": version}))
    assert registry.tpot_p95("v1") == (None, math.inf)
    now = time.monotonic()
    bounds = (0.02, 0.04, 0.08, math.inf)
    a: ReplicaState = registry.state("a")  # type: ignore[assignment]
    b: ReplicaState = registry.state("b")  # type: ignore[assignment]
    a.itl_bounds = b.itl_bounds = bounds
    # Old history (fast tokens) outside the 30 s window must not count.
    a.itl_ring = deque(
        [
            (now - 50, (1000, 1000, 1000, 1000)),
            (now - 31, (1000, 1000, 1000, 1000)),
            (now - 0.2, (1000, 1100, 1100, 1100)),
        ]
    )
    # b restarted inside the window: counters went down, its newest counts are the delta.
    b.itl_ring = deque([(now - 20, (500, 500, 500, 500)), (now - 0.1, (0, 0, 100, 100))])
    p95, age = registry.tpot_p95("v1")
    # Window: a +100 in (0.02, 0.04], b 100 in (0.04, 0.08]; p95 is in b's bucket.
    assert p95 == pytest.approx(0.04 + 0.04 * (190 - 100) / 100)
    assert 0.0 <= age < 1.0
