"""Invoice pages for customers and the finance desk: lines, adjustments, CSV, state changes
through billing's services with their audit rows, reconciliation with its differences, and
tenant isolation."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from billing import services as billing_services
from billing.models import AuditEntry, Invoice, InvoiceStatus
from metering.models import Usage
from tenants.models import Role, Tenant

pytestmark = pytest.mark.django_db

OCT = datetime(2026, 10, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _stripe_off(settings: Any) -> None:
    settings.STRIPE_API_KEY = ""
    settings.STRIPE_API_BASE = ""


@pytest.fixture
def october(tenant_a: Tenant, version_70b: Any) -> Invoice:
    Usage.objects.create(
        tenant=tenant_a, api_key_id="00000000-0000-0000-0000-000000000001",
        model_version=version_70b, hour=datetime(2026, 10, 3, 10, tzinfo=UTC), requests=5,
        prompt_tokens=2_000_000, cached_tokens=500_000, completion_tokens=300_000,
    )  # fmt: skip
    invoice = billing_services.invoice_draft_build(tenant=tenant_a, period_start=OCT)
    assert invoice is not None
    return invoice


def test_customer_sees_invoice_lines_and_downloads_csv(
    tenant_a: Tenant, owner_a: Any, october: Invoice, browser_for: Any,
    member_of: Callable[..., Any],
) -> None:  # fmt: skip
    client = browser_for(owner_a)
    listing = client.get(f"/t/{tenant_a.id}/invoices/").content.decode()
    assert "2026-10" in listing and "draft" in listing
    detail = client.get(f"/t/{tenant_a.id}/invoices/{october.pk}/").content.decode()
    # 1.5M uncached x 0.60 = 0.90; 0.5M cached x 0.15 = 0.075 -> 0.08; 0.3M x 0.80 = 0.24
    assert "1,500,000" in detail and "$0.90" in detail and "$0.08" in detail
    assert "$0.24" in detail and "No adjustments on this invoice." in detail
    download = client.get(f"/t/{tenant_a.id}/invoices/{october.pk}.csv")
    rows = list(csv.DictReader(io.StringIO(download.content.decode())))
    assert {r["amount"] for r in rows} >= {"0.90", "0.08", "0.24"}
    assert all(r["tenant"] == "tenant-a" for r in rows)
    # A billing member sees invoices; a plain member does not.
    assert (
        browser_for(member_of(tenant_a, Role.BILLING))
        .get(f"/t/{tenant_a.id}/invoices/")
        .status_code
        == 200
    )
    assert (
        browser_for(member_of(tenant_a, Role.MEMBER)).get(f"/t/{tenant_a.id}/invoices/").status_code
        == 403
    )


def test_invoices_of_another_tenant_are_404(
    tenant_a: Tenant, tenant_b: Tenant, october: Invoice, browser_for: Any
) -> None:
    owner_b = tenant_b.memberships.get(role=Role.OWNER).user
    client = browser_for(owner_b)
    for url in (
        f"/t/{tenant_a.id}/invoices/",
        f"/t/{tenant_a.id}/invoices/{october.pk}/",
        f"/t/{tenant_a.id}/invoices/{october.pk}.csv",
        f"/t/{tenant_b.id}/invoices/{october.pk}/",
        f"/t/{tenant_b.id}/invoices/{october.pk}.csv",
    ):
        assert client.get(url).status_code == 404, url


def test_finance_acts_on_invoices_with_reasons_and_audit_rows(
    october: Invoice, finance: Any, operator: Any, owner_a: Any, browser_for: Any,
    make_user: Callable[..., Any],
) -> None:  # fmt: skip
    for user in (operator, owner_a, make_user("staff-only", is_staff=True)):
        assert browser_for(user).get("/finance/invoices/").status_code == 403
        assert (
            browser_for(user)
            .post(f"/finance/invoices/{october.pk}/action/", {"action": "finalize", "reason": "x"})
            .status_code
            == 403
        )
    client = browser_for(finance)
    listing = client.get("/finance/invoices/", {"period": "2026-10", "status": "draft"})
    assert listing.status_code == 200 and "tenant-a" in listing.content.decode()
    assert client.get("/finance/invoices/", {"period": "10/2026"}).status_code == 400
    action = f"/finance/invoices/{october.pk}/action/"
    # A reason is required: the error is on the field.
    missing = client.post(action, {"action": "finalize", "reason": ""})
    assert missing.status_code == 400 and 'id="id_reason_error"' in missing.content.decode()
    assert client.post(action, {"action": "finalize", "reason": "month closed"}).status_code == 302
    october.refresh_from_db()
    assert october.status == InvoiceStatus.FINALIZED and october.number
    # Not allowed from finalized: finalize again -> 409 with the service's words.
    again = client.post(action, {"action": "finalize", "reason": "again"})
    assert again.status_code == 409
    assert client.post(action, {"action": "void", "reason": "billed twice"}).status_code == 302
    page = client.get(f"/finance/invoices/{october.pk}/").content.decode()
    assert "billed twice" in page and "month closed" in page and "fin" in page
    entries = AuditEntry.objects.filter(invoice=october).values_list(
        "action", "actor_label", "reason"
    )
    assert ("voided", "fin", "billed twice") in list(entries)
    csv_body = client.get("/finance/invoices/", {"period": "2026-10", "output": "csv"}).content
    assert b"FW-202610-" in csv_body


def test_reconciliation_page_highlights_and_explains_differences(
    tenant_a: Tenant, october: Invoice, finance: Any, version_70b: Any, browser_for: Any
) -> None:
    client = browser_for(finance)
    billing_services.invoice_finalize(
        invoice=october, actor=billing_services.Actor.system("test"), reason="close"
    )
    # Late usage after finalization: a difference with its cause.
    Usage.objects.filter(tenant=tenant_a).update(completion_tokens=1_300_000)
    page = client.get("/finance/reconciliation/", {"period": "2026-10"})
    assert page.status_code == 200
    body = page.content.decode()
    assert 'class="diff"' in body and "late events after finalization" in body
    assert "$0.80" in body  # 1M more completion tokens at 0.80 per million
    csv_body = client.get("/finance/reconciliation/", {"period": "2026-10", "output": "csv"})
    assert b"late events after finalization" in csv_body.content
    assert client.get("/finance/reconciliation/", {"period": "nope"}).status_code == 400


def test_finance_pages_say_when_stripe_sync_is_off(
    october: Invoice, finance: Any, browser_for: Any, settings: Any
) -> None:
    client = browser_for(finance)
    pages = ("/finance/invoices/", f"/finance/invoices/{october.pk}/")
    for url in pages:  # STRIPE_API_KEY is unset here (the autouse fixture)
        body = client.get(url).content.decode()
        assert 'data-testid="stripe-off"' in body and "Stripe sync is off" in body, url
    settings.STRIPE_API_KEY = "sk_test_on"
    for url in pages:
        body = client.get(url).content.decode()
        assert "stripe-off" not in body and "Stripe sync is off" not in body, url
