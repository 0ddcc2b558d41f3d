"""Stripe webhooks: verify the signature with the SDK's helper, apply each event once.

The event id is the primary key of ``StripeEvent``, inserted in the same transaction that
applies the event (the request's), so a redelivery — or two deliveries racing — applies
nothing the second time. Events for invoices we do not know are recorded and answered
200, so Stripe stops redelivering them.
"""

from __future__ import annotations

import logging
from typing import Any

import stripe
from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from billing import services
from billing.models import Invoice, InvoiceStatus, StripeEvent
from fairway.api_errors import error_body

log = logging.getLogger("fairway.billing.webhooks")

HANDLED = ("invoice.paid", "invoice.payment_failed", "invoice.voided")


def _error(status: int, code: str, message: str) -> JsonResponse:
    return JsonResponse(error_body(message=message, status_code=status, code=code), status=status)


def _find_invoice(obj: Any) -> Invoice | None:
    stripe_id = str(obj.get("id") or "")
    invoice = Invoice.objects.filter(stripe_invoice_id=stripe_id).first() if stripe_id else None
    if invoice is None:
        ours = (obj.get("metadata") or {}).get("fairway_invoice_id")
        if ours and str(ours).isdigit():
            invoice = Invoice.objects.filter(pk=int(ours), stripe_invoice_id=stripe_id).first()
    return invoice


def apply_event(event_id: str, event_type: str, obj: Any) -> tuple[Invoice | None, str]:
    invoice = _find_invoice(obj)
    if event_type not in HANDLED:
        return invoice, "ignored: not an event Fairway acts on"
    if invoice is None:
        return None, "ignored: no Fairway invoice has this Stripe id"
    actor = services.Actor.stripe(event_id)
    if event_type == "invoice.paid":
        if invoice.status == InvoiceStatus.PAID:
            return invoice, "already paid"
        if invoice.status != InvoiceStatus.FINALIZED:
            log.error("Stripe says %s is paid but it is %s here", invoice, invoice.status)
            return invoice, f"conflict: paid in Stripe but {invoice.status} here"
        services.invoice_mark_paid(
            invoice=invoice, actor=actor, reason="Stripe: invoice.paid", from_stripe=True
        )
        return invoice, "marked paid"
    if event_type == "invoice.voided":
        if invoice.status == InvoiceStatus.VOID:
            return invoice, "already void"
        if invoice.status != InvoiceStatus.FINALIZED:
            log.error("Stripe says %s is void but it is %s here", invoice, invoice.status)
            return invoice, f"conflict: void in Stripe but {invoice.status} here"
        services.invoice_void(
            invoice=invoice, actor=actor, reason="Stripe: invoice.voided", from_stripe=True
        )
        return invoice, "voided"
    # invoice.payment_failed
    if invoice.status != InvoiceStatus.FINALIZED:
        return invoice, f"ignored: invoice is {invoice.status}"
    services.invoice_record_payment_failed(
        invoice=invoice, actor=actor, reason="Stripe: invoice.payment_failed"
    )
    return invoice, "payment failure recorded"


@csrf_exempt
@require_POST
def stripe_webhook(request: HttpRequest) -> JsonResponse:
    secret = settings.STRIPE_WEBHOOK_SECRET
    if not secret:
        return _error(503, "webhooks_off", "Stripe webhooks are not configured here.")
    try:
        event = stripe.Webhook.construct_event(
            request.body, request.headers.get("Stripe-Signature"), secret
        )
    except stripe.SignatureVerificationError:
        return _error(400, "bad_signature", "The Stripe-Signature header does not verify.")
    except ValueError:
        return _error(400, "bad_payload", "The body is not a Stripe event.")
    event_id, event_type = str(event.id), str(event.type)
    obj = event.data.object.to_dict(recursive=True)
    with transaction.atomic():
        record, created = StripeEvent.objects.get_or_create(
            id=event_id, defaults={"type": event_type, "outcome": "processing"}
        )
        if not created:
            return JsonResponse({"received": True, "duplicate": True, "outcome": record.outcome})
        invoice, outcome = apply_event(event_id, event_type, obj)
        record.invoice = invoice
        record.outcome = outcome
        record.save(update_fields=["invoice", "outcome"])
    log.info("stripe event %s %s: %s", event_id, event_type, outcome)
    return JsonResponse({"received": True, "duplicate": False, "outcome": outcome})
