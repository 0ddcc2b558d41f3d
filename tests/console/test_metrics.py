"""The console's Prometheus scraping: concurrent, short timeouts, failures reported as such,
and the ingest and gateway series summed the way the fleet page shows them. The endpoints are
prometheus_client registries served over loopback HTTP, with the metric names the consumer
and the gateway register."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from console import metrics
from tests.support import free_port


@pytest.fixture
def exporter() -> Iterator[tuple[str, CollectorRegistry]]:
    registry = CollectorRegistry()
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{port}/metrics", registry
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_usage_pipeline_sums_lag_events_and_dead_letters(
    exporter: tuple[str, CollectorRegistry], settings: Any
) -> None:
    url, registry = exporter
    lag = Gauge("fairway_ingest_consumer_lag", "", ["topic", "partition"], registry=registry)
    lag.labels("usage.v1", "0").set(7)
    lag.labels("usage.v1", "1").set(5)
    events = Counter("fairway_ingest_events", "", ["outcome"], registry=registry)
    events.labels("ingested").inc(1234)
    events.labels("duplicate").inc(3)
    dead = Counter("fairway_ingest_dead_letters", "", ["reason"], registry=registry)
    dead.labels("bad_json").inc(2)
    dead.labels("expired").inc(1)
    settings.FAIRWAY_INGEST_METRICS_URLS = [url, "http://127.0.0.1:9/metrics"]
    pipeline = metrics.usage_pipeline()
    assert pipeline.reachable and pipeline.total_lag == 12
    assert pipeline.lag == {"usage.v1/0": 7, "usage.v1/1": 5}
    assert pipeline.events == {"ingested": 1234, "duplicate": 3}
    assert pipeline.dead_letters == {"bad_json": 2, "expired": 1}
    assert [s.ok for s in pipeline.scrapes] == [True, False]
    assert pipeline.scrapes[1].error  # the dead one says why


def test_gateway_admission_totals_and_recent_window(
    exporter: tuple[str, CollectorRegistry], settings: Any
) -> None:
    from django.core.cache import cache

    cache.delete(metrics.SAMPLE_KEY)
    url, registry = exporter
    decisions = Counter(
        "fairway_admission_decisions", "", ["admission_class", "outcome"], registry=registry
    )
    rejections = Counter("fairway_gateway_rejections", "", ["status", "code"], registry=registry)
    decisions.labels("standard", "admitted").inc(10)
    decisions.labels("free", "rate_limited_tpm").inc(4)
    rejections.labels("503", "no_capacity").inc(2)
    settings.FAIRWAY_GATEWAY_METRICS_URLS = [url]
    t0 = time.time()
    first = metrics.gateway_admission(now=t0)
    assert first.totals == {"admitted": 10, "429 tpm": 4, "503 no_capacity": 2}
    assert first.recent is None  # nothing to compare with yet
    decisions.labels("standard", "admitted").inc(5)
    second = metrics.gateway_admission(now=t0 + 30)
    assert second.recent == {"admitted": 5, "429 tpm": 0, "503 no_capacity": 0}
    assert second.window_s == 30


def test_a_hanging_replica_costs_one_timeout_not_one_per_replica(settings: Any) -> None:
    import socket

    settings.FAIRWAY_SCRAPE_TIMEOUT_S = 0.5
    listeners = []
    for _ in range(4):  # accept connections, never answer
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        listeners.append(sock)
    try:
        urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in listeners]
        started = time.monotonic()
        scrapes = metrics.scrape_many(urls, health=True)
        elapsed = time.monotonic() - started
    finally:
        for sock in listeners:
            sock.close()
    assert [s.ok for s in scrapes] == [False] * 4
    assert all("Timeout" in s.error for s in scrapes)
    assert elapsed < 1.5  # concurrent: about one timeout, not four


@pytest.mark.django_db
def test_overview_counts_the_tenants_429s_and_503s_from_every_gateway(
    settings: Any, tenant_a: Any, tenant_b: Any, owner_a: Any, browser_for: Any
) -> None:
    """The overview's 429 and 503 counts are this tenant's ``fairway_gateway_requests_total``
    summed over the gateways that answer; another tenant's are not in them."""
    urls = []
    servers = []
    try:
        for rejected in (2, 5):
            registry = CollectorRegistry()
            requests = Counter(
                "fairway_gateway_requests", "", ["tenant", "model", "status"], registry=registry
            )
            requests.labels(str(tenant_a.id), "llama-70b", "200").inc(1500)
            requests.labels(str(tenant_a.id), "llama-70b", "429").inc(1000 * rejected)
            requests.labels(str(tenant_a.id), "llama-8b", "503").inc(rejected)
            requests.labels(str(tenant_b.id), "llama-70b", "429").inc(777)
            port = free_port()
            servers.append(start_http_server(port, addr="127.0.0.1", registry=registry))
            urls.append(f"http://127.0.0.1:{port}/metrics")
        settings.FAIRWAY_GATEWAY_METRICS_URLS = [*urls, "http://127.0.0.1:9/metrics"]
        body = browser_for(owner_a).get(f"/t/{tenant_a.id}/").content.decode()
    finally:
        for server, thread in servers:
            server.shutdown()
            thread.join(timeout=5)
    assert 'data-testid="count-429">7,000<' in body
    assert 'data-testid="count-503">7<' in body
