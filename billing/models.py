"""Invoices, their lines, the audit trail, the Stripe outbox and processed webhook events.

PostgreSQL is the source of truth for money; Stripe mirrors it. A finalized invoice never
changes: the services refuse, and triggers (migration 0002) refuse raw SQL too — only the
state (finalized -> paid | void), its timestamps and the Stripe ids may still be written.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import F, Q

MONEY = {"max_digits": 18, "decimal_places": 4}  # rounded amounts (minor units <= 4 places)
EXACT = {"max_digits": 30, "decimal_places": 12}  # tokens x price / 1e6, unrounded


class InvoiceStatus(models.TextChoices):
    DRAFT = "draft"
    FINALIZED = "finalized"
    PAID = "paid"
    VOID = "void"


# The only transitions there are; the database trigger holds the same table.
TRANSITIONS: dict[str, tuple[str, ...]] = {
    InvoiceStatus.DRAFT: (InvoiceStatus.FINALIZED,),
    InvoiceStatus.FINALIZED: (InvoiceStatus.PAID, InvoiceStatus.VOID),
    InvoiceStatus.PAID: (),
    InvoiceStatus.VOID: (),
}


class TokenType(models.TextChoices):
    PROMPT = "prompt", "uncached prompt tokens"
    CACHED = "cached_prompt", "cached prompt tokens"
    COMPLETION = "completion", "completion tokens"


class LineKind(models.TextChoices):
    USAGE = "usage"
    BASE_FEE = "base_fee"
    ADJUSTMENT = "adjustment"


class Invoice(models.Model):
    """One tenant's invoice for one UTC calendar month [period_start, period_end)."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    period_start = models.DateTimeField()
    period_end = models.DateTimeField()
    currency = models.CharField(max_length=3)
    status = models.CharField(
        max_length=16, choices=InvoiceStatus.choices, default=InvoiceStatus.DRAFT
    )
    number = models.CharField(max_length=32, blank=True, help_text="Assigned at finalization.")
    total = models.DecimalField(**MONEY, default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    refreshed_at = models.DateTimeField(null=True, blank=True)
    finalized_at = models.DateTimeField(null=True, blank=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    voided_at = models.DateTimeField(null=True, blank=True)
    payment_failed_at = models.DateTimeField(null=True, blank=True)
    stripe_invoice_id = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["-period_start", "tenant_id"]
        indexes = [models.Index(fields=["status", "period_start"], name="billing_inv_status")]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "period_start"],
                condition=~Q(status=InvoiceStatus.VOID),
                name="billing_invoice_one_live_per_period",
                violation_error_message="The tenant already has an invoice for this month.",
            ),
            models.UniqueConstraint(
                fields=["number"], condition=~Q(number=""), name="billing_invoice_number_unique"
            ),
            models.CheckConstraint(
                condition=Q(status__in=InvoiceStatus.values), name="billing_invoice_status_valid"
            ),
            models.CheckConstraint(
                condition=Q(period_end__gt=F("period_start")), name="billing_invoice_period"
            ),
            models.CheckConstraint(
                condition=Q(status=InvoiceStatus.DRAFT)
                | (Q(finalized_at__isnull=False) & ~Q(number="")),
                name="billing_invoice_finalized_has_number",
            ),
            models.CheckConstraint(
                condition=~Q(status=InvoiceStatus.PAID) | Q(paid_at__isnull=False),
                name="billing_invoice_paid_has_time",
            ),
            models.CheckConstraint(
                condition=~Q(status=InvoiceStatus.VOID) | Q(voided_at__isnull=False),
                name="billing_invoice_void_has_time",
            ),
        ]
        permissions = [
            ("view_reconciliation", "Can view billing reconciliation and all invoices"),
            ("manage_invoices", "Can finalize, mark paid and void invoices"),
        ]

    def __str__(self) -> str:
        return self.number or f"draft {self.tenant_id} {self.period_start:%Y-%m}"

    @property
    def period_label(self) -> str:
        return f"{self.period_start:%Y-%m}"


