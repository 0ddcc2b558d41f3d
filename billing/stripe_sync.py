"""Everything that talks to Stripe: the client (SDK and API version pinned together here),
and the steps one outbox row runs.

Our PostgreSQL invoice is the source of truth; Stripe gets a copy at finalization: a
customer per tenant, one draft Stripe invoice per Fairway invoice, one invoice item per
line (adjustments included, negative amounts allowed), then finalize. Each step records
the Stripe id it got back before the next one starts, and each call carries an
idempotency key derived from the outbox row and the step (``fairway-outbox-<id>-<step>``),
so a retry after a 500 or a timeout replays the first request instead of repeating it.
"""

from __future__ import annotations

import logging
from typing import Any

import stripe
from django.conf import settings
from django.db import transaction

from billing.models import Invoice, InvoiceLine, InvoiceStatus, OutboxKind, StripeOutbox
from billing.periods import period_label
from billing.pricing import to_minor_units
from tenants.models import Tenant

log = logging.getLogger("fairway.billing.stripe")

# The SDK pinned in pyproject.toml (stripe==16.1.0) is generated against exactly this API
# version; the two move together (tests.billing.test_stripe_sync checks they agree).
STRIPE_SDK_VERSION = "16.1.0"
STRIPE_API_VERSION = "2026-10-28.endive"
# Stripe keeps idempotency keys for 24 h; our retries back off to at most an hour, and a
# step that is replayed after that is recognised from the object's state instead.


class StripeSyncOff(RuntimeError):
    pass


def enabled() -> bool:
    return bool(settings.STRIPE_API_KEY)


def log_sync_mode() -> None:
    if not enabled():
        log.warning(
            "Stripe sync is OFF (STRIPE_API_KEY is not set): invoices are built and "
            "finalized here, nothing is sent to Stripe, outbox rows are marked skipped."
        )


def client() -> stripe.StripeClient:
    if not enabled():
        raise StripeSyncOff("STRIPE_API_KEY is not set")
    base: dict[str, str] = {}
    if settings.STRIPE_API_BASE:
        base = {"api": settings.STRIPE_API_BASE.rstrip("/")}
    return stripe.StripeClient(
        api_key=settings.STRIPE_API_KEY,
        stripe_version=STRIPE_API_VERSION,
        base_addresses=base,  # type: ignore[arg-type]
        # Retries are the outbox's (with backoff, surviving restarts), not the SDK's.
        max_network_retries=0,
        http_client=stripe.HTTPXClient(
            timeout=settings.STRIPE_TIMEOUT_MS / 1000, allow_sync_methods=True
        ),
    )


def _options(row: StripeOutbox, step: str) -> Any:
    return {"idempotency_key": row.idempotency_key(step)}


# -- steps --------------------------------------------------------------------------------


def _ensure_customer(sc: stripe.StripeClient, row: StripeOutbox, tenant_id: Any) -> str:
    with transaction.atomic():
        # The tenant row lock makes concurrent pushes for one tenant agree on one customer.
        tenant = Tenant.objects.select_for_update().get(pk=tenant_id)
        if tenant.stripe_customer_id:
            return tenant.stripe_customer_id
        params: Any = {"name": tenant.name, "metadata": {"fairway_tenant_id": str(tenant.pk)}}
        if tenant.billing_email:
            params["email"] = tenant.billing_email
        customer = sc.v1.customers.create(
            params=params,
            options=_options(row, "customer"),
        )
        # update(), not save(): a Stripe id is not configuration the gateway needs pushed.
        Tenant.objects.filter(pk=tenant.pk).update(stripe_customer_id=customer.id)
        return str(customer.id)


def _ensure_invoice(sc: stripe.StripeClient, row: StripeOutbox, invoice: Invoice) -> str:
    if invoice.stripe_invoice_id:
        return invoice.stripe_invoice_id
    customer_id = _ensure_customer(sc, row, invoice.tenant_id)
    remote = sc.v1.invoices.create(
        params={
            "customer": customer_id,
            "currency": invoice.currency,
            "auto_advance": False,
            "collection_method": "send_invoice",
            "days_until_due": 30,
            "pending_invoice_items_behavior": "exclude",
            "description": f"Fairway usage {period_label(invoice.period_start)}",
            "metadata": {
                "fairway_invoice_id": str(invoice.pk),
                "fairway_invoice_number": invoice.number,
                "period": period_label(invoice.period_start),
            },
        },
        options=_options(row, "invoice"),
    )
    with transaction.atomic():  # a savepoint: a failed write leaves the drain's row usable
        Invoice.objects.filter(pk=invoice.pk).update(stripe_invoice_id=remote.id)
    invoice.stripe_invoice_id = str(remote.id)
    return invoice.stripe_invoice_id


