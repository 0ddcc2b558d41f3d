"""What the gateway knows about each replica: health, KV occupancy, queue, decode speed.

Every ~250 ms (docs/design.md §5 decision 3) the registry scrapes each replica's ``/metrics`` for
the gauges ``vllm:kv_cache_usage_perc``, ``vllm:num_requests_running``,
``vllm:num_requests_waiting`` and the ``vllm:inter_token_latency_seconds`` histogram. It keeps
the latest gauges and a ~60 s ring of cumulative ITL bucket snapshots per replica, from which
``tpot_p95`` computes a fleet-wide p95 over a window (R1 feeds admission with it).

A replica leaves the routing set on a connection error (scrape or upstream) or after
``scrape_failures_unhealthy`` consecutive failed scrapes, and returns on the next good one.

Only four series are needed out of a few hundred lines, so a line filter is used instead
of ``prometheus_client``'s full parser: at 4 Hz × replicas × workers that matters. Measured
by ``python -m bench.prom_parse`` on the emulator's vLLM page (175 lines, 15 kB; a shared
2-core box): 70-80 µs per page here, 2,700-3,300 µs with the full parser (39-45×), i.e.
8-10 % of a core more per worker at 8 replicas and 45-57 % at 44. The one hand-written
Prometheus parser left (bench/ and tests/ use ``prometheus_client``'s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx

from contracts import schema
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.replicas")

KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
ITL_BUCKET = "vllm:inter_token_latency_seconds_bucket"
RING_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Scrape:
    kv_usage: float
    running: int
    waiting: int
    itl_bounds: tuple[float, ...]  # ascending "le" values, +Inf last
    itl_counts: tuple[float, ...]  # cumulative counts aligned with itl_bounds

    @classmethod
    def of(
        cls, kv: list[float], running: float, waiting: float, buckets: dict[float, float]
    ) -> Scrape:
        """One replica's page, its engines summed (KV usage averaged)."""
        bounds = tuple(sorted(buckets))
        return cls(
            kv_usage=sum(kv) / len(kv) if kv else 0.0,
            running=int(running),
            waiting=int(waiting),
            itl_bounds=bounds,
            itl_counts=tuple(buckets[b] for b in bounds),
        )


def parse_metrics(text: str) -> Scrape:
    """Pick the four series out of a Prometheus text exposition (summing engines)."""
    kv: list[float] = []
    running = waiting = 0.0
    buckets: dict[float, float] = {}
    for line in text.split("\n"):
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        name_end = brace if brace >= 0 else line.find(" ")
        name = line[:name_end]
        if name not in (KV_USAGE, RUNNING, WAITING, ITL_BUCKET):
            continue
        rest_start = line.rfind("}") + 1 if brace >= 0 else name_end
        value = float(line[rest_start:].split()[0])
        if name == ITL_BUCKET:
            at = line.find('le="', brace)
            if at < 0:
                continue
            le = float(line[at + 4 : line.find('"', at + 4)])
            buckets[le] = buckets.get(le, 0.0) + value
        elif name == KV_USAGE:
            kv.append(value)
        elif name == RUNNING:
            running += value
        else:
            waiting += value
    return Scrape.of(kv, running, waiting, buckets)


