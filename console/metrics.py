"""Live numbers scraped server-side from Prometheus endpoints: each replica's vLLM
``/metrics`` and the gateway's ``/metrics``.

Scrapes run concurrently with a short timeout each, so one slow or dead replica costs the
page at most one timeout, and a failed scrape is shown as such rather than as zeros.
Gateway counters are cumulative since that gateway process started; the "last minutes" view
is the difference from an earlier sample this console kept (Django's cache), so it needs two
page loads at least a few seconds apart before it says anything.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx
from asgiref.sync import async_to_sync
from django.conf import settings
from django.core.cache import cache
from prometheus_client.parser import text_string_to_metric_families

# vLLM's metric names (the emulator exposes the same).
KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
WINDOW_S = 5 * 60  # the admission panel's "last minutes"
SAMPLE_KEY = "console:gateway-samples"


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass(slots=True)
class Scrape:
    url: str
    ok: bool
    error: str = ""
    samples: list[Sample] = field(default_factory=list)
    healthy: bool | None = None

    def first(self, name: str) -> float | None:
        for sample in self.samples:
            if sample.name == name:
                return sample.value
        return None


def parse(text: str) -> list[Sample]:
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


async def _scrape(
    client: httpx.AsyncClient, base_url: str, health: bool, headers: dict[str, str]
) -> Scrape:
    url = base_url.rstrip("/")
    metrics_url = url if url.endswith("/metrics") else f"{url}/metrics"
    try:
        if health:
            metrics, probe = await asyncio.gather(
                client.get(metrics_url, headers=headers),
                client.get(f"{url}/health"),
                return_exceptions=True,
            )
        else:
            metrics, probe = await client.get(metrics_url, headers=headers), None
        if isinstance(metrics, BaseException):
            raise metrics
        metrics.raise_for_status()
        scrape = Scrape(url=metrics_url, ok=True, samples=parse(metrics.text))
        if health:
            scrape.healthy = isinstance(probe, httpx.Response) and probe.status_code == 200
        return scrape
    except (httpx.HTTPError, ValueError) as exc:
        reason = type(exc).__name__ if not str(exc) else f"{type(exc).__name__}: {exc}"
        return Scrape(url=metrics_url, ok=False, error=reason[:200], healthy=False)


async def _scrape_all(
    urls: list[str], health: bool, timeout_s: float, headers: dict[str, str]
) -> list[Scrape]:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=False) as client:
        return list(await asyncio.gather(*(_scrape(client, u, health, headers) for u in urls)))


def scrape_many(urls: Iterable[str], *, health: bool = False, token: str = "") -> list[Scrape]:
    """Scrape every URL concurrently; results in the same order. ``token``: sent as a
    bearer token (the gateway's /metrics asks for one)."""
    urls = list(urls)
    if not urls:
        return []
    headers = {"authorization": f"Bearer {token}"} if token else {}
    timeout_s = float(settings.FAIRWAY_SCRAPE_TIMEOUT_S)
    return async_to_sync(_scrape_all)(urls, health, timeout_s, headers)


def _gateway_scrapes() -> list[Scrape]:
    return scrape_many(
        settings.FAIRWAY_GATEWAY_METRICS_URLS, token=settings.FAIRWAY_GATEWAY_METRICS_TOKEN
    )


# -- the gateway ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admission:
    """Counts since the gateway started and, when an earlier sample exists, over the last
    ``window_s`` seconds."""

    totals: dict[str, float]
    recent: dict[str, float] | None
    window_s: int | None
    scrapes: list[Scrape]

    @property
    def reachable(self) -> bool:
        return any(s.ok for s in self.scrapes)


def _admission_counts(scrapes: list[Scrape]) -> dict[str, float]:
    counts: dict[str, float] = defaultdict(float)
    for scrape in scrapes:
        for s in scrape.samples:
            if s.name == "fairway_admission_decisions_total":
                outcome = s.labels.get("outcome", "")
                if outcome == "admitted":
                    counts["admitted"] += s.value
                elif outcome.startswith("rate_limited_"):
                    counts[f"429 {outcome.removeprefix('rate_limited_')}"] += s.value
            elif s.name == "fairway_gateway_rejections_total":
                status, code = s.labels.get("status", ""), s.labels.get("code", "")
                if status == "503":
                    counts[f"503 {code}"] += s.value
                elif status == "429":
                    counts["429 total"] += s.value
    return dict(counts)


def gateway_admission(now: float | None = None) -> Admission:
    at = time.time() if now is None else now
    scrapes = _gateway_scrapes()
    totals = _admission_counts(scrapes)
    recent: dict[str, float] | None = None
    window: int | None = None
    if any(s.ok for s in scrapes):
        samples: list[tuple[float, dict[str, float]]] = cache.get(SAMPLE_KEY, [])
        samples = [(t, c) for t, c in samples if at - t <= WINDOW_S]
        older = [(t, c) for t, c in samples if at - t >= 5]
        if older:
            t0, base = older[0]
            if all(totals.get(k, 0) >= v for k, v in base.items()):  # no gateway restart
                recent = {k: v - base.get(k, 0) for k, v in totals.items()}
                window = int(at - t0)
        samples.append((at, totals))
        cache.set(SAMPLE_KEY, samples[-60:], WINDOW_S * 2)
    return Admission(totals=totals, recent=recent, window_s=window, scrapes=scrapes)


@dataclass(frozen=True, slots=True)
class Pipeline:
    """The usage consumer(s): lag per partition, events written and dead letters by reason
    (counters since each consumer process started)."""

    lag: dict[str, float]  # "topic/partition" -> messages not read yet
    events: dict[str, float]  # outcome -> count
    dead_letters: dict[str, float]  # reason -> count
    scrapes: list[Scrape]

    @property
    def reachable(self) -> bool:
        return any(s.ok for s in self.scrapes)

    @property
    def total_lag(self) -> float:
        return sum(self.lag.values())


def usage_pipeline() -> Pipeline:
    scrapes = scrape_many(settings.FAIRWAY_INGEST_METRICS_URLS)
    lag: dict[str, float] = defaultdict(float)
    events: dict[str, float] = defaultdict(float)
    dead: dict[str, float] = defaultdict(float)
    for scrape in scrapes:
        for s in scrape.samples:
            if s.name == "fairway_ingest_consumer_lag":
                lag[f"{s.labels.get('topic', '?')}/{s.labels.get('partition', '?')}"] += s.value
            elif s.name == "fairway_ingest_events_total":
                events[s.labels.get("outcome", "?")] += s.value
            elif s.name == "fairway_ingest_dead_letters_total":
                dead[s.labels.get("reason", "?")] += s.value
    return Pipeline(dict(lag), dict(events), dict(dead), scrapes)


def tenant_status_counts(tenant_id: str) -> dict[str, float] | None:
    """The tenant's requests by final status from the gateway's ``fairway_gateway_requests``
    counter (since the gateway started); None when no gateway answered."""
    scrapes = _gateway_scrapes()
    if not any(s.ok for s in scrapes):
        return None
    counts: dict[str, float] = defaultdict(float)
    for scrape in scrapes:
        for s in scrape.samples:
            if s.name == "fairway_gateway_requests_total" and s.labels.get("tenant") == tenant_id:
                counts[s.labels.get("status", "?")] += s.value
    return dict(counts)
