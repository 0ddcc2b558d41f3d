"""Reconciliation: request_log vs usage vs invoices vs Stripe (through the SDK against the
fake). Clean data gives no differences; planted ones are found with amount and cause."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command

from billing import outbox, services
from billing.models import Invoice
from billing.reconciliation import reconcile
from billing.testing.stripe_fake import StripeFake
from catalog.models import ModelVersion
from metering.models import Usage
from tenants.models import Tenant
from tests.billing.conftest import utc

NOV = utc(2026, 11, 1)
DEC = utc(2026, 12, 1)

pytestmark = pytest.mark.django_db


def served(
    add_usage: Callable[..., Any],
    add_request: Callable[..., Any],
    tenant: Tenant,
    version: ModelVersion,
    day: int,
    **tokens: int,
) -> None:
    """One request as the pipeline records it: a request_log row and its usage."""
    at = utc(2026, 11, day, 9)
    add_request(tenant, version, at.replace(minute=15), **tokens)
    add_usage(tenant, version, at, **tokens)


@pytest.fixture
def world(
    tenant_a: Tenant,
    tenant_b: Tenant,
    version_70b: ModelVersion,
    version_8b: ModelVersion,
    add_usage: Callable[..., Any],
    add_request: Callable[..., Any],
    stripe_fake: StripeFake,
) -> dict[str, Invoice]:
    served(
        add_usage,
        add_request,
        tenant_a,
        version_70b,
        3,
        prompt=1_000_000,
        cached=300_000,
        completion=200_000,
    )
    served(add_usage, add_request, tenant_a, version_8b, 17, prompt=500_000, completion=62_500)
    served(add_usage, add_request, tenant_b, version_70b, 29, prompt=2_000_000, completion=10)
    out = {}
    for tenant in (tenant_a, tenant_b):
        draft = services.invoice_draft_build(tenant=tenant, period_start=NOV)
        assert draft is not None
        out[tenant.name] = services.invoice_finalize(
            invoice=draft, actor=services.Actor("t"), now=DEC
        )
    assert outbox.drain().done == 2
    for invoice in out.values():
        invoice.refresh_from_db()
    return out


def test_clean_month_has_no_differences(world: dict[str, Invoice], tmp_path: Path) -> None:
    report = reconcile(period_start=NOV)
    assert report.tenants == 2
    assert report.differences == [], report.differences
    totals = report.totals["tenant-a"]
    assert totals["usage"] == totals["invoiced_usage"]
    assert totals["invoice_lines_minor"] == totals["stripe_items_minor"]
    assert (
        totals["request_log_tokens"]
        == totals["usage_tokens"]
        == str(1_000_000 + 200_000 + 500_000 + 62_500)
    )
    out = tmp_path / "clean.csv"
    call_command("billing_reconcile", "--period", "2026-11", "--csv", str(out))
    assert out.read_text().splitlines()[0].startswith("tenant,tenant_id,period,check")
    assert len(out.read_text().splitlines()) == 1


def test_planted_discrepancies_are_found_with_amount_and_cause(
    world: dict[str, Invoice],
    tenant_a: Tenant,
    tenant_b: Tenant,
    version_70b: ModelVersion,
    stripe_fake: StripeFake,
    tmp_path: Path,
) -> None:
    # 1. A usage row changed after November was finalized (a late event, no request_log row).
    row = Usage.objects.get(tenant=tenant_a, model_version=version_70b)
    row.completion_tokens += 1_000_000
    row.save()
    # 2. An item deleted in Stripe behind our back (tenant b's first line).
    inv_b = world["tenant-b"]
    line = inv_b.lines.order_by("position").first()
    assert line is not None
    stripe_fake.delete_item(line.stripe_item_id)

    report = reconcile(period_start=NOV)
    found = {(d.tenant, d.check, d.subject): d for d in report.differences}
    assert len(report.differences) == 3, report.differences
    late = found[("tenant-a", "usage/invoices", "llama-70b-2026-05 completion")]
    assert late.amount == Decimal("0.80") and late.currency == "usd"
    assert late.cause == "late events after finalization — adjustment pending on the next invoice"
    unlogged = found[("tenant-a", "request_log/usage", "llama-70b-2026-05 completion")]
    assert unlogged.amount == Decimal("-0.80")
    assert "usage without request_log rows" in unlogged.cause
    missing = next(d for d in report.differences if d.check == "invoice/stripe")
    assert missing.tenant == "tenant-b" and missing.amount == line.amount
    assert missing.cause == "Stripe item missing — deleted in Stripe after a successful push"

    # The CSV export carries the same rows; the command exits 1 when there are any.
    out = tmp_path / "diffs.csv"
    with pytest.raises(SystemExit) as exit_info:
        call_command(
            "billing_reconcile", "--period", "2026-11", "--tenant", "tenant-b", "--csv", str(out)
        )
    assert exit_info.value.code == 1
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [(r["tenant"], r["check"], Decimal(r["amount"])) for r in rows] == [
        ("tenant-b", "invoice/stripe", line.amount)
    ]

    # Once December's invoice carries the adjustment and is finalized, November's usage
    # and what was billed for it agree again.
    dec = services.invoice_draft_build(tenant=tenant_a, period_start=DEC)
    assert dec is not None
    services.invoice_finalize(invoice=dec, actor=services.Actor("t"), now=utc(2027, 1, 1))
    after = reconcile(period_start=NOV, tenant=tenant_a)
    assert [d.check for d in after.differences] == ["request_log/usage"]


def test_failing_outbox_row_is_named_as_the_cause(
    tenant_a: Tenant,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
    add_request: Callable[..., Any],
    stripe_fake: StripeFake,
) -> None:
    served(add_usage, add_request, tenant_a, version_70b, 5, completion=1_000_000)
    draft = services.invoice_draft_build(tenant=tenant_a, period_start=NOV)
    assert draft is not None
    invoice = services.invoice_finalize(invoice=draft, actor=services.Actor("t"), now=DEC)
    stripe_fake.fail_next(1)
    assert outbox.drain(limit=1).failed == 1
    report = reconcile(period_start=NOV, tenant=tenant_a)
    assert len(report.differences) == 1
    diff = report.differences[0]
    assert (diff.check, diff.amount) == ("invoice/stripe", invoice.total)
    assert diff.cause.startswith("Stripe item missing — outbox row")
    assert "pending after 1 attempts" in diff.cause and "injected failure" in diff.cause


def test_request_log_retention_expired_is_reported(
    tenant_a: Tenant,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
    add_request: Callable[..., Any],
) -> None:
    served(add_usage, add_request, tenant_a, version_70b, 20, completion=1_000_000)
    # Usage on a day whose request_log partition is gone (never created here).
    add_usage(tenant_a, version_70b, utc(2026, 11, 2, 3), completion=500_000)
    report = reconcile(period_start=NOV, tenant=tenant_a)
    assert any("request_log does not hold" in n for n in report.notes)
    assert any("Stripe sync is off" in n for n in report.notes)
    (diff,) = [d for d in report.differences if d.check == "request_log/usage"]
    assert diff.amount == Decimal("0.40")
    assert diff.cause.startswith("request_log retention expired")
    # The month has no invoice yet: that shows too, with its cause.
    (pending,) = [d for d in report.differences if d.check == "usage/invoices"]
    assert pending.amount == Decimal("1.20") and pending.cause.startswith("no invoice")


def test_open_month_compares_with_its_draft_and_voided_month_says_so(
    tenant_a: Tenant,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
    add_request: Callable[..., Any],
) -> None:
    served(add_usage, add_request, tenant_a, version_70b, 8, prompt=1_000_000)
    draft = services.invoice_draft_build(tenant=tenant_a, period_start=NOV)
    assert draft is not None
    assert reconcile(period_start=NOV, tenant=tenant_a).differences == []
    served(add_usage, add_request, tenant_a, version_70b, 9, prompt=1_000_000)
    (stale,) = reconcile(period_start=NOV, tenant=tenant_a).differences
    assert stale.amount == Decimal("0.60") and stale.cause.startswith("draft not refreshed")
    services.invoice_draft_build(tenant=tenant_a, period_start=NOV)
    assert reconcile(period_start=NOV, tenant=tenant_a).differences == []
    final = services.invoice_finalize(invoice=draft, actor=services.Actor("t"), now=DEC)
    services.invoice_void(invoice=final, actor=services.Actor("t"), reason="test")
    (voided,) = reconcile(period_start=NOV, tenant=tenant_a).differences
    assert voided.amount == Decimal("1.20") and voided.cause.startswith("invoice voided")
