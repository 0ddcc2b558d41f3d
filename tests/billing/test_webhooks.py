"""Stripe webhooks over real HTTP: the fake signs and posts events to our endpoint served
by a live server; bad signatures are refused, good events are applied exactly once."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from billing import outbox, services
from billing.models import AuditEntry, Invoice, StripeEvent
from billing.testing.stripe_fake import StripeFake, sign
from catalog.models import ModelVersion
from tenants.models import Tenant
from tests.billing.conftest import WEBHOOK_SECRET, utc

NOV = utc(2026, 11, 1)
DEC = utc(2026, 12, 1)
PATH = "/api/v1/billing/stripe/webhook"


@pytest.fixture
def pushed(
    tenant_a: Tenant,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
    stripe_fake: StripeFake,
) -> Invoice:
    add_usage(tenant_a, version_70b, utc(2026, 11, 10, 12), completion=1_000_000)
    draft = services.invoice_draft_build(tenant=tenant_a, period_start=NOV)
    assert draft is not None
    invoice = services.invoice_finalize(invoice=draft, actor=services.Actor("t"), now=DEC)
    outbox.drain()  # already drained after commit (eager Celery in tests); harmless again
    assert invoice.outbox.get().status == "done"
    invoice.refresh_from_db()
    return invoice


@pytest.mark.django_db(transaction=True)
def test_bad_signatures_are_refused(
    live_server: Any, pushed: Invoice, stripe_fake: StripeFake
) -> None:
    url = live_server.url + PATH
    remote = stripe_fake.pay_invoice(pushed.stripe_invoice_id)
    # Signed with another secret.
    resp = stripe_fake.send_webhook(url, "whsec_wrong", "invoice.paid", remote)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "bad_signature"
    # No header, a tampered body, a stale timestamp.
    body = json.dumps(
        {"id": "evt_x", "object": "event", "type": "invoice.paid", "data": {"object": remote}}
    )
    assert httpx.post(url, content=body).status_code == 400
    tampered = httpx.post(
        url,
        content=body.replace("invoice.paid", "invoice.voided"),
        headers={"Stripe-Signature": sign(body, WEBHOOK_SECRET)},
    )
    assert tampered.status_code == 400
    stale = httpx.post(
        url, content=body, headers={"Stripe-Signature": sign(body, WEBHOOK_SECRET, 1_000_000)}
    )
    assert stale.status_code == 400
    pushed.refresh_from_db()
    assert pushed.status == "finalized"
    assert not StripeEvent.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_paid_event_applied_once_when_delivered_twice(
    live_server: Any, pushed: Invoice, stripe_fake: StripeFake
) -> None:
    url = live_server.url + PATH
    remote = stripe_fake.pay_invoice(pushed.stripe_invoice_id)
    first = stripe_fake.send_webhook(
        url, WEBHOOK_SECRET, "invoice.paid", remote, event_id="evt_paid_1"
    )
    assert first.status_code == 200, first.text
    assert first.json() == {"received": True, "duplicate": False, "outcome": "marked paid"}
    again = stripe_fake.send_webhook(
        url, WEBHOOK_SECRET, "invoice.paid", remote, event_id="evt_paid_1"
    )
    assert again.status_code == 200 and again.json()["duplicate"] is True
    pushed.refresh_from_db()
    assert pushed.status == "paid"
    paid = AuditEntry.objects.filter(invoice=pushed, action="paid")
    assert [(a.actor_label, a.reason) for a in paid] == [
        ("stripe:evt_paid_1", "Stripe: invoice.paid")
    ]
    # Stripe told us, so nothing goes back to Stripe.
    assert not pushed.outbox.filter(kind="invoice_paid_out_of_band").exists()
    # A different event saying the same thing is harmless.
    third = stripe_fake.send_webhook(url, WEBHOOK_SECRET, "invoice.paid", remote)
    assert third.json()["outcome"] == "already paid"
    assert AuditEntry.objects.filter(invoice=pushed, action="paid").count() == 1


@pytest.mark.django_db(transaction=True)
def test_payment_failed_and_voided_events(
    live_server: Any, pushed: Invoice, stripe_fake: StripeFake
) -> None:
    url = live_server.url + PATH
    remote = dict(stripe_fake.state.invoices[pushed.stripe_invoice_id])
    failed = stripe_fake.send_webhook(url, WEBHOOK_SECRET, "invoice.payment_failed", remote)
    assert failed.json()["outcome"] == "payment failure recorded"
    pushed.refresh_from_db()
    assert pushed.status == "finalized" and pushed.payment_failed_at is not None
    remote["status"] = "void"
    voided = stripe_fake.send_webhook(url, WEBHOOK_SECRET, "invoice.voided", remote)
    assert voided.json()["outcome"] == "voided"
    pushed.refresh_from_db()
    assert pushed.status == "void"
    assert list(AuditEntry.objects.filter(invoice=pushed).values_list("action", flat=True))[
        -2:
    ] == ["payment_failed", "voided"]
    # Events for invoices that are not ours are acknowledged and recorded, not applied.
    other = stripe_fake.send_webhook(url, WEBHOOK_SECRET, "invoice.paid", {"id": "in_other"})
    assert other.status_code == 200 and other.json()["outcome"].startswith("ignored")
    assert StripeEvent.objects.count() == 3


@pytest.mark.django_db
def test_webhooks_off_without_a_secret(client: Any, settings: Any) -> None:
    settings.STRIPE_WEBHOOK_SECRET = ""
    resp = client.post(PATH, data="{}", content_type="application/json")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "webhooks_off"
    assert client.get(PATH).status_code == 405
