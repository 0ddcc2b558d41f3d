"""Reads behind the console's pages. Usage and money come from ``metering.selectors`` (the
same functions the usage and costs API call), so every number equals the API's."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID

from django.db import DatabaseError, connection, transaction

from catalog.models import ModelVersion
from metering import selectors as metering
from metering.pages import DAY, PageWindow, ceil_to, floor_to
from tenants.limits import EffectiveLimit
from tenants.models import ApiKey, Tenant

MAX_HOURLY_DAYS = 31
MAX_DAILY_DAYS = 366


def window(start: date, end: date, width: int) -> PageWindow:
    """All buckets of the UTC days ``start``..``end`` (inclusive) in one page."""
    t0 = int(datetime(start.year, start.month, start.day, tzinfo=UTC).timestamp())
    t1 = int(datetime(end.year, end.month, end.day, tzinfo=UTC).timestamp()) + DAY
    start_t, end_t = floor_to(t0, width), ceil_to(t1, width)
    return PageWindow(start=start_t, end=end_t, width=width, has_more=False, next_page=None)


@dataclass(frozen=True, slots=True)
class Totals:
    requests: int = 0
    prompt: int = 0
    cached: int = 0
    completion: int = 0

    @property
    def uncached(self) -> int:
        return self.prompt - self.cached

    def __add__(self, other: Totals) -> Totals:
        return Totals(
            self.requests + other.requests,
            self.prompt + other.prompt,
            self.cached + other.cached,
            self.completion + other.completion,
        )


def _totals(result: metering.UsageResult) -> Totals:
    return Totals(
        result.num_model_requests,
        result.input_tokens,
        result.input_cached_tokens,
        result.output_tokens,
    )


def month_start(now: datetime) -> date:
    return date(now.year, now.month, 1)


def usage_totals(*, tenant: Tenant, start: date, end: date) -> Totals:
    total = Totals()
    for bucket in metering.usage_buckets(tenant=tenant, window=window(start, end, DAY)):
        for result in bucket.results:
            total += _totals(result)
    return total


def spend(*, tenant: Tenant, start: date, end: date) -> dict[str, Decimal]:
    """Exact spend per currency at catalog prices (unrounded, as the costs API)."""
    out: dict[str, Decimal] = {}
    for bucket in metering.cost_buckets(tenant=tenant, window=window(start, end, DAY)):
        for result in bucket.results:
            out[result.currency] = out.get(result.currency, Decimal(0)) + result.amount
    return out


@dataclass(frozen=True, slots=True)
class Series:
    labels: list[int]  # bucket starts, Unix seconds
    uncached: list[int]
    cached: list[int]
    completion: list[int]
    requests: list[int]


def usage_series(
    *,
    tenant: Tenant,
    win: PageWindow,
    models: list[str] | None,
    api_key_ids: list[UUID] | None,
) -> Series:
    buckets = metering.usage_buckets(
        tenant=tenant, window=win, models=models, api_key_ids=api_key_ids
    )
    series = Series([], [], [], [], [])
    for bucket in buckets:
        total = Totals()
        for result in bucket.results:
            total += _totals(result)
        series.labels.append(bucket.start_time)
        series.uncached.append(total.uncached)
        series.cached.append(total.cached)
        series.completion.append(total.completion)
        series.requests.append(total.requests)
    return series


def usage_breakdown(
    *,
    tenant: Tenant,
    win: PageWindow,
    group: str,
    models: list[str] | None,
    api_key_ids: list[UUID] | None,
) -> list[tuple[str, Totals]]:
    """Totals over the window per model version (``group="model"``) or per key."""
    sums: dict[str, Totals] = {}
    for bucket in metering.usage_buckets(
        tenant=tenant, window=win, group_by=[group], models=models, api_key_ids=api_key_ids
    ):
        for result in bucket.results:
            name = str(result.model if group == "model" else result.api_key_id)
            sums[name] = sums.get(name, Totals()) + _totals(result)
    return sorted(sums.items(), key=lambda item: -(item[1].prompt + item[1].completion))


def callable_models(*, limits: Iterable[EffectiveLimit]) -> list[str]:
    """Of the families a tenant's limits grant (its plan's rows and its overrides), those the
    gateway can serve now, by name: a family resolves to its current version, so one
    without an active current version answers "model not found"."""
    granted = {limit.family for limit in limits}
    served = ModelVersion.objects.filter(
        family__name__in=granted, is_current=True, is_active=True
    ).values_list("family__name", flat=True)
    return sorted(set(served))


def key_names(*, tenant: Tenant) -> dict[str, str]:
    return {
        str(k.id): f"{k.name} ({k.prefix}…)"
        for k in ApiKey.objects.filter(tenant=tenant).only("id", "name", "prefix")
    }


def dead_letters_since(*, since: datetime) -> dict[str, int]:
    """Usage events refused into the dead-letter table since ``since``, by reason (the
    durable record; the consumer's counter restarts with the process)."""
    from django.db.models import Count

    from metering.models import DeadLetter

    rows = (
        DeadLetter.objects.filter(received_at__gte=since)
        .values("reason")
        .annotate(n=Count("pk"))
        .order_by("reason")
    )
    return {row["reason"]: int(row["n"]) for row in rows}


@dataclass(frozen=True, slots=True)
class Latency:
    requests: int
    ttft_p95_ms: float | None
    tpot_p95_ms: float | None
    since: datetime


LATENCY_SQL = """
SELECT count(*),
       percentile_cont(0.95) WITHIN GROUP (ORDER BY ttft_ms),
       percentile_cont(0.95) WITHIN GROUP (ORDER BY tpot_ms)
FROM request_log
WHERE tenant_id = %s AND started_at >= %s AND status = 200
"""


def recent_latency(*, tenant: Tenant, now: datetime, hours: int = 1) -> Latency | None:
    """p95 TTFT and TPOT of the tenant's successful requests in the request log over the
    last ``hours``; None when the log has no such request (or no table, off PostgreSQL)."""
    since = now - timedelta(hours=hours)
    if connection.vendor != "postgresql":
        return None
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(LATENCY_SQL, [str(tenant.id), since])
            row: Any = cursor.fetchone()
    except DatabaseError:
        return None
    if not row or not row[0]:
        return None
    return Latency(requests=int(row[0]), ttft_p95_ms=row[1], tpot_p95_ms=row[2], since=since)