def _push_line(
    sc: stripe.StripeClient, row: StripeOutbox, invoice: Invoice, line: InvoiceLine
) -> None:
    tenant = Tenant.objects.only("stripe_customer_id").get(pk=invoice.tenant_id)
    item = sc.v1.invoice_items.create(
        params={
            "customer": tenant.stripe_customer_id,
            "invoice": invoice.stripe_invoice_id,
            "amount": to_minor_units(line.amount, invoice.currency),
            "currency": invoice.currency,
            "description": line.description,
            "metadata": {
                "fairway_invoice_id": str(invoice.pk),
                "fairway_line_id": str(line.pk),
                "kind": line.kind,
            },
        },
        options=_options(row, f"item-{line.pk}"),
    )
    with transaction.atomic():
        InvoiceLine.objects.filter(pk=line.pk, stripe_item_id="").update(stripe_item_id=item.id)


def _finalize_remote(sc: stripe.StripeClient, row: StripeOutbox, invoice: Invoice) -> None:
    try:
        sc.v1.invoices.finalize_invoice(
            invoice.stripe_invoice_id,
            params={"auto_advance": False},
            options=_options(row, "finalize"),
        )
    except stripe.InvalidRequestError:
        # A replay after the key expired: fine if Stripe already holds it finalized.
        remote = sc.v1.invoices.retrieve(invoice.stripe_invoice_id)
        if remote.status == "draft":
            raise


def push_invoice(sc: stripe.StripeClient, row: StripeOutbox) -> str:
    invoice = Invoice.objects.get(pk=row.invoice_id)
    if invoice.status == InvoiceStatus.VOID and not invoice.stripe_invoice_id:
        return "voided before it reached Stripe: nothing sent"
    _ensure_invoice(sc, row, invoice)
    for line in invoice.lines.filter(stripe_item_id="").order_by("position"):
        _push_line(sc, row, invoice, line)
    _finalize_remote(sc, row, invoice)
    return f"in Stripe as {invoice.stripe_invoice_id}"


def void_invoice(sc: stripe.StripeClient, row: StripeOutbox) -> str:
    invoice = Invoice.objects.get(pk=row.invoice_id)
    if not invoice.stripe_invoice_id:
        return "never reached Stripe: nothing to void"
    remote = sc.v1.invoices.retrieve(invoice.stripe_invoice_id)
    if remote.status == "void":
        return "already void in Stripe"
    sc.v1.invoices.void_invoice(invoice.stripe_invoice_id, options=_options(row, "void"))
    return "voided in Stripe"


def mark_paid(sc: stripe.StripeClient, row: StripeOutbox) -> str:
    invoice = Invoice.objects.get(pk=row.invoice_id)
    if not invoice.stripe_invoice_id:
        return "never reached Stripe: nothing to mark paid"
    remote = sc.v1.invoices.retrieve(invoice.stripe_invoice_id)
    if remote.status == "paid":
        return "already paid in Stripe"
    sc.v1.invoices.pay(
        invoice.stripe_invoice_id,
        params={"paid_out_of_band": True},
        options=_options(row, "pay"),
    )
    return "marked paid out of band in Stripe"


STEPS = {
    OutboxKind.INVOICE_PUSH: push_invoice,
    OutboxKind.INVOICE_VOID: void_invoice,
    OutboxKind.INVOICE_PAID: mark_paid,
}


def run(sc: stripe.StripeClient, row: StripeOutbox) -> str:
    """Run one outbox row's steps; raises on any failure (the drain retries later)."""
    return STEPS[OutboxKind(row.kind)](sc, row)


def list_invoice_items(sc: stripe.StripeClient, stripe_invoice_id: str) -> list[Any]:
    """Every invoice item Stripe holds for one invoice (all pages)."""
    page = sc.v1.invoice_items.list(params={"invoice": stripe_invoice_id, "limit": 100})
    return list(page.auto_paging_iter())
