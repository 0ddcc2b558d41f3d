"""Writes for invoices: build and refresh drafts, finalize, mark paid, void.

Every state change and every adjustment writes an ``AuditEntry`` in the same transaction.
Stripe is never called here: a change Stripe must mirror writes a ``StripeOutbox`` row in
the same transaction, and the drain runs after commit (``billing.outbox``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from billing import stripe_sync
from billing.models import (
    TRANSITIONS,
    AuditEntry,
    Invoice,
    InvoiceLine,
    InvoiceStatus,
    LineKind,
    OutboxKind,
    OutboxStatus,
    StripeOutbox,
)
from billing.periods import month_start, next_month, period_label, previous_month
from billing.selectors import LineSpec, expected_lines
from tenants.models import Tenant

log = logging.getLogger("fairway.billing")


class InvoiceStateError(ValidationError):
    """A transition the state machine does not allow (the API answers 409)."""


@dataclass(frozen=True, slots=True)
class Actor:
    """Who changes money: a user, a periodic task, or a Stripe event."""

    label: str
    user: Any = None

    @classmethod
    def of_user(cls, user: Any) -> Actor:
        return cls(label=str(user.get_username()), user=user)

    @classmethod
    def system(cls, what: str) -> Actor:
        return cls(label=f"system:{what}")

    @classmethod
    def stripe(cls, event_id: str) -> Actor:
        return cls(label=f"stripe:{event_id}")


def _money(value: Decimal) -> str:
    return format(value.normalize(), "f") if value else "0"


def _snapshot(invoice: Invoice) -> dict[str, Any]:
    return {
        "status": invoice.status,
        "number": invoice.number,
        "total": _money(invoice.total),
        "currency": invoice.currency,
        "period": period_label(invoice.period_start),
        "lines": invoice.lines.count() if invoice.pk else 0,
    }


def _line_json(line: LineSpec) -> dict[str, Any]:
    return {
        "description": line.description,
        "tokens": line.tokens,
        "unit_price_per_mtok": _money(line.unit_price_per_mtok),
        "amount": _money(line.amount),
        "adjusts_period": period_label(line.adjusts_period_start)
        if line.adjusts_period_start
        else None,
    }


def _audit(
    *,
    tenant_id: Any,
    invoice: Invoice | None,
    action: str,
    actor: Actor,
    reason: str = "",
    before: Any = None,
    after: Any = None,
) -> AuditEntry:
    return AuditEntry.objects.create(
        tenant_id=tenant_id,
        invoice=invoice,
        action=action,
        actor=actor.user,
        actor_label=actor.label,
        reason=reason,
        before=before,
        after=after,
    )


def _spec_of(line: InvoiceLine) -> LineSpec:
    return LineSpec(
        kind=line.kind,
        description=line.description,
        amount_exact=line.amount_exact,
        amount=line.amount,
        model_version_id=line.model_version_id,
        token_type=line.token_type,
        tokens=line.tokens,
        unit_price_per_mtok=line.unit_price_per_mtok,
        adjusts_period_start=line.adjusts_period_start,
    )


def _adjustment_key(line: LineSpec) -> tuple[Any, ...]:
    return (line.adjusts_period_start, line.model_version_id, line.token_type)


def _write_lines(*, invoice: Invoice, actor: Actor, reason: str) -> bool:
    """Make a draft's lines what ``usage`` says now. Returns whether anything changed."""
    assert invoice.status == InvoiceStatus.DRAFT
    tenant = invoice.tenant
    if tenant.plan.currency != invoice.currency:
        raise ValidationError(
            f"The plan's currency is now {tenant.plan.currency}; "
            f"this month's draft is in {invoice.currency}. Switch currencies at a month "
            "boundary (after this draft is finalized)."
        )
    wanted = expected_lines(tenant=tenant, start=invoice.period_start)
    current = [_spec_of(line) for line in invoice.lines.order_by("position")]
    if [w.fingerprint() for w in wanted] == [c.fingerprint() for c in current]:
        return False
    before = _snapshot(invoice)
    old_adjustments = {_adjustment_key(c): c for c in current if c.kind == LineKind.ADJUSTMENT}
    invoice.lines.all().delete()
    InvoiceLine.objects.bulk_create(
        InvoiceLine(
            invoice=invoice,
            position=position,
            kind=spec.kind,
            model_version_id=spec.model_version_id,
            token_type=spec.token_type,
            tokens=spec.tokens,
            unit_price_per_mtok=spec.unit_price_per_mtok,
            amount_exact=spec.amount_exact,
            amount=spec.amount,
            description=spec.description,
            adjusts_period_start=spec.adjusts_period_start,
        )
        for position, spec in enumerate(wanted, start=1)
    )
    invoice.total = sum((spec.amount for spec in wanted), Decimal(0))
    invoice.save(update_fields=["total"])
    _audit(
        tenant_id=tenant.pk,
        invoice=invoice,
        action="draft_refreshed" if current else "draft_built",
        actor=actor,
        reason=reason,
        before=before if current else None,
        after=_snapshot(invoice),
    )
    for spec in wanted:
        if spec.kind != LineKind.ADJUSTMENT or spec.adjusts_period_start is None:
            continue
        old = old_adjustments.get(_adjustment_key(spec))
        if old is not None and old.fingerprint() == spec.fingerprint():
            continue
        _audit(
            tenant_id=tenant.pk,
            invoice=invoice,
            action="adjustment",
            actor=actor,
            reason=f"usage for {period_label(spec.adjusts_period_start)} differs from what "
            "was billed for it (late events, or a month never invoiced)",
            before=_line_json(old) if old else None,
            after=_line_json(spec),
        )
    return True


