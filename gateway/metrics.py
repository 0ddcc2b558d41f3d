"""Prometheus metrics of one gateway process, aggregated across worker processes.

Multiprocess mode when ``PROMETHEUS_MULTIPROC_DIR`` is set (the supervisor sets it for
``--workers N``): a scrape lands on one worker at random, so per-process registries would
return a random worker's counters and ``rate()`` over them would be noise. In multiprocess
mode every process writes its samples to an mmap'd file and ``/metrics`` sums the files.
Without the variable (one process, in-process tests) a private registry is used.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.2, 0.5, 1.0)
OVERHEAD_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025,
    0.05, 0.1, 0.5,
)  # fmt: skip


class GatewayMetrics:
    def __init__(self) -> None:
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "fairway_gateway_requests",
            "Chat requests by tenant, model and final status.",
            ["tenant", "model", "status"],
            registry=r,
        )
        self.rejections = Counter(
            "fairway_gateway_rejections",
            "Requests refused before reaching a replica.",
            ["status", "code"],
            registry=r,
        )
        self.ttft = Histogram(
            "fairway_gateway_ttft_seconds",
            "Time to first token seen by the client.",
            ["model", "admission_class"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "fairway_gateway_tpot_seconds",
            "Mean time per output token of a request.",
            ["model", "admission_class"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.preflight = Histogram(
            "fairway_gateway_preflight_seconds",
            "Gateway time before the upstream request is sent (auth, validation, admission).",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.added = Histogram(
            "fairway_gateway_added_seconds",
            "Gateway's own time in a request's latency: before the upstream send, plus from "
            "the upstream's first token (SSE) or end (JSON) to the client's socket.",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "fairway_gateway_upstream_errors",
            "Failures talking to replicas.",
            ["replica", "kind"],
            registry=r,
        )
        self.finished = Counter(
            "fairway_gateway_finished",
            "Admitted requests by finish reason.",
            ["model", "finish_reason"],
            registry=r,
        )
        self.inflight = Gauge(
            "fairway_gateway_inflight_requests",
            "Requests currently relayed.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.awaiting_first_token = Gauge(
            "fairway_gateway_streams_awaiting_first_token",
            "Streaming requests relayed whose first token has not reached the client yet.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.spool_depth = Gauge(
            "fairway_gateway_usage_spool_depth",
            "Usage events written locally, not yet acknowledged by Kafka.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.usage_events = Counter(
            "fairway_gateway_usage_events", "Usage events by delivery step.", ["step"], registry=r
        )
        self.auth_cache = Counter(
            "fairway_gateway_readmodel_cache",
            "Read-model lookups by cache result.",
            ["kind", "result"],
            registry=r,
        )
        self.readmodel_invalidations = Counter(
            "fairway_gateway_readmodel_invalidations",
            "Cache entries dropped by change kind.",
            ["kind"],
            registry=r,
        )
        self.replica_healthy = Gauge(
            "fairway_gateway_replica_healthy",
            "1 when the replica is in the routing set.",
            ["replica"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.scrape_failures = Counter(
            "fairway_gateway_replica_scrape_failures",
            "Failed /metrics scrapes of replicas.",
            ["replica"],
            registry=r,
        )
        self.idempotency = Counter(
            "fairway_gateway_idempotency", "Idempotency-Key outcomes.", ["result"], registry=r
        )

    def render(self) -> bytes:
        if self.multiprocess:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
