"""Reconciliation for finance: one month, one tenant or all, four sources compared.

1. ``request_log`` vs ``usage`` — tokens per version and token type, over the days of the
   month request_log still holds (one partition per UTC day; expired days are dropped
   whole); usage on days it no longer holds is reported once as "retention expired".
2. ``usage`` vs what invoices billed for the month (its own invoice's usage lines plus
   adjustments dated to it on later invoices; for a month still open, its draft), in
   rounded money per version/token type.
3. each finalized/paid invoice's lines vs the invoice items Stripe holds (through the SDK),
   matched on the ``fairway_line_id`` metadata, in minor units.

Every difference carries its amount (in the invoice currency) and the likely cause.
A clean month reports no differences.
"""

from __future__ import annotations

import csv
import io
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db import connection

from billing import stripe_sync
from billing.models import (
    Invoice,
    InvoiceStatus,
    LineKind,
    OutboxKind,
    OutboxStatus,
    StripeOutbox,
)
from billing.periods import next_month, period_label
from billing.pricing import minor_unit_exponent, round_line, to_minor_units, token_cost
from billing.selectors import (
    BILLED,
    Billed,
    PricedKey,
    billed_for_period,
    priced_tokens,
    priced_usage,
)
from catalog.models import ModelVersion
from metering.models import RequestLog
from tenants.models import Tenant

_BOUND_RE = re.compile(r"FROM \('([^']+)'\) TO \('([^']+)'\)")


@dataclass(frozen=True)
class Difference:
    tenant: str
    tenant_id: str
    period: str
    check: str  # request_log/usage, usage/invoices, invoice/stripe
    subject: str  # e.g. "llama-70b-2026-05 completion" or an invoice line
    expected: str
    actual: str
    amount: Decimal  # expected - actual, in money of `currency`
    currency: str
    cause: str


@dataclass
class Report:
    period: str
    tenants: int = 0
    differences: list[Difference] = field(default_factory=list)
    totals: dict[str, dict[str, str]] = field(default_factory=dict)  # tenant -> source -> sum
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "period": self.period,
            "tenants": self.tenants,
            "difference_count": len(self.differences),
            "differences": [
                {**asdict(d), "amount": format(d.amount, "f")} for d in self.differences
            ],
            "totals": self.totals,
            "notes": self.notes,
        }

    def to_csv(self) -> str:
        out = io.StringIO()
        names = [f for f in Difference.__dataclass_fields__]
        writer = csv.DictWriter(out, fieldnames=names)
        writer.writeheader()
        for diff in self.differences:
            row = asdict(diff)
            row["amount"] = format(diff.amount, "f")
            writer.writerow(row)
        return out.getvalue()


