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
# Seconds a long-context request was held before its answer (gateway/admission/hold.py).
HOLD_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0)
OVERHEAD_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025,
    0.05, 0.1, 0.5,
)  # fmt: skip


OTHER_TENANTS = "other"


class GatewayMetrics:
    def __init__(self, max_tenant_labels: int = 1000) -> None:
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        # Tenants that get their own series; any further tenant is counted under "other",
        # so the series count stays bounded whatever the number of tenants.
        self._tenant_labels: set[str] = set()
        self._max_tenant_labels = max_tenant_labels
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
        self.usage_source = Counter(
            "fairway_gateway_usage_source",
            "Usage events by where their token counts came from: final (the replica's usage"
            " chunk), continuous (its last per-chunk counts: a stream cut off before the"
            " usage chunk), estimate (the prompt estimate and the relayed chunk count),"
            " none (nothing produced).",
            ["source"],
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
            "Spool lines (usage events and in-flight marks) not yet passed by the sender.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.spool_unwritten = Gauge(
            "fairway_gateway_usage_spool_unwritten_events",
            "Usage events emitted but not yet written to the spool (held while it cannot write).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.spool_writable = Gauge(
            "fairway_gateway_usage_spool_writable",
            "0 while the usage spool has failed to take events past the unhealthy bound "
            "(a degraded dependency: the events wait in memory; readiness holds), else 1.",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.broker_up = Gauge(
            "fairway_gateway_usage_broker_up",
            "0 while this process's last delivery to Kafka failed (events wait in the "
            "spool), else 1; 1 also when no broker is configured.",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.ready = Gauge(
            "fairway_gateway_ready",
            "1 while this process is ready to serve (what /readyz answers), else 0.",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.redis_up = Gauge(
            "fairway_gateway_redis_up",
            "1 while the Redis of a role (readmodel, limits, idempotency) answered this "
            "process's last probe, else 0.",
            ["role"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.usage_events = Counter(
            "fairway_gateway_usage_events",
            "Usage events by step: emitted, delivered, quarantined (a spooled line that is "
            "not an event, moved aside).",
            ["step"],
            registry=r,
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
        self.scrapes = Counter(
            "fairway_gateway_replica_scrapes",
            "Successful /metrics scrapes of replicas (what routing last saw of each).",
            ["replica"],
            registry=r,
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
        self.retries = Counter(
            "fairway_gateway_retries",
            "Requests counted as retries (by: idempotency, memory, shared), and those only the "
            "client's x-stainless-retry-count called one (by=unconfirmed; never counted); "
            "header: whether the client said it retried (claimed, absent).",
            ["by", "header"],
            registry=r,
        )

    def tenant_label(self, tenant_id: str) -> str:
        if tenant_id in self._tenant_labels or tenant_id == "-":
            return tenant_id
        if len(self._tenant_labels) < self._max_tenant_labels:
            self._tenant_labels.add(tenant_id)
            return tenant_id
        return OTHER_TENANTS

    def render(self) -> bytes:
        if self.multiprocess:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)


class AdmissionMetrics:
    """Admission's own series, registered on the gateway's registry (multiprocess-safe)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.decisions = Counter(
            "fairway_admission_decisions",
            "Admission outcomes by plan class.",
            ["admission_class", "outcome"],
            registry=r,
        )
        self.long_context_refusals = Counter(
            "fairway_admission_long_context_refusals",
            "Long-context asks refused (503 long_context_capacity) by model version and the "
            "budget's clause that refused them (long_context.LongContextClause: kv_full, "
            "slots_full, long_slots_full, yield_slot, yield_kv, slot_share, long_slot_share, "
            "kv_share).",
            ["model", "clause"],
            registry=r,
        )
        self.long_context_holds = Counter(
            "fairway_admission_long_context_holds",
            "Long-context refusals the hold considered (long_context_hold_s), by outcome: "
            "admitted or refused after a hold, past_bound or over_cap (not held), client_gone, "
            "draining, other (a later ask ended another way).",
            ["outcome"],
            registry=r,
        )
        self.long_context_held = Histogram(
            "fairway_admission_long_context_held_seconds",
            "How long a held long-context request was held before its answer, by outcome.",
            ["outcome"],
            buckets=HOLD_BUCKETS,
            registry=r,
        )
        self.long_context_holding = Gauge(
            "fairway_admission_long_context_held_requests",
            "Long-context requests this gateway holds now.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.redis_up_gauge = Gauge(
            "fairway_admission_limits_store_up",
            "1 while the limits store (Redis) answers; 0: rates fail open, KV fails closed.",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.fail_open_total = Counter(
            "fairway_admission_fail_open",
            "Requests over a requests/tokens limit let through while Redis was unreachable.",
            ["layer"],
            registry=r,
        )
        self.fail_closed_total = Counter(
            "fairway_admission_fail_closed",
            "KV·seconds decisions taken on the conservative local cap (Redis unreachable).",
            ["result"],
            registry=r,
        )
        self.store_errors = Counter(
            "fairway_admission_store_errors",
            "Limits-store calls that failed and sent admission to its local fallback, by "
            "kind: unreachable, timeout, or the error a reachable store answered (oom, "
            "loading, busy, misconf, readonly, masterdown, noreplicas).",
            ["kind"],
            registry=r,
        )
        self.reclaimed = Counter(
            "fairway_admission_leases_reclaimed",
            "Unrenewed in-flight leases (a dead gateway's) reclaimed.",
            registry=r,
        )
        self.lost = Counter(
            "fairway_admission_leases_lost",
            "This gateway's leases found reclaimed at renewal (it was cut off > lease TTL).",
            registry=r,
        )
        self.inflight_leases = Gauge(
            "fairway_admission_inflight_leases",
            "Leases held by this gateway.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.tpot_est = Gauge(
            "fairway_admission_tpot_estimate_seconds",
            "TPOT estimate used in est_kv (fleet p95 clamped to [target, 4 x target]), per model "
            "version.",
            ["model"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.early = Counter(
            "fairway_admission_early_dispatch",
            "Upstream requests sent before their quota answer, by what became of them: kept, "
            "cancelled (refused, or no answer), rerouted (the answer changed the class).",
            ["outcome"],
            registry=r,
        )
        self.redis_up_gauge.set(1)

    # The LimiterStats protocol of gateway/admission/quota.py:
    def redis_up(self, up: bool) -> None:
        self.redis_up_gauge.set(1 if up else 0)

    def fail_open(self, layer: str) -> None:
        self.fail_open_total.labels(layer).inc()

    def fail_closed(self, admitted: bool) -> None:
        self.fail_closed_total.labels("admitted" if admitted else "refused").inc()

    def leases_reclaimed(self, n: int) -> None:
        self.reclaimed.inc(n)

    def leases_lost(self, n: int) -> None:
        self.lost.inc(n)

    def store_error(self, kind: str) -> None:
        self.store_errors.labels(kind).inc()

    # The HoldStats protocol of gateway/admission/hold.py:
    def hold_ended(self, outcome: str, held_s: float | None) -> None:
        self.long_context_holds.labels(outcome).inc()
        if held_s is not None:
            self.long_context_held.labels(outcome).observe(held_s)

    def holding(self, delta: int) -> None:
        self.long_context_holding.inc(delta)
