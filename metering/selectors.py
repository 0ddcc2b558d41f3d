"""Reads of the hourly usage rollup for the customer-facing usage and costs reports.

Every query is scoped to one tenant first; filters (API keys, models) only narrow that set,
so naming another tenant's key id finds nothing rather than anything of theirs. Buckets are
summed in the database (one GROUP BY per page); costs price the summed tokens per model
version and price in force (``catalog.ModelPrice`` of each hour) with
``billing.pricing.token_cost``. That function is linear and exact, so pricing a
day's sum equals summing the hourly rows' prices to the last digit.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, Inexact, localcontext
from typing import Any, Generic, TypeVar
from uuid import UUID

from django.db.models import Q, QuerySet, Sum
from django.db.models.functions import TruncDay, TruncHour

from billing.pricing import token_cost
from catalog.models import ModelPrice, ModelVersion
from catalog.selectors import PriceBook
from metering.models import Usage
from metering.pages import DAY, PageWindow
from tenants.models import Role, Tenant

# Who may read what. Usage is operational data every member needs; money is for the people
# who manage or pay the account. Staff pass every check.
USAGE_READERS = (Role.OWNER, Role.ADMIN, Role.BILLING, Role.MEMBER)
COST_READERS = (Role.OWNER, Role.ADMIN, Role.BILLING)

USAGE_GROUPS = ("model", "api_key_id")
COST_GROUPS = ("line_item", "model", "api_key_id")
# A line item per token type and model version: "<version>, input" and so on.
LINE_INPUT, LINE_CACHED, LINE_OUTPUT = "input", "cached input", "output"


@dataclass(frozen=True, slots=True)
class UsageResult:
    num_model_requests: int
    input_tokens: int  # including cached
    input_cached_tokens: int
    output_tokens: int
    model: str | None
    api_key_id: UUID | None


@dataclass(frozen=True, slots=True)
class CostResult:
    amount: Decimal  # exact, never rounded
    currency: str
    line_item: str | None
    quantity: int | None  # tokens, when grouped by line item
    model: str | None
    api_key_id: UUID | None


R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Bucket(Generic[R]):
    start_time: int
    end_time: int
    results: list[R]


def _dt(t: int) -> datetime:
    return datetime.fromtimestamp(t, tz=UTC)


def _ts(value: datetime) -> int:
    return int(value.timestamp())


def _rows(
    *,
    tenant: Tenant,
    window: PageWindow,
    api_key_ids: Sequence[UUID] | None,
    models: Sequence[str] | None,
) -> QuerySet[Usage]:
    rows = Usage.objects.filter(
        tenant=tenant, hour__gte=_dt(window.start), hour__lt=_dt(window.end)
    )
    if api_key_ids is not None:
        rows = rows.filter(api_key_id__in=api_key_ids)
    if models is not None:
        # A version name, or a family alias meaning all of its versions.
        rows = rows.filter(
            Q(model_version__name__in=models) | Q(model_version__family__name__in=models)
        )
    trunc = TruncDay if window.width == DAY else TruncHour
    return rows.annotate(bucket=trunc("hour", tzinfo=UTC))


def _buckets(window: PageWindow, by_start: dict[int, list[R]]) -> list[Bucket[R]]:
    """Every bucket of the page in order, empty ones included."""
    return [
        Bucket(start_time=t, end_time=t + window.width, results=by_start.get(t, []))
        for t in window.bucket_starts
    ]


def usage_buckets(
    *,
    tenant: Tenant,
    window: PageWindow,
    group_by: Collection[str] = (),
    api_key_ids: Sequence[UUID] | None = None,
    models: Sequence[str] | None = None,
) -> list[Bucket[UsageResult]]:
    by_model, by_key = "model" in group_by, "api_key_id" in group_by
    keys = ["bucket"]
    if by_model:
        keys.append("model_version__name")
    if by_key:
        keys.append("api_key_id")
    rows = (
        _rows(tenant=tenant, window=window, api_key_ids=api_key_ids, models=models)
        .values(*keys)
        .annotate(
            requests_sum=Sum("requests"),
            prompt_sum=Sum("prompt_tokens"),
            cached_sum=Sum("cached_tokens"),
            completion_sum=Sum("completion_tokens"),
        )
        .order_by(*keys)
    )
    by_start: dict[int, list[UsageResult]] = {}
    for row in rows:
        by_start.setdefault(_ts(row["bucket"]), []).append(
            UsageResult(
                num_model_requests=row["requests_sum"],
                input_tokens=row["prompt_sum"],
                input_cached_tokens=row["cached_sum"],
                output_tokens=row["completion_sum"],
                model=row["model_version__name"] if by_model else None,
                api_key_id=row["api_key_id"] if by_key else None,
            )
        )
    return _buckets(window, by_start)


@contextmanager
def _exact() -> Iterator[None]:
    """Decimal arithmetic that would raise rather than round (it never needs to)."""
    with localcontext() as ctx:
        ctx.prec = 60
        ctx.traps[Inexact] = True
        yield


def cost_buckets(
    *,
    tenant: Tenant,
    window: PageWindow,
    group_by: Collection[str] = (),
    api_key_ids: Sequence[UUID] | None = None,
    models: Sequence[str] | None = None,
    line_items: Collection[str] | None = None,
) -> list[Bucket[CostResult]]:
    """Exact costs per bucket, each hour at the version's price in force at that hour.

    Results are also kept apart per currency, so amounts in different currencies are never
    added together (every version is priced in usd today, giving one result per group).
    """
    by_line, by_model, by_key = (g in group_by for g in ("line_item", "model", "api_key_id"))
    keys = ["bucket", "model_version_id"] + (["api_key_id"] if by_key else [])
    # Each hour is priced at the version's price in force at that hour: one query per
    # price window (the hours in which no price changes), so a bucket spanning a change
    # sums each side at its own price.
    book = PriceBook(start=_dt(window.start), end=_dt(window.end))
    rows: list[tuple[dict[str, Any], ModelPrice | None]] = []
    for lo, hi in book.windows():
        sums = (
            _rows(tenant=tenant, window=window, api_key_ids=api_key_ids, models=models)
            .filter(hour__gte=lo, hour__lt=hi)
            .values(*keys)
            .annotate(
                prompt_sum=Sum("prompt_tokens"),
                cached_sum=Sum("cached_tokens"),
                completion_sum=Sum("completion_tokens"),
            )
            .order_by(*keys)
        )
        rows.extend((row, book.at(row["model_version_id"], lo)) for row in sums)
    versions = ModelVersion.objects.in_bulk({row["model_version_id"] for row, _ in rows})
    # (bucket, currency, line item, model, key) -> [amount, tokens]
    totals: dict[tuple[int, str, str | None, str | None, UUID | None], list[Any]] = {}
    with _exact():
        for row, in_force in rows:
            version = versions[row["model_version_id"]]
            if in_force is None:  # usage before the version's first price: never written so
                raise ValueError(f"{version.name} has usage before its first price")
            lines = (
                (
                    LINE_INPUT,
                    row["prompt_sum"] - row["cached_sum"],
                    in_force.price_prompt_per_mtok,
                ),
                (LINE_CACHED, row["cached_sum"], in_force.price_cached_prompt_per_mtok),
                (LINE_OUTPUT, row["completion_sum"], in_force.price_completion_per_mtok),
            )
            for kind, tokens, price in lines:
                line_item = f"{version.name}, {kind}"
                if line_items is not None and line_item not in line_items:
                    continue
                if by_line and tokens == 0:
                    continue  # no zero-token line items; an ungrouped bucket still shows 0
                key = (
                    _ts(row["bucket"]),
                    in_force.currency.lower(),
                    line_item if by_line else None,
                    version.name if by_model else None,
                    row["api_key_id"] if by_key else None,
                )
                total = totals.setdefault(key, [Decimal(0), 0])
                total[0] += token_cost(tokens, price)
                total[1] += tokens
    by_start: dict[int, list[CostResult]] = {}
    for key in sorted(totals, key=_sort_key):
        start, currency, item, model, api_key_id = key
        amount, tokens = totals[key]
        by_start.setdefault(start, []).append(
            CostResult(
                amount=amount,
                currency=currency,
                line_item=item,
                quantity=tokens if by_line else None,
                model=model,
                api_key_id=api_key_id,
            )
        )
    return _buckets(window, by_start)


def _sort_key(key: tuple[int, str, str | None, str | None, UUID | None]) -> tuple[Any, ...]:
    start, currency, line_item, model, api_key_id = key
    return (start, currency, line_item or "", model or "", str(api_key_id or ""))
