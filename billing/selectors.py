"""Reads for billing: what ``usage`` says a period costs, what was invoiced for it, and
invoice queries scoped to what the caller may see.

A line is computed from exact Decimals and rounded once (``billing.pricing.round_line``).
Token types: uncached prompt tokens (prompt - cached) at the prompt price, cached prompt
tokens at the cached price, completion tokens at the completion price. Each hour of usage
is priced at the version's ``catalog.ModelPrice`` in force at that hour, so a month with a
price change has one line per version, token type and price.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.core.exceptions import ValidationError
from django.db.models import Q, QuerySet, Sum
from django.db.models.functions import TruncMonth
from django.http import Http404

from billing.models import (
    Invoice,
    InvoiceLine,
    InvoiceStatus,
    LineKind,
    StripeOutbox,
    TokenType,
)
from billing.periods import next_month, period_label
from billing.pricing import round_line, token_cost
from catalog.models import ModelPrice, ModelVersion
from catalog.selectors import PriceBook, price_periods
from metering.models import Usage
from tenants.models import Tenant

TOKEN_TYPES: tuple[str, ...] = ("prompt", "cached_prompt", "completion")  # TokenType order
# Invoices whose lines count as billed: a void invoice was cancelled, a draft is not final.
BILLED = (InvoiceStatus.FINALIZED, InvoiceStatus.PAID)

Key = tuple[int, str]  # (model_version_id, token type)
PricedKey = tuple[int, str, Decimal]  # (model_version_id, token type, price per Mtok)
DESCRIPTION_MAX = 200  # InvoiceLine.description


def _fit(text: str) -> str:
    return text if len(text) <= DESCRIPTION_MAX else text[: DESCRIPTION_MAX - 1] + "…"


@dataclass(frozen=True, slots=True)
class LineSpec:
    """A line as the invoice should hold it (compared with what it holds on refresh)."""

    kind: str
    description: str
    amount_exact: Decimal
    amount: Decimal
    model_version_id: int | None = None
    token_type: str = ""
    tokens: int = 0
    unit_price_per_mtok: Decimal = Decimal(0)
    adjusts_period_start: datetime | None = None

    def fingerprint(self) -> tuple[Any, ...]:
        return (
            self.kind,
            self.model_version_id,
            self.token_type,
            self.tokens,
            self.unit_price_per_mtok.normalize(),
            self.amount.normalize(),
            self.adjusts_period_start,
            self.description,
        )


def price_of(price: ModelPrice, token_type: str) -> Decimal:
    if token_type == TokenType.PROMPT:
        return price.price_prompt_per_mtok
    if token_type == TokenType.CACHED:
        return price.price_cached_prompt_per_mtok
    return price.price_completion_per_mtok


def priced_tokens(
    rows: QuerySet[Any],
    *,
    at: str,
    start: datetime,
    end: datetime,
    currency: str | None = None,
) -> dict[PricedKey, int]:
    """Tokens per (version, token type, price) of ``rows`` (usage or request_log rows) in
    [start, end), each row priced at its version's price in force at its time ``at`` (a
    field name). With ``currency``, a price in another currency is refused."""
    book = PriceBook(start=start, end=end)
    out: dict[PricedKey, int] = defaultdict(int)
    for lo, hi in book.windows():
        grouped = (
            rows.filter(**{f"{at}__gte": lo, f"{at}__lt": hi})
            .values("model_version_id")
            .annotate(p=Sum("prompt_tokens"), c=Sum("cached_tokens"), o=Sum("completion_tokens"))
            .order_by("model_version_id")
        )
        for row in grouped:
            version_id = int(row["model_version_id"])
            price = book.at(version_id, lo)
            if price is None:
                name = ModelVersion.objects.filter(pk=version_id).values_list("name", flat=True)
                raise ValidationError(
                    f"{name.first() or version_id} has usage before its first price."
                )
            if currency is not None and price.currency.lower() != currency.lower():
                raise ValidationError(
                    f"{price.version.name} is priced in {price.currency}; "
                    f"the tenant's invoices are in {currency}."
                )
            p, c, o = int(row["p"] or 0), int(row["c"] or 0), int(row["o"] or 0)
            for token_type, tokens in zip(TOKEN_TYPES, (p - c, c, o), strict=True):
                if tokens:
                    out[(version_id, token_type, price_of(price, token_type))] += tokens
    return dict(out)


def priced_usage(
    *, tenant_id: Any, start: datetime, end: datetime, currency: str | None = None
) -> dict[PricedKey, int]:
    """Billable tokens per (version, token type, price in force at the usage's hour) in
    ``usage`` for [start, end)."""
    rows = Usage.objects.filter(tenant_id=tenant_id)
    return priced_tokens(rows, at="hour", start=start, end=end, currency=currency)


def _versions(ids: Iterable[int]) -> dict[int, ModelVersion]:
    return {v.pk: v for v in ModelVersion.objects.filter(pk__in=set(ids))}


@dataclass(frozen=True, slots=True)
class _Span:
    start: datetime
    end: datetime
    price: Decimal


class PriceCalendar:
    """When each (version, token type) price was in force during one month, so that a line
    can say its price period when the month had more than one price for it."""

    def __init__(self, *, version_ids: Iterable[int], start: datetime) -> None:
        self._spans: dict[Key, list[_Span]] = {}
        self._start = start
        periods = price_periods(version_ids=version_ids, start=start, end=next_month(start))
        for version_id, rows in periods.items():
            for token_type in TOKEN_TYPES:
                spans = self._spans.setdefault((version_id, token_type), [])
                for period in rows:
                    price = price_of(period.price, token_type)
                    if spans and spans[-1].price == price and spans[-1].end == period.start:
                        spans[-1] = _Span(spans[-1].start, period.end, price)
                    else:
                        spans.append(_Span(period.start, period.end, price))

    def first_from(self, key: PricedKey) -> datetime:
        """When the key's price first applies in the month (sorts lines in time order)."""
        spans = [s for s in self._spans.get(key[:2], []) if s.price == key[2]]
        return spans[0].start if spans else self._start

    def description(self, version: ModelVersion, key: PricedKey) -> str:
        """The version and token type, plus the price's periods when the month had more
        than one price for them."""
        text = f"{version.name}: {TokenType(key[1]).label}"
        spans = self._spans.get(key[:2], [])
        if len(spans) <= 1:
            return text
        mine = [s for s in spans if s.price == key[2]]
        when = ", ".join(f"{s.start:%Y-%m-%d %H:%M}–{s.end:%Y-%m-%d %H:%M}" for s in mine)
        text = f"{text}, {when or 'outside the price table'} UTC"
        return _fit(text)

    def order(self, versions: dict[int, ModelVersion], key: PricedKey) -> tuple[Any, ...]:
        return (versions[key[0]].name, TOKEN_TYPES.index(key[1]), self.first_from(key), key[2])


def usage_lines(*, tenant: Tenant, start: datetime, currency: str) -> list[LineSpec]:
    """The period's usage lines, one per version, token type and price: each hour's usage
    at the price in force at that hour (``catalog.ModelPrice``)."""
    tokens = priced_usage(
        tenant_id=tenant.pk, start=start, end=next_month(start), currency=currency
    )
    versions = _versions(v for v, _, _ in tokens)
    calendar = PriceCalendar(version_ids=versions, start=start)
    lines = []
    for key in sorted(tokens, key=lambda k: calendar.order(versions, k)):
        version_id, token_type, price = key
        count = tokens[key]
        exact = token_cost(count, price)
        lines.append(
            LineSpec(
                kind=LineKind.USAGE,
                description=calendar.description(versions[version_id], key),
                amount_exact=exact,
                amount=round_line(exact, currency),
                model_version_id=version_id,
                token_type=token_type,
                tokens=count,
                unit_price_per_mtok=price,
            )
        )
    return lines


def base_fee_line(*, tenant: Tenant, start: datetime, currency: str) -> LineSpec | None:
    plan = tenant.plan
    if not plan.base_fee:
        return None
    return LineSpec(
        kind=LineKind.BASE_FEE,
        description=f"{plan.display_name or plan.name} plan, {period_label(start)}",
        amount_exact=Decimal(plan.base_fee),
        amount=round_line(Decimal(plan.base_fee), currency),
    )


@dataclass
class Billed:
    tokens: int = 0
    amount: Decimal = Decimal(0)
    amount_exact: Decimal = Decimal(0)


def billed_for_period(*, tenant_id: Any, start: datetime) -> dict[PricedKey, Billed]:
    """What finalized or paid invoices charged for the period's usage: its own usage
    lines plus adjustment lines dated to it on later invoices."""
    lines = InvoiceLine.objects.filter(
        invoice__tenant_id=tenant_id, invoice__status__in=BILLED, model_version__isnull=False
    ).filter(
        Q(kind=LineKind.USAGE, invoice__period_start=start)
        | Q(kind=LineKind.ADJUSTMENT, adjusts_period_start=start)
    )
    out: dict[PricedKey, Billed] = defaultdict(Billed)
    for line in lines.order_by("invoice__period_start", "position"):
        assert line.model_version_id is not None
        billed = out[(line.model_version_id, line.token_type, line.unit_price_per_mtok)]
        billed.tokens += line.tokens
        billed.amount += line.amount
        billed.amount_exact += line.amount_exact
    return dict(out)


def periods_to_adjust(*, tenant_id: Any, before: datetime) -> list[datetime]:
    """Earlier months that are closed for billing: they have a finalized or paid invoice,
    or usage and no invoice at all, and come after the latest earlier draft. Months with a
    draft are billed by it when it is finalized; a month whose only invoice was voided was
    cancelled on purpose."""
    invoices = Invoice.objects.filter(tenant_id=tenant_id, period_start__lt=before)
    billed = set(invoices.filter(status__in=BILLED).values_list("period_start", flat=True))
    other = set(invoices.exclude(status__in=BILLED).values_list("period_start", flat=True)) - billed
    # An earlier draft carries the adjustments for the months before it, so that two open
    # drafts never both bill the same correction.
    drafts = invoices.filter(status=InvoiceStatus.DRAFT).values_list("period_start", flat=True)
    after = max(drafts, default=None)
    used = {
        m.astimezone(UTC)
        for m in Usage.objects.filter(tenant_id=tenant_id, hour__lt=before)
        .annotate(m=TruncMonth("hour", tzinfo=UTC))
        .values_list("m", flat=True)
        .distinct()
    }
    return sorted(p for p in billed | (used - other) if after is None or p > after)


def adjustment_lines(*, tenant: Tenant, before: datetime, currency: str) -> list[LineSpec]:
    """For each closed earlier month, what ``usage`` holds now minus what was billed for it,
    per version, token type and price (the price in force at the usage's hour, so a late
    event is charged at the price of its hour). The amount is the month's line as it would
    be rounded now minus the rounded amounts already billed, so that everything billed for
    a month always adds up to one correctly rounded line per version, token type and
    price."""
    lines: list[LineSpec] = []
    for start in periods_to_adjust(tenant_id=tenant.pk, before=before):
        now_tokens = priced_usage(
            tenant_id=tenant.pk, start=start, end=next_month(start), currency=currency
        )
        billed = billed_for_period(tenant_id=tenant.pk, start=start)
        keys = set(now_tokens) | set(billed)
        versions = _versions(v for v, _, _ in keys)
        calendar = PriceCalendar(version_ids=versions, start=start)
        for key in sorted(keys, key=lambda k: calendar.order(versions, k)):
            version_id, token_type, price = key
            was = billed.get(key, Billed())
            tokens = now_tokens.get(key, 0)
            exact_now = token_cost(tokens, price)
            delta_amount = round_line(exact_now, currency) - was.amount
            delta_tokens = tokens - was.tokens
            if not delta_tokens and not delta_amount:
                continue
            lines.append(
                LineSpec(
                    kind=LineKind.ADJUSTMENT,
                    description=_fit(
                        f"Adjustment for {period_label(start)}: "
                        f"{calendar.description(versions[version_id], key)} "
                        f"({delta_tokens:+,} tokens)"
                    ),
                    amount_exact=exact_now - was.amount_exact,
                    amount=delta_amount,
                    model_version_id=version_id,
                    token_type=token_type,
                    tokens=delta_tokens,
                    unit_price_per_mtok=price,
                    adjusts_period_start=start,
                )
            )
    return lines


def expected_lines(*, tenant: Tenant, start: datetime) -> list[LineSpec]:
    """Everything the tenant's invoice for the month starting ``start`` should hold now."""
    currency = tenant.plan.currency
    lines: list[LineSpec] = []
    fee = base_fee_line(tenant=tenant, start=start, currency=currency)
    if fee is not None:
        lines.append(fee)
    lines.extend(usage_lines(tenant=tenant, start=start, currency=currency))
    lines.extend(adjustment_lines(tenant=tenant, before=start, currency=currency))
    return lines


# -- invoices as the API shows them -------------------------------------------------------


def invoice_list(
    *,
    tenant: Tenant | None = None,
    status: str | None = None,
    period_start: datetime | None = None,
) -> QuerySet[Invoice]:
    qs = Invoice.objects.select_related("tenant").order_by("-period_start", "tenant__name")
    if tenant is not None:
        qs = qs.filter(tenant=tenant)
    if status:
        qs = qs.filter(status=status)
    if period_start is not None:
        qs = qs.filter(period_start=period_start)
    return qs


def invoice_get(*, invoice_id: Any, tenant: Tenant | None = None) -> Invoice:
    """The invoice, or 404 — also when it belongs to another tenant than ``tenant``."""
    invoice = invoice_list(tenant=tenant).filter(pk=invoice_id).first()
    if invoice is None:
        raise Http404
    return invoice


def invoice_lines(*, invoice: Invoice) -> QuerySet[InvoiceLine]:
    return invoice.lines.select_related("model_version").order_by("position")


def outbox_for_invoice(*, invoice: Invoice) -> QuerySet[StripeOutbox]:
    return StripeOutbox.objects.filter(invoice=invoice).order_by("id")
