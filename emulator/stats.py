"""Engine-side statistics in model time: plain counters and fixed-bucket histograms.

Kept free of prometheus_client so the engine stays cheap to import and to run inside a
discrete-event simulation; ``emulator.metrics`` renders these for ``/metrics``.
Bucket bounds are vLLM's (``v1/metrics/buckets.py`` / ``loggers.py``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

FINISH_REASONS = ("stop", "length", "abort", "error")


class Histogram:
    """Prometheus-style histogram: ``counts[i]`` holds observations with ``v <= bounds[i]``
    (and not in an earlier bucket); the last slot is +Inf."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs ending with +Inf, as the exposition wants."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append((repr(float(bound)), running))
        out.append(("+Inf", running + self.counts[-1]))
        return out

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (coarse; for reports only)."""
        if self.count == 0:
            return 0.0
        target = q * self.count
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            if running >= target:
                return bound
        return float("inf")


class EngineStats:
    """Monotonic counters and histograms, all in model time. Read them; never reset them."""

    __slots__ = (
        "prompt_tokens",
        "generation_tokens",
        "prefill_tokens_computed",
        "recomputed_tokens",
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "request_success",
        "num_steps",
        "busy_time",
        "ttft",
        "itl",
        "e2e",
        "queue_time",
        "tpot",
    )

    def __init__(self) -> None:
        self.prompt_tokens = 0  # prompt length of each request, counted at its first token
        self.generation_tokens = 0
        self.prefill_tokens_computed = 0  # all prefill work, recompute included
        self.recomputed_tokens = 0  # prefill work redone because of preemption
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.request_success: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.num_steps = 0
        self.busy_time = 0.0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)  # per request: decode time / (tokens - 1)