class InvoiceLine(models.Model):
    """One priced line. ``amount`` is ``round_line(amount_exact)``; the invoice total is
    the sum of ``amount``. Adjustment lines name the earlier period they correct and may
    be negative."""

    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    position = models.PositiveIntegerField()
    kind = models.CharField(max_length=16, choices=LineKind.choices)
    model_version = models.ForeignKey(
        "catalog.ModelVersion", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    token_type = models.CharField(max_length=16, choices=TokenType.choices, blank=True)
    tokens = models.BigIntegerField(default=0)
    unit_price_per_mtok = models.DecimalField(max_digits=12, decimal_places=6, default=0)
    amount_exact = models.DecimalField(**EXACT)
    amount = models.DecimalField(**MONEY)
    description = models.CharField(max_length=200)
    adjusts_period_start = models.DateTimeField(null=True, blank=True)
    stripe_item_id = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["invoice_id", "position"]
        constraints = [
            models.UniqueConstraint(fields=["invoice", "position"], name="billing_line_position"),
            models.CheckConstraint(
                condition=Q(kind__in=LineKind.values), name="billing_line_kind_valid"
            ),
            models.CheckConstraint(
                condition=~Q(kind=LineKind.USAGE)
                | (Q(tokens__gte=0) & Q(amount__gte=0) & Q(model_version__isnull=False)),
                name="billing_line_usage_non_negative",
            ),
            models.CheckConstraint(
                condition=Q(kind=LineKind.ADJUSTMENT, adjusts_period_start__isnull=False)
                | (~Q(kind=LineKind.ADJUSTMENT) & Q(adjusts_period_start__isnull=True)),
                name="billing_line_adjustment_dated",
            ),
        ]

    def __str__(self) -> str:
        return self.description


class AuditEntry(models.Model):
    """Append-only (a trigger refuses UPDATE and DELETE): who, when, why, before/after."""

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    invoice = models.ForeignKey(
        Invoice, null=True, blank=True, on_delete=models.PROTECT, related_name="audit"
    )
    action = models.CharField(max_length=40)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    actor_label = models.CharField(
        max_length=100, help_text="The user's name, 'system:<task>' or 'stripe:<event id>'."
    )
    reason = models.TextField(blank=True)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["at", "id"]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%dT%H:%M:%SZ} {self.action} by {self.actor_label}"


class OutboxKind(models.TextChoices):
    INVOICE_PUSH = "invoice_push"  # customer, invoice, one item per line, finalize
    INVOICE_VOID = "invoice_void"
    INVOICE_PAID = "invoice_paid_out_of_band"


class OutboxStatus(models.TextChoices):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"  # gave up after BILLING_OUTBOX_MAX_ATTEMPTS; reconciliation shows it
    SKIPPED = "skipped"  # Stripe sync off, or nothing left to do


class StripeOutbox(models.Model):
    """Stripe work written in the same transaction as the money change it mirrors and run
    after commit by ``billing.tasks.stripe_outbox_drain``. Every call it makes carries an
    idempotency key derived from this row's id and the step, so a retry of any step
    replays instead of duplicating."""

    kind = models.CharField(max_length=32, choices=OutboxKind.choices)
    invoice = models.ForeignKey(Invoice, on_delete=models.PROTECT, related_name="outbox")
    status = models.CharField(
        max_length=16, choices=OutboxStatus.choices, default=OutboxStatus.PENDING
    )
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    done_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]
        indexes = [
            models.Index(
                fields=["next_attempt_at"],
                condition=Q(status="pending"),
                name="billing_outbox_due",
            )
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=OutboxStatus.values), name="billing_outbox_status_valid"
            ),
            models.CheckConstraint(
                condition=Q(kind__in=OutboxKind.values), name="billing_outbox_kind_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"outbox {self.pk} {self.kind} {self.status}"

    def idempotency_key(self, step: str) -> str:
        return f"fairway-outbox-{self.pk}-{step}"


class StripeEvent(models.Model):
    """A webhook event applied once: its id is the primary key."""

    id = models.CharField(max_length=255, primary_key=True)
    type = models.CharField(max_length=100)
    received_at = models.DateTimeField(auto_now_add=True)
    invoice = models.ForeignKey(
        Invoice, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    outcome = models.CharField(max_length=200)

    class Meta:
        ordering = ["received_at"]

    def __str__(self) -> str:
        return f"{self.id} {self.type}"
