"""``/metrics`` with vLLM's names and labels, rendered by prometheus_client per server.

A custom collector reads the engine's counters at scrape time (nothing is updated per token
on this side), registered in a per-server ``CollectorRegistry``. Counters are declared
without ``_total``; the exposition appends it (``vllm:num_preemptions_total``), as vLLM's
prometheus_client does. All times are model seconds.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from emulator.driver import EngineDriver
from emulator.engine import Engine
from emulator.stats import Histogram

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
LABELS = ["model_name", "engine"]


class EngineCollector(Collector):
    def __init__(self, engine: Engine, model_name: str, driver: EngineDriver | None = None):
        self.engine = engine
        self.driver = driver
        self.labels = [model_name, "0"]
        profile = engine.profile
        # vLLM sets cache_config_info once after init, every CacheConfig field as a string.
        self.cache_config_labels = {
            "block_size": str(engine.block_size),
            "num_gpu_blocks": str(engine.num_gpu_blocks),
            "num_cpu_blocks": "0",
            "gpu_memory_utilization": str(profile.gpu_memory_utilization),
            "enable_prefix_caching": str(engine.enable_prefix_caching),
            "prefix_caching_hash_algo": "sha256",
            "cache_dtype": "auto",
            "swap_space": "4.0",
            "is_attention_free": "False",
            "sliding_window": "None",
            "calculate_kv_scales": "False",
            "engine": "0",
        }

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def _histogram(self, name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self.labels, hist.cumulative(), sum_value=hist.sum)
        return family

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        stats = engine.stats
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            engine.num_running,
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            engine.num_waiting,
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            engine.kv_usage(),
        )
        yield self._counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            stats.num_preemptions,
        )
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits,
        )
        yield self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens
        )
        yield self._counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            stats.generation_tokens,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*LABELS, "finished_reason"],
        )
        for reason, count in stats.request_success.items():
            success.add_metric([*self.labels, reason], count)
        yield success
        yield self._histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            stats.ttft,
        )
        yield self._histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            stats.itl,
        )
        yield self._histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            stats.tpot,
        )
        yield self._histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            stats.e2e,
        )
        yield self._histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            stats.queue_time,
        )
        cache_info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(self.cache_config_labels),
        )
        cache_info.add_metric(list(self.cache_config_labels.values()), 1.0)
        yield cache_info
        # Emulator-only extras (no vllm: prefix), for benches and tests.
        yield self._gauge(
            "emulator_model_time_seconds", "Engine model clock (seconds).", engine.now
        )
        yield self._gauge(
            "emulator_kv_blocks_used",
            "KV blocks referenced by live requests.",
            engine.pool.num_used,
        )
        yield self._counter(
            "emulator_recomputed_tokens",
            "Prefill tokens computed again after preemption.",
            stats.recomputed_tokens,
        )
        if self.driver is not None:
            yield self._counter(
                "emulator_clock_resyncs",
                "Times the engine fell behind the wall clock and skipped ahead.",
                self.driver.clock_resyncs,
            )
            yield self._counter(
                "emulator_clock_lag_seconds",
                "Model seconds skipped to catch up with the wall clock (CPU-bound replica).",
                self.driver.clock_lag_model_seconds,
            )


class MetricsRenderer:
    """One registry per server so several emulators can share a process (tests)."""

    def __init__(self, engine: Engine, model_name: str, driver: EngineDriver | None = None):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine, model_name, driver))

    def render(self) -> bytes:
        return generate_latest(self.registry)