def request_log_coverage() -> list[tuple[datetime, datetime]]:
    """The [from, to) ranges of request_log's partitions that exist (PostgreSQL)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'request_log'::regclass"
        )
        bounds = [row[0] for row in cur.fetchall()]
    ranges = []
    for bound in bounds:
        match = _BOUND_RE.search(bound or "")
        if match:
            ranges.append(
                (
                    datetime.fromisoformat(match.group(1)).astimezone(UTC),
                    datetime.fromisoformat(match.group(2)).astimezone(UTC),
                )
            )
    return sorted(ranges)


def _covered(
    start: datetime, end: datetime, ranges: list[tuple[datetime, datetime]]
) -> tuple[list[tuple[datetime, datetime]], timedelta]:
    """The parts of [start, end) request_log holds (its day partitions that exist: old
    days are dropped whole), and how much of the month it does not hold."""
    parts = []
    for lo, hi in ranges:
        lo, hi = max(lo, start), min(hi, end)
        if lo < hi:
            parts.append((lo, hi))
    held = sum((hi - lo for lo, hi in parts), timedelta())
    return parts, (end - start) - held


def _request_log_tokens(
    tenant_id: Any, parts: list[tuple[datetime, datetime]]
) -> dict[PricedKey, int]:
    """request_log's tokens per version, token type and the price in force when each
    request started (the price of the usage hour it rolls up into)."""
    out: dict[PricedKey, int] = defaultdict(int)
    for lo, hi in parts:
        rows = RequestLog.objects.filter(tenant_id=tenant_id)
        for key, n in priced_tokens(rows, at="started_at", start=lo, end=hi).items():
            out[key] += n
    return dict(out)


def _usage_in(tenant_id: Any, parts: list[tuple[datetime, datetime]]) -> dict[PricedKey, int]:
    out: dict[PricedKey, int] = defaultdict(int)
    for lo, hi in parts:
        for key, n in priced_usage(tenant_id=tenant_id, start=lo, end=hi).items():
            out[key] += n
    return dict(out)


def _subject(versions: dict[int, ModelVersion], key: PricedKey, keys: set[PricedKey]) -> str:
    """The version and token type, and the price when the month has more than one for it."""
    version = versions.get(key[0])
    subject = f"{version.name if version else key[0]} {key[1]}"
    if any(k[:2] == key[:2] and k[2] != key[2] for k in keys):
        subject += f" at {format(key[2].normalize(), 'f')}/Mtok"
    return subject


def reconcile(*, period_start: datetime, tenant: Tenant | None = None) -> Report:
    start, end = period_start, next_month(period_start)
    report = Report(period=period_label(start))
    tenants = [tenant] if tenant else list(Tenant.objects.select_related("plan").order_by("name"))
    parts, missing = _covered(start, end, request_log_coverage())
    sc = stripe_sync.client() if stripe_sync.enabled() else None
    if sc is None:
        report.notes.append("Stripe sync is off (no STRIPE_API_KEY): Stripe not compared.")
    if missing:
        report.notes.append(
            f"request_log does not hold {missing} of {report.period} "
            "(retention expired or never written): usage not cross-checked there."
        )
    for t in tenants:
        report.tenants += 1
        _reconcile_tenant(report, t, start, end, parts, missing, sc)
    return report


def _reconcile_tenant(
    report: Report,
    tenant: Tenant,
    start: datetime,
    end: datetime,
    parts: list[tuple[datetime, datetime]],
    missing: timedelta,
    sc: Any,
) -> None:
    currency = tenant.plan.currency
    usage = priced_usage(tenant_id=tenant.pk, start=start, end=end)
    logged = _request_log_tokens(tenant.pk, parts)
    usage_held = _usage_in(tenant.pk, parts)
    billed = billed_for_period(tenant_id=tenant.pk, start=start)
    invoice = (
        Invoice.objects.filter(tenant=tenant, period_start=start)
        .exclude(status=InvoiceStatus.VOID)
        .first()
    )
    voided = invoice is None and Invoice.objects.filter(tenant=tenant, period_start=start).exists()
    if invoice is not None and invoice.status == InvoiceStatus.DRAFT:
        # An open month is compared with its draft: a difference means a stale draft.
        for line in invoice.lines.filter(kind=LineKind.USAGE):
            assert line.model_version_id is not None
            billed[(line.model_version_id, line.token_type, line.unit_price_per_mtok)] = Billed(
                tokens=line.tokens, amount=line.amount, amount_exact=line.amount_exact
            )
    versions = {
        v.pk: v
        for v in ModelVersion.objects.filter(pk__in={k[0] for k in (*usage, *logged, *billed)})
    }

    def diff(check: str, subject: str, expected: Any, actual: Any, amount: Decimal, cause: str):
        report.differences.append(
            Difference(
                tenant=tenant.name,
                tenant_id=str(tenant.pk),
                period=report.period,
                check=check,
                subject=subject,
                expected=str(expected),
                actual=str(actual),
                amount=round_line(amount, currency),
                currency=currency,
                cause=cause,
            )
        )

    every_key = {*usage, *logged, *billed}

    def money(key: PricedKey, tokens: int) -> Decimal:
        # The key carries the price in force at the tokens' hour.
        return round_line(token_cost(abs(tokens), key[2]), currency) * (1 if tokens >= 0 else -1)

    # 1. request_log vs usage, where request_log still holds the days.
    if parts:
        for key in sorted(set(logged) | set(usage_held)):
            a, b = logged.get(key, 0), usage_held.get(key, 0)
            if a != b:
                diff(
                    "request_log/usage",
                    _subject(versions, key, every_key),
                    f"{a} tokens in request_log",
                    f"{b} tokens in usage",
                    money(key, a - b),
                    "usage rollup behind request_log (ingestion lag or a lost rollup)"
                    if a > b
                    else "usage without request_log rows (request_log write lost or pruned)",
                )
    if missing and usage:
        unchecked = {k: n for k, n in usage.items() if n != usage_held.get(k, 0)}
        amount = sum((money(k, n - usage_held.get(k, 0)) for k, n in unchecked.items()), Decimal(0))
        if unchecked:
            diff(
                "request_log/usage",
                "days not held by request_log",
                f"{missing} not held",
                "usage only",
                amount,
                "request_log retention expired: usage cannot be cross-checked for these days",
            )

    # 2. usage vs billed (rounded per line, as invoices do).
    keys = set(usage) | set(billed)
    usage_money = Decimal(0)
    billed_money = Decimal(0)
    for key in sorted(keys):
        tokens = usage.get(key, 0)
        was = billed.get(key)
        want = money(key, tokens)
        have = was.amount if was else Decimal(0)
        usage_money += want
        billed_money += have
        have_tokens = was.tokens if was else 0
        if want == have and tokens == have_tokens:
            continue
        if invoice is None:
            cause = (
                "invoice voided: the month is not billed, by decision"
                if voided
                else "no invoice for the month yet (invoice_cycle has not run or found nothing)"
            )
        elif invoice.status == InvoiceStatus.DRAFT:
            cause = "draft not refreshed since usage changed (the next invoice_cycle run will)"
        else:
            cause = "late events after finalization — adjustment pending on the next invoice"
        diff(
            "usage/invoices",
            _subject(versions, key, every_key),
            f"{tokens} tokens = {want}",
            f"{have_tokens} tokens = {have}",
            want - have,
            cause,
        )
    totals = report.totals.setdefault(tenant.name, {})
    totals["usage"] = format(round_line(usage_money, currency), "f")
    totals["invoiced_usage"] = format(round_line(billed_money, currency), "f")
    totals["request_log_tokens"] = str(sum(logged.values()))
    totals["usage_tokens"] = str(sum(usage.values()))

    # 3. invoice lines vs Stripe, for every billed invoice that has lines for this month.
    invoices = Invoice.objects.filter(tenant=tenant, status__in=BILLED, period_start=start)
    stripe_total = 0
    local_total = 0
    for inv in invoices.order_by("pk"):
        lines = list(inv.lines.order_by("position"))
        local_total += sum(to_minor_units(line.amount, inv.currency) for line in lines)
        if sc is None:
            continue
        push = (
            StripeOutbox.objects.filter(invoice=inv, kind=OutboxKind.INVOICE_PUSH)
            .order_by("-pk")
            .first()
        )
        outbox_state = (
            f"outbox row {push.pk} {push.status}"
            + (f" after {push.attempts} attempts: {push.last_error}" if push.last_error else "")
            if push
            else "no outbox row"
        )
        items = (
            stripe_sync.list_invoice_items(sc, inv.stripe_invoice_id)
            if (inv.stripe_invoice_id)
            else []
        )
        by_line: dict[str, list[Any]] = defaultdict(list)
        for item in items:
            metadata = item.metadata.to_dict() if item.metadata else {}
            by_line[str(metadata.get("fairway_line_id", ""))].append(item)
            stripe_total += int(item.amount)
        for line in lines:
            want_minor = to_minor_units(line.amount, inv.currency)
            found = by_line.pop(str(line.pk), [])
            subject = f"{inv.number} line {line.position}: {line.description}"
            if not found:
                if push is None or push.status in (OutboxStatus.PENDING, OutboxStatus.FAILED):
                    cause = f"Stripe item missing — {outbox_state}"
                elif push.status == OutboxStatus.SKIPPED:
                    cause = f"Stripe item missing — sync was off when finalized ({outbox_state})"
                else:
                    cause = "Stripe item missing — deleted in Stripe after a successful push"
                diff("invoice/stripe", subject, line.amount, "absent", line.amount, cause)
                continue
            got = sum(int(i.amount) for i in found)
            if len(found) > 1 or got != want_minor:
                diff(
                    "invoice/stripe",
                    subject,
                    f"{want_minor} minor units",
                    f"{got} minor units in {len(found)} item(s)",
                    Decimal(want_minor - got).scaleb(-minor_unit_exponent(inv.currency)),
                    "Stripe holds a duplicate item" if len(found) > 1 else "amount differs",
                )
        for line_id, extra in by_line.items():
            for item in extra:
                diff(
                    "invoice/stripe",
                    f"{inv.number} Stripe item {item.id}",
                    "absent",
                    f"{item.amount} minor units",
                    -Decimal(int(item.amount)).scaleb(-minor_unit_exponent(inv.currency)),
                    f"Stripe item with no Fairway line (fairway_line_id={line_id or 'none'})",
                )
    totals["invoice_lines_minor"] = str(local_total)
    if sc is not None:
        totals["stripe_items_minor"] = str(stripe_total)
