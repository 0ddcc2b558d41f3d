"""Invoices from usage: rounding, UTC month boundaries, the state machine and its audit
trail, immutability (services and the database), late usage as adjustments, the cycle."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.utils import timezone

from billing import services
from billing.models import (
    AuditEntry,
    Invoice,
    InvoiceLine,
    InvoiceStatus,
    LineKind,
    OutboxStatus,
    StripeOutbox,
)
from billing.periods import month_start
from billing.pricing import round_line, token_cost
from catalog.models import ModelVersion
from tenants.models import Tenant
from tests.billing.conftest import utc

NOV = utc(2026, 11, 1)
DEC = utc(2026, 12, 1)
FINANCE = services.Actor(label="finance-test")

pytestmark = pytest.mark.django_db


def lines_of(invoice: Invoice) -> list[InvoiceLine]:
    return list(invoice.lines.order_by("position"))


def test_line_per_version_and_token_type_cached_price_only_on_cached(
    tenant_a: Tenant, version_70b: ModelVersion, add_usage: Callable[..., Any]
) -> None:
    # 70B: prompt 0.60, cached 0.15, completion 0.80 per Mtok.
    add_usage(
        tenant_a,
        version_70b,
        utc(2026, 11, 3, 10),
        prompt=1_000_000,
        cached=400_000,
        completion=250_000,
    )
    add_usage(
        tenant_a, version_70b, utc(2026, 11, 20, 23), prompt=500_000, cached=100_000, completion=0
    )
    invoice = services.invoice_draft_build(tenant=tenant_a, period_start=NOV)
    assert invoice is not None
    got = {(ln.token_type, ln.tokens, ln.amount) for ln in lines_of(invoice)}
    # uncached = (1.5M - 0.5M) at 0.60 = 0.60; cached 0.5M at 0.15 = 0.075 -> 0.08;
    # completion 0.25M at 0.80 = 0.20.
    assert got == {
        ("prompt", 1_000_000, Decimal("0.60")),
        ("cached_prompt", 500_000, Decimal("0.08")),
        ("completion", 250_000, Decimal("0.20")),
    }
    assert invoice.total == Decimal("0.88")


def test_rounding_half_up_once_per_line_and_total_is_sum_of_rounded_lines(
    tenant_a: Tenant,
    version_70b: ModelVersion,
    version_8b: ModelVersion,
    add_usage: Callable[..., Any],
) -> None:
    # 8B completion 0.08/Mtok: 62,500 tokens = 0.005 exactly -> 0.01 (half up);
    # 70B completion 0.80/Mtok: 6,250 tokens = 0.005 -> 0.01. Exact sum 0.010 would round
    # to 0.01; the invoice charges the two rounded lines: 0.02.
    for hour in range(5):  # spread over hours: rounding is per line, not per usage row
        add_usage(tenant_a, version_8b, utc(2026, 11, 2, hour), completion=12_500)
    add_usage(tenant_a, version_70b, utc(2026, 11, 2, 0), completion=6_250)
    invoice = services.invoice_draft_build(tenant=tenant_a, period_start=NOV)
    assert invoice is not None
    lines = lines_of(invoice)
    assert [ln.amount_exact for ln in lines] == [Decimal("0.005"), Decimal("0.005")]
    assert [ln.amount for ln in lines] == [Decimal("0.01"), Decimal("0.01")]
    assert invoice.total == Decimal("0.02") == sum(ln.amount for ln in lines)
    assert round_line(sum(ln.amount_exact for ln in lines), "usd") == Decimal("0.01")
    # and 0.0049999 stays 0.00 — half up, not up
    assert round_line(token_cost(62_499, Decimal("0.08")), "usd") == Decimal("0.00")


def test_month_boundaries_are_utc(
    tenant_a: Tenant, version_70b: ModelVersion, add_usage: Callable[..., Any]
) -> None:
    add_usage(tenant_a, version_70b, utc(2026, 10, 31, 23), completion=1_000_000)  # October
    add_usage(tenant_a, version_70b, utc(2026, 11, 1, 0), completion=2_000_000)  # November
    add_usage(tenant_a, version_70b, utc(2026, 11, 30, 23), completion=3_000_000)  # November
    add_usage(tenant_a, version_70b, utc(2026, 12, 1, 0), completion=4_000_000)  # December
    # Not UTC midnight -> not a period start.
    with pytest.raises(ValidationError):
        services.invoice_draft_build(tenant=tenant_a, period_start=utc(2026, 11, 1, 1))
    nov = services.invoice_draft_build(tenant=tenant_a, period_start=NOV)
    assert nov is not None
    assert (nov.period_start, nov.period_end) == (NOV, DEC)
    # October was never invoiced: it is billed on the next invoice, dated to October.
    assert [(ln.kind, ln.tokens, ln.adjusts_period_start) for ln in lines_of(nov)] == [
        ("usage", 5_000_000, None),
        ("adjustment", 1_000_000, utc(2026, 10, 1)),
    ]
    dec = services.invoice_draft_build(tenant=tenant_a, period_start=DEC)
    assert dec is not None
    # November's open draft carries October's correction; December does not repeat it.
    assert [(ln.kind, ln.tokens) for ln in lines_of(dec)] == [("usage", 4_000_000)]


def test_base_fee_line_and_refresh_follows_usage(
    tenant_a: Tenant,
    standard_fee: Decimal,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
) -> None:
    invoice = services.invoice_draft_build(tenant=tenant_a, period_start=NOV)
    assert invoice is not None  # the fee alone is worth an invoice
    assert [(ln.kind, ln.amount) for ln in lines_of(invoice)] == [("base_fee", standard_fee)]
    add_usage(tenant_a, version_70b, utc(2026, 11, 5, 5), completion=1_000_000)
    again = services.invoice_draft_build(tenant=tenant_a, period_start=NOV)
    assert again is not None and again.pk == invoice.pk
    assert again.total == standard_fee + Decimal("0.80")
    actions = list(AuditEntry.objects.filter(invoice=invoice).values_list("action", flat=True))
    assert actions == ["draft_built", "draft_refreshed"]
    # Nothing changed: no new audit row.
    services.invoice_draft_build(tenant=tenant_a, period_start=NOV)
    assert AuditEntry.objects.filter(invoice=invoice).count() == 2


def test_no_usage_no_fee_no_invoice(tenant_a: Tenant) -> None:
    assert services.invoice_draft_build(tenant=tenant_a, period_start=NOV) is None
    assert not Invoice.objects.exists()


def _finalized(tenant: Tenant, version: ModelVersion, add_usage: Callable[..., Any]) -> Invoice:
    add_usage(
        tenant,
        version,
        utc(2026, 11, 10, 12),
        prompt=2_000_000,
        cached=1_000_000,
        completion=1_000_000,
    )
    draft = services.invoice_draft_build(tenant=tenant, period_start=NOV)
    assert draft is not None
    return services.invoice_finalize(invoice=draft, actor=FINANCE, reason="test", now=DEC)


def test_state_machine_and_audit_rows(
    tenant_a: Tenant, version_70b: ModelVersion, add_usage: Callable[..., Any]
) -> None:
    add_usage(tenant_a, version_70b, utc(2026, 11, 10, 12), completion=1_000_000)
    draft = services.invoice_draft_build(tenant=tenant_a, period_start=NOV)
    assert draft is not None
    # Not before the month is over; not paid or void while a draft.
    with pytest.raises(services.InvoiceStateError):
        services.invoice_finalize(invoice=draft, actor=FINANCE, now=utc(2026, 11, 30, 23))
    with pytest.raises(services.InvoiceStateError):
        services.invoice_mark_paid(invoice=draft, actor=FINANCE)
    with pytest.raises(services.InvoiceStateError):
        services.invoice_void(invoice=draft, actor=FINANCE, reason="x")
    inv = services.invoice_finalize(invoice=draft, actor=FINANCE, reason="month end", now=DEC)
    assert inv.status == InvoiceStatus.FINALIZED
    assert inv.number == f"FW-202611-{inv.pk:06d}"
    with pytest.raises(services.InvoiceStateError):
        services.invoice_finalize(invoice=inv, actor=FINANCE, now=DEC)
    with pytest.raises(ValidationError):
        services.invoice_void(invoice=inv, actor=FINANCE, reason="  ")  # a reason is required
    paid = services.invoice_mark_paid(invoice=inv, actor=FINANCE, reason="wire received")
    assert paid.status == InvoiceStatus.PAID and paid.paid_at is not None
    with pytest.raises(services.InvoiceStateError):
        services.invoice_void(invoice=paid, actor=FINANCE, reason="too late")
    with pytest.raises(services.InvoiceStateError):
        services.invoice_mark_paid(invoice=paid, actor=FINANCE)

    audit = list(AuditEntry.objects.filter(invoice=inv).order_by("id"))
    assert [a.action for a in audit] == ["draft_built", "finalized", "paid"]
    finalized, paid_row = audit[1], audit[2]
    assert finalized.actor_label == "finance-test" and finalized.reason == "month end"
    assert finalized.before["status"] == "draft" and finalized.after["status"] == "finalized"
    assert finalized.after["total"] == "0.8"
    assert (paid_row.before["status"], paid_row.after["status"]) == ("finalized", "paid")
    assert paid_row.reason == "wire received"
    # Sync is off: the outbox says so instead of holding work.
    assert set(StripeOutbox.objects.values_list("status", flat=True)) == {OutboxStatus.SKIPPED}


def test_void_leaves_audit_and_month_is_not_rebilled(
    tenant_a: Tenant, version_70b: ModelVersion, add_usage: Callable[..., Any]
) -> None:
    inv = _finalized(tenant_a, version_70b, add_usage)
    voided = services.invoice_void(invoice=inv, actor=FINANCE, reason="goodwill")
    assert voided.status == InvoiceStatus.VOID
    row = AuditEntry.objects.get(invoice=inv, action="voided")
    assert (row.before["status"], row.after["status"], row.reason) == (
        "finalized",
        "void",
        "goodwill",
    )
    dec = services.invoice_draft_build(tenant=tenant_a, period_start=DEC)
    assert dec is None  # the voided month is not swept into December


def test_finalized_invoice_refused_by_services(
    tenant_a: Tenant, version_70b: ModelVersion, add_usage: Callable[..., Any]
) -> None:
    inv = _finalized(tenant_a, version_70b, add_usage)
    before = [(ln.tokens, ln.amount) for ln in lines_of(inv)]
    add_usage(tenant_a, version_70b, utc(2026, 11, 29, 1), completion=5_000_000)  # late
    again = services.invoice_draft_build(tenant=tenant_a, period_start=NOV)
    assert again is not None and again.pk == inv.pk and again.status == "finalized"
    assert [(ln.tokens, ln.amount) for ln in lines_of(again)] == before
    assert again.total == inv.total


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE billing_invoiceline SET amount = amount + 1 WHERE invoice_id = %s",
        "UPDATE billing_invoiceline SET tokens = 1 WHERE invoice_id = %s",
        "DELETE FROM billing_invoiceline WHERE invoice_id = %s",
        "UPDATE billing_invoice SET total = 0 WHERE id = %s",
        "UPDATE billing_invoice SET period_start = period_start - interval '1 month' WHERE id = %s",
        "UPDATE billing_invoice SET status = 'draft' WHERE id = %s",
        "DELETE FROM billing_invoice WHERE id = %s",
        "INSERT INTO billing_invoiceline (invoice_id, position, kind, token_type, tokens, "
        "unit_price_per_mtok, amount_exact, amount, description, stripe_item_id) "
        "VALUES (%s, 99, 'base_fee', '', 0, 0, 1, 1, 'sneaky', '')",
        "UPDATE billing_auditentry SET reason = 'rewritten' WHERE invoice_id = %s",
        "DELETE FROM billing_auditentry WHERE invoice_id = %s",
    ],
)
def test_database_refuses_raw_changes_to_a_finalized_invoice(
    sql: str, tenant_a: Tenant, version_70b: ModelVersion, add_usage: Callable[..., Any]
) -> None:
    inv = _finalized(tenant_a, version_70b, add_usage)
    with pytest.raises((IntegrityError, DatabaseError)), transaction.atomic():
        with connection.cursor() as cur:
            cur.execute(sql, [inv.pk])
    inv.refresh_from_db()
    assert inv.status == "finalized" and inv.total == Decimal("1.55")


def test_database_allows_the_state_and_stripe_ids_to_move_on(
    tenant_a: Tenant, version_70b: ModelVersion, add_usage: Callable[..., Any]
) -> None:
    inv = _finalized(tenant_a, version_70b, add_usage)
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE billing_invoiceline SET stripe_item_id = 'ii_1' WHERE invoice_id = %s",
            [inv.pk],
        )
        cur.execute("UPDATE billing_invoice SET stripe_invoice_id = 'in_1' WHERE id = %s", [inv.pk])
        cur.execute(
            "UPDATE billing_invoice SET status = 'paid', paid_at = now() WHERE id = %s", [inv.pk]
        )
    # ... but a Stripe item id is written once.
    with pytest.raises((IntegrityError, DatabaseError)), transaction.atomic():
        with connection.cursor() as cur:
            cur.execute(
                "UPDATE billing_invoiceline SET stripe_item_id = 'ii_2' WHERE invoice_id = %s",
                [inv.pk],
            )


def test_database_refuses_finalizing_with_a_wrong_total(
    tenant_a: Tenant, version_70b: ModelVersion, add_usage: Callable[..., Any]
) -> None:
    add_usage(tenant_a, version_70b, utc(2026, 11, 10, 12), completion=1_000_000)
    draft = services.invoice_draft_build(tenant=tenant_a, period_start=NOV)
    assert draft is not None
    with pytest.raises((IntegrityError, DatabaseError)), transaction.atomic():
        with connection.cursor() as cur:
            cur.execute(
                "UPDATE billing_invoice SET status = 'finalized', total = 999, "
                "finalized_at = now(), number = 'X' WHERE id = %s",
                [draft.pk],
            )


def test_late_usage_lands_as_dated_adjustment_on_the_next_invoice(
    tenant_a: Tenant,
    version_70b: ModelVersion,
    version_8b: ModelVersion,
    add_usage: Callable[..., Any],
) -> None:
    nov = _finalized(tenant_a, version_70b, add_usage)
    nov_lines = [(ln.token_type, ln.tokens, ln.amount) for ln in lines_of(nov)]
    # Late events for November: more 70B completion, and a version November never saw.
    add_usage(tenant_a, version_70b, utc(2026, 11, 30, 23), completion=6_250)  # 0.005
    add_usage(tenant_a, version_8b, utc(2026, 11, 15, 0), prompt=1_000_000)  # 0.06
    add_usage(tenant_a, version_70b, utc(2026, 12, 2, 0), completion=1_000_000)  # December
    dec = services.invoice_draft_build(tenant=tenant_a, period_start=DEC)
    assert dec is not None
    adjustments = [ln for ln in lines_of(dec) if ln.kind == LineKind.ADJUSTMENT]
    assert {
        (ln.adjusts_period_start, ln.model_version_id, ln.token_type, ln.tokens, ln.amount)
        for ln in adjustments
    } == {
        # November's completion line was 1,000,000 = 0.80; now 1,006,250 = 0.805 -> 0.81.
        (NOV, version_70b.pk, "completion", 6_250, Decimal("0.01")),
        (NOV, version_8b.pk, "prompt", 1_000_000, Decimal("0.06")),
    }
    assert all("Adjustment for 2026-11" in ln.description for ln in adjustments)
    assert dec.total == Decimal("0.80") + Decimal("0.07")
    # Each new adjustment left an audit row with the line.
    audit = AuditEntry.objects.filter(invoice=dec, action="adjustment")
    assert audit.count() == 2
    assert {a.after["adjusts_period"] for a in audit} == {"2026-11"}
    # November itself did not change.
    nov.refresh_from_db()
    assert [(ln.token_type, ln.tokens, ln.amount) for ln in lines_of(nov)] == nov_lines

    # Once December is finalized, January owes nothing more for November...
    dec = services.invoice_finalize(invoice=dec, actor=FINANCE, now=utc(2027, 1, 1))
    jan = services.invoice_draft_build(tenant=tenant_a, period_start=utc(2027, 1, 1))
    assert jan is None
    # ... until yet another late November event arrives.
    add_usage(tenant_a, version_70b, utc(2026, 11, 1, 0), completion=1_000_000)
    jan = services.invoice_draft_build(tenant=tenant_a, period_start=utc(2027, 1, 1))
    assert jan is not None
    assert [(ln.adjusts_period_start, ln.tokens, ln.amount) for ln in lines_of(jan)] == [
        (NOV, 1_000_000, Decimal("0.80"))  # 2,006,250 -> 1.61 minus 0.81 billed
    ]


def test_invoice_cycle_drafts_finalizes_after_grace_and_refreshes(
    tenant_a: Tenant,
    tenant_b: Tenant,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
) -> None:
    add_usage(tenant_a, version_70b, utc(2026, 11, 30, 23), completion=1_000_000)
    add_usage(tenant_b, version_70b, utc(2026, 11, 3, 1), prompt=1_000_000)
    # 30 min after the month ended: drafts exist, nothing is finalized (grace 1 h).
    counts = services.invoice_cycle(now=DEC + timedelta(minutes=30), grace_s=3600)
    assert counts["finalized"] == 0
    assert set(Invoice.objects.values_list("status", flat=True)) == {"draft"}
    add_usage(tenant_a, version_70b, utc(2026, 11, 30, 23), completion=1_000_000)  # late
    counts = services.invoice_cycle(now=DEC + timedelta(hours=1, minutes=1), grace_s=3600)
    assert counts["finalized"] == 2
    nov_a = Invoice.objects.get(tenant=tenant_a, period_start=NOV)
    assert nov_a.status == "finalized" and nov_a.total == Decimal("1.60")
    assert nov_a.finalized_at == DEC + timedelta(hours=1, minutes=1)
    audit = AuditEntry.objects.get(invoice=nov_a, action="finalized")
    assert audit.actor_label == "system:invoice_cycle" and audit.actor is None


def test_beat_runs_the_cycle_task(tenant_a: Tenant, standard_fee: Decimal, settings: Any) -> None:
    from billing import tasks

    assert settings.CELERY_BEAT_SCHEDULE["billing-invoice-cycle"]["task"] == (
        "billing.tasks.invoice_cycle"
    )
    assert settings.CELERY_BEAT_SCHEDULE["billing-stripe-outbox-drain"]["task"] == (
        "billing.tasks.stripe_outbox_drain"
    )
    tasks.invoice_cycle.delay()  # eager in tests: runs now, for the real current month
    current = Invoice.objects.get(
        tenant=tenant_a, status="draft", period_start=month_start(timezone.now())
    )
    assert current.total == standard_fee
