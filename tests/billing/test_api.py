"""The invoice APIs: customers see their own tenant's invoices by role; finance needs staff
plus a billing permission; every endpoint is tenant-isolated."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.utils import timezone
from rest_framework.test import APIClient

from billing import services
from billing.models import AuditEntry, Invoice
from billing.periods import month_start
from catalog.models import ModelVersion
from tenants.models import Role, Tenant
from tests.billing.conftest import utc
from tests.controlplane.helpers import error_of

SEP = utc(2026, 9, 1)
OCT = utc(2026, 10, 1)
NOV = utc(2026, 11, 1)

pytestmark = pytest.mark.django_db


@pytest.fixture
def invoices(
    tenant_a: Tenant,
    tenant_b: Tenant,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
) -> dict[str, Invoice]:
    """tenant-a: September finalized (with a late event since) and October's draft carrying
    September's adjustment; tenant-b: October's draft. Both months are over."""
    add_usage(tenant_a, version_70b, utc(2026, 9, 5, 1), completion=1_000_000)
    sep_draft = services.invoice_draft_build(tenant=tenant_a, period_start=SEP)
    assert sep_draft is not None
    september = services.invoice_finalize(invoice=sep_draft, actor=services.Actor("t"), now=OCT)
    add_usage(tenant_a, version_70b, utc(2026, 9, 30, 23), completion=500_000)  # late
    add_usage(tenant_a, version_70b, utc(2026, 10, 5, 1), prompt=1_000_000)
    add_usage(tenant_b, version_70b, utc(2026, 10, 6, 1), prompt=3_000_000)
    oct_a = services.invoice_draft_build(tenant=tenant_a, period_start=OCT)
    oct_b = services.invoice_draft_build(tenant=tenant_b, period_start=OCT)
    assert oct_a is not None and oct_b is not None
    return {"sep_a": september, "oct_a": oct_a, "oct_b": oct_b}


def finance_user(make_user: Callable[..., Any], name: str, *perms: str, staff: bool = True) -> Any:
    user = make_user(name, is_staff=staff)
    for perm in perms:
        user.user_permissions.add(
            Permission.objects.get(codename=perm, content_type__app_label="billing")
        )
    return type(user).objects.get(pk=user.pk)  # fresh: no cached permissions


# -- customers ----------------------------------------------------------------------------


@pytest.mark.parametrize("role", [Role.OWNER, Role.ADMIN, Role.BILLING])
def test_invoice_readers_see_their_invoices_with_lines_and_adjustments(
    role: str,
    invoices: dict[str, Invoice],
    tenant_a: Tenant,
    member_of: Callable[[Tenant, str], Any],
    client_for: Callable[[Any], APIClient],
) -> None:
    client = client_for(member_of(tenant_a, role))
    resp = client.get(f"/api/v1/tenants/{tenant_a.pk}/invoices/")
    assert resp.status_code == 200
    body = resp.json()
    assert [(i["period"], i["status"]) for i in body] == [
        ("2026-10", "draft"),
        ("2026-09", "finalized"),
    ]
    draft = invoices["oct_a"]
    detail = client.get(f"/api/v1/tenants/{tenant_a.pk}/invoices/{draft.pk}/").json()
    assert detail["total"] == "1.00"  # 0.60 prompt + 0.40 September adjustment
    assert [(ln["token_type"], ln["tokens"], ln["amount"]) for ln in detail["lines"]] == [
        ("prompt", 1_000_000, "0.60")
    ]
    assert [
        (ln["adjusts_period"], ln["tokens"], ln["amount"], ln["model_version"])
        for ln in detail["adjustments"]
    ] == [("2026-09", 500_000, "0.40", "llama-70b-2026-05")]
    sep = client.get(f"/api/v1/tenants/{tenant_a.pk}/invoices/{invoices['sep_a'].pk}/")
    assert sep.json()["number"] == invoices["sep_a"].number
    assert sep.json()["total"] == "0.80"


def test_plain_member_is_refused(
    invoices: dict[str, Invoice],
    tenant_a: Tenant,
    member_of: Callable[[Tenant, str], Any],
    client_for: Callable[[Any], APIClient],
) -> None:
    client = client_for(member_of(tenant_a, Role.MEMBER))
    listing = client.get(f"/api/v1/tenants/{tenant_a.pk}/invoices/")
    assert listing.status_code == 403
    assert error_of(listing)["type"] == "permission_error"
    detail = client.get(f"/api/v1/tenants/{tenant_a.pk}/invoices/{invoices['oct_a'].pk}/")
    assert detail.status_code == 403


def test_other_tenants_invoices_are_404(
    invoices: dict[str, Invoice],
    tenant_a: Tenant,
    tenant_b: Tenant,
    owner_a: Any,
    client_for: Callable[[Any], APIClient],
) -> None:
    client = client_for(owner_a)
    b_invoice = invoices["oct_b"].pk
    # Tenant B's list and detail: B does not exist for A's owner.
    for path in (
        f"/api/v1/tenants/{tenant_b.pk}/invoices/",
        f"/api/v1/tenants/{tenant_b.pk}/invoices/{b_invoice}/",
        # B's invoice id under A's own tenant path is not found either.
        f"/api/v1/tenants/{tenant_a.pk}/invoices/{b_invoice}/",
        f"/api/v1/tenants/{tenant_a.pk}/invoices/999999/",
    ):
        resp = client.get(path)
        assert resp.status_code == 404, path
        assert error_of(resp)["type"] == "not_found_error"
    # Customers have no finance endpoints.
    assert client.get("/api/v1/billing/invoices/").status_code == 403
    assert APIClient().get(f"/api/v1/tenants/{tenant_a.pk}/invoices/").status_code == 401


# -- finance ------------------------------------------------------------------------------


def test_finance_endpoints_need_staff_and_the_permission(
    invoices: dict[str, Invoice],
    make_user: Callable[..., Any],
    operator: Any,
    plain_staff: Any,
    client_for: Callable[[Any], APIClient],
) -> None:
    nov = invoices["oct_a"].pk
    not_staff = finance_user(
        make_user, "clerk", "view_reconciliation", "manage_invoices", staff=False
    )
    viewer = finance_user(make_user, "viewer", "view_reconciliation")
    # Staff alone is not finance, nor is an operator; a permission without staff neither.
    for user in (plain_staff, operator, not_staff):
        client = client_for(user)
        assert client.get("/api/v1/billing/invoices/").status_code == 403
        assert client.get("/api/v1/billing/reconciliation/?period=2026-11").status_code == 403
        resp = client.post(
            f"/api/v1/billing/invoices/{nov}/finalize/", {"reason": "x"}, format="json"
        )
        assert resp.status_code == 403
    viewer_client = client_for(viewer)
    assert viewer_client.get("/api/v1/billing/invoices/").status_code == 200
    resp = viewer_client.post(
        f"/api/v1/billing/invoices/{nov}/finalize/", {"reason": "x"}, format="json"
    )
    assert resp.status_code == 403  # viewing is not managing
    assert Invoice.objects.get(pk=nov).status == "draft"


def test_finance_lists_across_tenants_and_moves_invoices_with_reasons(
    invoices: dict[str, Invoice],
    make_user: Callable[..., Any],
    client_for: Callable[[Any], APIClient],
    tenant_b: Tenant,
) -> None:
    user = finance_user(make_user, "finance", "view_reconciliation", "manage_invoices")
    client = client_for(user)
    everything = client.get("/api/v1/billing/invoices/").json()
    assert len(everything) == 3
    drafts = client.get("/api/v1/billing/invoices/?status=draft&period=2026-10").json()
    assert {i["tenant_id"] for i in drafts} == {
        str(t) for t in Invoice.objects.filter(status="draft").values_list("tenant_id", flat=True)
    }
    only_b = client.get(f"/api/v1/billing/invoices/?tenant={tenant_b.pk}").json()
    assert [i["id"] for i in only_b] == [invoices["oct_b"].pk]
    bad = client.get("/api/v1/billing/invoices/?period=2026-13")
    assert bad.status_code == 400 and error_of(bad)["param"] == "period"
    assert client.get("/api/v1/billing/invoices/?status=lost").status_code == 400

    oct_b = invoices["oct_b"].pk
    # A reason is required.
    missing = client.post(f"/api/v1/billing/invoices/{oct_b}/finalize/", {}, format="json")
    assert missing.status_code == 400 and error_of(missing)["param"] == "reason"
    final = client.post(
        f"/api/v1/billing/invoices/{oct_b}/finalize/", {"reason": "closing October"}, format="json"
    )
    assert final.status_code == 200, final.json()
    assert final.json()["status"] == "finalized" and final.json()["number"]
    again = client.post(
        f"/api/v1/billing/invoices/{oct_b}/finalize/", {"reason": "twice"}, format="json"
    )
    assert again.status_code == 409 and error_of(again)["code"] == "invalid_state"
    oct_id = oct_b
    paid = client.post(
        f"/api/v1/billing/invoices/{oct_id}/mark-paid/", {"reason": "wire 42"}, format="json"
    )
    assert paid.status_code == 200 and paid.json()["status"] == "paid"
    assert paid.json()["outbox"][-1]["status"] == "skipped"  # Stripe sync off here
    void = client.post(
        f"/api/v1/billing/invoices/{oct_id}/void/", {"reason": "oops"}, format="json"
    )
    assert void.status_code == 409 and error_of(void)["code"] == "invalid_state"
    audit = AuditEntry.objects.filter(invoice_id=oct_id, action="paid").get()
    assert (audit.actor_id, audit.actor_label, audit.reason) == (user.pk, "finance", "wire 42")
    assert client.get("/api/v1/billing/invoices/999999/").status_code == 404


def test_finance_void_with_reason(
    invoices: dict[str, Invoice],
    make_user: Callable[..., Any],
    client_for: Callable[[Any], APIClient],
) -> None:
    client = client_for(finance_user(make_user, "fin2", "view_reconciliation", "manage_invoices"))
    oct_id = invoices["sep_a"].pk
    blank = client.post(f"/api/v1/billing/invoices/{oct_id}/void/", {"reason": ""}, format="json")
    assert blank.status_code == 400
    resp = client.post(
        f"/api/v1/billing/invoices/{oct_id}/void/",
        {"reason": "billed the wrong entity"},
        format="json",
    )
    assert resp.status_code == 200 and resp.json()["status"] == "void"
    assert resp.json()["voided_at"] is not None


def test_reconciliation_api_json_and_csv(
    invoices: dict[str, Invoice],
    make_user: Callable[..., Any],
    client_for: Callable[[Any], APIClient],
    tenant_a: Tenant,
) -> None:
    client = client_for(finance_user(make_user, "auditor", "view_reconciliation"))
    resp = client.get(f"/api/v1/billing/reconciliation/?period=2026-09&tenant={tenant_a.pk}")
    assert resp.status_code == 200
    body = resp.json()
    # The late September event: usage holds more than October's invoice billed.
    (diff,) = [d for d in body["differences"] if d["check"] == "usage/invoices"]
    assert Decimal(diff["amount"]) == Decimal("0.40")
    assert diff["cause"].startswith("late events after finalization")
    csv_resp = client.get("/api/v1/billing/reconciliation/?period=2026-09&output=csv")
    assert csv_resp.status_code == 200
    assert csv_resp["Content-Type"].startswith("text/csv")
    assert "reconciliation-2026-09.csv" in csv_resp["Content-Disposition"]
    assert "late events after finalization" in csv_resp.content.decode()
    for bad in ("period=2026-1", "", "period=2026-10&output=xml", "period=2026-10&tenant=nope"):
        r = client.get(f"/api/v1/billing/reconciliation/?{bad}")
        assert r.status_code == 400, bad


def test_finalizing_a_month_that_is_not_over_is_a_conflict(
    tenant_a: Tenant,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
    make_user: Callable[..., Any],
    client_for: Callable[[Any], APIClient],
) -> None:
    current = month_start(timezone.now())
    add_usage(tenant_a, version_70b, current, completion=1)
    draft = services.invoice_draft_build(tenant=tenant_a, period_start=current)
    assert draft is not None
    client = client_for(finance_user(make_user, "fin3", "manage_invoices"))
    resp = client.post(
        f"/api/v1/billing/invoices/{draft.pk}/finalize/", {"reason": "early"}, format="json"
    )
    assert resp.status_code == 409 and error_of(resp)["code"] == "period_open"


def test_admin_pages_are_read_only(
    invoices: dict[str, Invoice], make_user: Callable[..., Any]
) -> None:
    from django.test import Client

    client = Client()
    client.force_login(make_user("root", is_staff=True, is_superuser=True))
    sep = invoices["sep_a"]
    for url in (
        "/admin/billing/invoice/",
        f"/admin/billing/invoice/{sep.pk}/change/",
        "/admin/billing/auditentry/",
        "/admin/billing/stripeoutbox/",
        "/admin/billing/stripeevent/",
    ):
        assert client.get(url).status_code == 200, url
    assert sep.number.encode() in client.get("/admin/billing/invoice/").content
    assert client.get("/admin/billing/invoice/add/").status_code == 403
    assert (
        client.post(f"/admin/billing/invoice/{sep.pk}/delete/", {"post": "yes"}).status_code == 403
    )
    assert Invoice.objects.filter(pk=sep.pk).exists()