@transaction.atomic
def invoice_draft_build(
    *, tenant: Tenant, period_start: datetime, actor: Actor | None = None, reason: str = ""
) -> Invoice | None:
    """Create or refresh the tenant's draft for the month starting ``period_start``.

    A finalized, paid or void invoice for the month is returned untouched (it never
    changes). Returns None when there is nothing to invoice (no usage, fee or adjustment).
    """
    actor = actor or Actor.system("invoice_draft_build")
    start = month_start(period_start)
    if start != period_start:
        raise ValidationError({"period_start": "A billing period starts on the 1st, 00:00 UTC."})
    # One builder per tenant at a time: the lock makes "find or create" race-free.
    tenant = Tenant.objects.select_for_update().select_related("plan").get(pk=tenant.pk)
    invoice = (
        Invoice.objects.select_for_update()
        .filter(tenant=tenant, period_start=start)
        .exclude(status=InvoiceStatus.VOID)
        .first()
    )
    if invoice is not None and invoice.status != InvoiceStatus.DRAFT:
        return invoice
    if invoice is None:
        if not expected_lines(tenant=tenant, start=start):
            return None
        invoice = Invoice.objects.create(
            tenant=tenant,
            period_start=start,
            period_end=next_month(start),
            currency=tenant.plan.currency,
        )
    invoice.tenant = tenant
    _write_lines(invoice=invoice, actor=actor, reason=reason)
    invoice.refreshed_at = timezone.now()
    invoice.save(update_fields=["refreshed_at"])
    return invoice


def _transition(invoice: Invoice, to: str) -> None:
    if to not in TRANSITIONS[invoice.status]:
        raise InvoiceStateError(
            f"Invoice {invoice} is {invoice.status}; it cannot become {to}.", code="invalid_state"
        )


def _lock(invoice: Invoice) -> Invoice:
    return Invoice.objects.select_for_update().select_related("tenant__plan").get(pk=invoice.pk)


def _enqueue(invoice: Invoice, kind: str) -> StripeOutbox:
    """A Stripe job for after commit; with sync off it is recorded as skipped."""
    now = timezone.now()
    if stripe_sync.enabled():
        row = StripeOutbox.objects.create(kind=kind, invoice=invoice, next_attempt_at=now)
        from billing.tasks import stripe_outbox_drain

        transaction.on_commit(lambda: stripe_outbox_drain.delay())
        return row
    log.warning("Stripe sync is off (no STRIPE_API_KEY): %s for %s not sent", kind, invoice)
    return StripeOutbox.objects.create(
        kind=kind,
        invoice=invoice,
        status=OutboxStatus.SKIPPED,
        next_attempt_at=now,
        done_at=now,
        last_error="Stripe sync off (no STRIPE_API_KEY)",
    )


@transaction.atomic
def invoice_finalize(
    *, invoice: Invoice, actor: Actor, reason: str = "", now: datetime | None = None
) -> Invoice:
    """Refresh the draft one last time, then freeze it: number, total, lines. From here on
    late usage for the month goes onto the next invoice as an adjustment."""
    # Tenant first, then invoice: the same lock order as invoice_draft_build.
    Tenant.objects.select_for_update().filter(pk=invoice.tenant_id).first()
    invoice = _lock(invoice)
    _transition(invoice, InvoiceStatus.FINALIZED)
    now = now or timezone.now()
    if now < invoice.period_end:
        raise InvoiceStateError(
            f"{period_label(invoice.period_start)} is not over yet; it cannot be finalized.",
            code="period_open",
        )
    _write_lines(invoice=invoice, actor=actor, reason="refreshed at finalization")
    before = _snapshot(invoice)
    invoice.status = InvoiceStatus.FINALIZED
    invoice.finalized_at = now
    invoice.number = f"FW-{invoice.period_start:%Y%m}-{invoice.pk:06d}"
    invoice.save(update_fields=["status", "finalized_at", "number"])
    _audit(
        tenant_id=invoice.tenant_id,
        invoice=invoice,
        action="finalized",
        actor=actor,
        reason=reason,
        before=before,
        after=_snapshot(invoice),
    )
    _enqueue(invoice, OutboxKind.INVOICE_PUSH)
    return invoice