def histogram_quantile(
    q: float, bounds: tuple[float, ...], counts: Iterable[float]
) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts (linear in a bucket)."""
    cum = list(counts)
    if not cum or cum[-1] <= 0:
        return None
    rank = q * cum[-1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in zip(bounds, cum, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return prev_bound  # the top finite bucket is the best bound we have
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


@dataclass(slots=True)
class ReplicaState:
    record: schema.ReplicaRecord
    version: str
    healthy: bool = False
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    scraped_at: float = 0.0  # time.monotonic() of the last good scrape; 0 = never
    failures: int = 0
    itl_bounds: tuple[float, ...] = ()
    itl_ring: deque[tuple[float, tuple[float, ...]]] = field(default_factory=deque)

    @property
    def replica_id(self) -> str:
        return self.record.replica_id


class ReplicaRegistry:
    def __init__(
        self,
        config: GatewayConfig,
        metrics: GatewayMetrics,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(config.scrape_timeout_s),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )
        self._owns_client = client is None
        self._states: dict[str, ReplicaState] = {}
        self._by_version: dict[str, list[ReplicaState]] = {}
        self._ring_len = int(RING_SECONDS / config.scrape_interval_s) + 8
        self._task: asyncio.Task[None] | None = None

    # -- catalog -----------------------------------------------------------------------
    def sync(self, catalog: schema.Catalog) -> None:
        """Follow the catalog: keep known replicas' state, add new ones, drop removed ones."""
        states: dict[str, ReplicaState] = {}
        by_version: dict[str, list[ReplicaState]] = {}
        for version in catalog.versions.values():
            for record in version.replicas:
                old = self._states.get(record.replica_id)
                if old is not None and old.record == record and old.version == version.version:
                    state = old
                else:
                    state = ReplicaState(record=record, version=version.version)
                states[record.replica_id] = state
                by_version.setdefault(version.version, []).append(state)
        for gone in self._states.keys() - states.keys():
            self._metrics.replica_healthy.labels(gone).set(0)
        self._states, self._by_version = states, by_version

    # -- queries (hot path: no I/O) ----------------------------------------------------
    def state(self, replica_id: str) -> ReplicaState | None:
        return self._states.get(replica_id)

    def states(self, version: str) -> list[ReplicaState]:
        return self._by_version.get(version, [])

    def healthy(self, version: str) -> list[ReplicaState]:
        return [s for s in self._by_version.get(version, ()) if s.healthy]

    def any_healthy(self) -> bool:
        return any(s.healthy for s in self._states.values())

    def mark_failed(self, replica_id: str, reason: str) -> None:
        """The upstream path could not connect: stop routing there until a scrape succeeds."""
        state = self._states.get(replica_id)
        if state is not None and state.healthy:
            log.warning("replica %s marked unhealthy: %s", replica_id, reason)
            state.healthy = False
            self._metrics.replica_healthy.labels(replica_id).set(0)

    def tpot_p95(self, version: str, window_s: float = 30.0) -> tuple[float | None, float]:
        """(p95 inter-token latency in seconds over the last ``window_s`` across the version's
        replicas or None without observations, age in seconds of the newest measurement).

        Per replica the delta between its newest snapshot and the newest one at least
        ``window_s`` old (or its oldest, while the ring is younger); a counter that went
        backwards means the replica restarted, and its newest counts are the delta.
        """
        now = time.monotonic()
        newest = 0.0
        merged: dict[float, float] = {}
        for state in self._by_version.get(version, ()):
            ring = state.itl_ring
            if len(ring) < 2:
                if ring:
                    newest = max(newest, ring[-1][0])
                continue
            latest_ts, latest = ring[-1]
            newest = max(newest, latest_ts)
            base = ring[0][1]
            for ts, counts in ring:
                if ts > latest_ts - window_s:
                    break
                base = counts
            if any(b > c for b, c in zip(base, latest, strict=True)):
                delta = latest
            else:
                delta = tuple(c - b for b, c in zip(base, latest, strict=True))
            for bound, count in zip(state.itl_bounds, delta, strict=True):
                merged[bound] = merged.get(bound, 0.0) + count
        age = now - newest if newest else math.inf
        if not merged:
            return None, age
        bounds = tuple(sorted(merged))
        return histogram_quantile(0.95, bounds, (merged[b] for b in bounds)), age

    # -- scraping ----------------------------------------------------------------------
    async def start(self) -> None:
        await self.scrape_all()
        self._task = asyncio.create_task(self._run(), name="replica-scraper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._owns_client:
            await self._client.aclose()

    async def _run(self) -> None:
        interval = self._config.scrape_interval_s
        while True:
            started = time.monotonic()
            try:
                await self.scrape_all()
            except Exception:  # noqa: BLE001 - never let the scraper die
                log.exception("scrape round failed")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def scrape_all(self) -> None:
        states = list(self._states.values())
        if states:
            await asyncio.gather(*(self._scrape(s) for s in states))

    async def _scrape(self, state: ReplicaState) -> None:
        rid = state.replica_id
        try:
            response = await self._client.get(state.record.base_url.rstrip("/") + "/metrics")
            response.raise_for_status()
            scrape = parse_metrics(response.text)
        except (httpx.HTTPError, ValueError, OSError) as exc:
            state.failures += 1
            self._metrics.scrape_failures.labels(rid).inc()
            refused = isinstance(exc, httpx.ConnectError | httpx.RemoteProtocolError)
            if state.healthy and (
                refused or state.failures >= self._config.scrape_failures_unhealthy
            ):
                log.warning(
                    "replica %s unhealthy after %d failed scrapes: %r", rid, state.failures, exc
                )
                state.healthy = False
                self._metrics.replica_healthy.labels(rid).set(0)
            return
        now = time.monotonic()
        state.kv_usage = scrape.kv_usage
        state.running, state.waiting = scrape.running, scrape.waiting
        state.scraped_at = now
        state.failures = 0
        self._metrics.scrapes.labels(rid).inc()
        if scrape.itl_bounds:
            if scrape.itl_bounds != state.itl_bounds:
                state.itl_bounds = scrape.itl_bounds
                state.itl_ring = deque(maxlen=self._ring_len)
            state.itl_ring.append((now, scrape.itl_counts))
        if not state.healthy:
            log.info("replica %s healthy", rid)
            state.healthy = True
            self._metrics.replica_healthy.labels(rid).set(1)
