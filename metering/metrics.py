"""Prometheus metrics of the usage consumer (the worker serves them when
FAIRWAY_INGEST_METRICS_PORT is set; see metering.bootsteps)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LAG = Gauge(
    "fairway_ingest_consumer_lag",
    "Messages in the partition not yet read by this consumer (high watermark - position).",
    ["topic", "partition"],
)
EVENTS = Counter(
    "fairway_ingest_events_total",
    "Usage events written: ingested (new) or duplicate (already counted, skipped).",
    ["outcome"],
)
DEAD_LETTERS = Counter(
    "fairway_ingest_dead_letters_total", "Messages refused into usage_dead_letter.", ["reason"]
)
BATCH_SECONDS = Histogram(
    "fairway_ingest_batch_seconds",
    "Time to check and write one batch (one PostgreSQL transaction).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
BATCH_FAILURES = Counter(
    "fairway_ingest_batch_failures_total", "Batches rolled back and re-read (database errors)."
)
COMMIT_FAILURES = Counter(
    "fairway_ingest_offset_commit_failures_total",
    "Offset commits that failed after the batch was stored (retried; if never, re-read).",
)