def _settle(
    *,
    invoice: Invoice,
    to: str,
    stamp: str,
    action: str,
    actor: Actor,
    reason: str,
    outbox: str | None,
) -> Invoice:
    """Move a finalized invoice to paid or void: the stamp, the audit row, and (unless
    Stripe told us) the outbox row that tells Stripe."""
    invoice = _lock(invoice)
    _transition(invoice, to)
    before = _snapshot(invoice)
    invoice.status = to
    setattr(invoice, stamp, timezone.now())
    invoice.save(update_fields=["status", stamp])
    _audit(
        tenant_id=invoice.tenant_id,
        invoice=invoice,
        action=action,
        actor=actor,
        reason=reason,
        before=before,
        after=_snapshot(invoice),
    )
    if outbox is not None:
        _enqueue(invoice, outbox)
    return invoice


@transaction.atomic
def invoice_mark_paid(
    *, invoice: Invoice, actor: Actor, reason: str = "", from_stripe: bool = False
) -> Invoice:
    """Paid. Unless Stripe told us, Stripe is told the invoice was paid out of band."""
    return _settle(
        invoice=invoice,
        to=InvoiceStatus.PAID,
        stamp="paid_at",
        action="paid",
        actor=actor,
        reason=reason,
        outbox=None if from_stripe else OutboxKind.INVOICE_PAID,
    )


@transaction.atomic
def invoice_void(
    *, invoice: Invoice, actor: Actor, reason: str, from_stripe: bool = False
) -> Invoice:
    """Cancel a finalized invoice (a reason is required). Its month is then not adjusted
    on later invoices: voiding is a decision, not a gap."""
    if not reason.strip():
        raise ValidationError({"reason": "Say why the invoice is voided."})
    return _settle(
        invoice=invoice,
        to=InvoiceStatus.VOID,
        stamp="voided_at",
        action="voided",
        actor=actor,
        reason=reason,
        outbox=None if from_stripe else OutboxKind.INVOICE_VOID,
    )


@transaction.atomic
def invoice_record_payment_failed(*, invoice: Invoice, actor: Actor, reason: str) -> Invoice:
    """Stripe could not collect: the invoice stays finalized (Stripe retries); noted."""
    invoice = _lock(invoice)
    if invoice.status != InvoiceStatus.FINALIZED:
        raise InvoiceStateError(
            f"Invoice {invoice} is {invoice.status}; a failed payment changes nothing.",
            code="invalid_state",
        )
    before = _snapshot(invoice) | {"payment_failed_at": None}
    invoice.payment_failed_at = timezone.now()
    invoice.save(update_fields=["payment_failed_at"])
    _audit(
        tenant_id=invoice.tenant_id,
        invoice=invoice,
        action="payment_failed",
        actor=actor,
        reason=reason,
        before=before,
        after=_snapshot(invoice) | {"payment_failed_at": invoice.payment_failed_at.isoformat()},
    )
    return invoice


def invoice_cycle(*, now: datetime | None = None, grace_s: int) -> dict[str, int]:
    """The periodic job: draft last month for tenants that have none yet, finalize every
    draft whose month ended more than ``grace_s`` ago (oldest first), then build or refresh
    this month's drafts. Each tenant is its own transaction, so one failure (logged)
    does not hold up the others."""
    now = now or timezone.now()
    current = month_start(now)
    previous = previous_month(current)
    counts = {"drafted": 0, "finalized": 0, "failed": 0}
    actor = Actor.system("invoice_cycle")

    def each_tenant(start: datetime) -> None:
        for tenant in Tenant.objects.select_related("plan").order_by("name"):
            try:
                if invoice_draft_build(tenant=tenant, period_start=start, actor=actor):
                    counts["drafted"] += 1
            except ValidationError:
                counts["failed"] += 1
                log.exception("draft for %s %s failed", tenant, period_label(start))

    each_tenant(previous)
    cutoff = now - timedelta(seconds=grace_s)
    for invoice in Invoice.objects.filter(
        status=InvoiceStatus.DRAFT, period_end__lte=cutoff
    ).order_by("period_start", "pk"):
        try:
            invoice_finalize(invoice=invoice, actor=actor, reason="month over", now=now)
            counts["finalized"] += 1
        except ValidationError:
            counts["failed"] += 1
            log.exception("finalizing %s failed", invoice)
    each_tenant(current)
    return counts
