"""Read-only admin views: money changes go through the services (and their audit rows),
never through admin forms."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from billing.models import AuditEntry, Invoice, InvoiceLine, StripeEvent, StripeOutbox


class ReadOnly(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest, *args: Any) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class InvoiceLineInline(admin.TabularInline):
    model = InvoiceLine
    extra = 0
    can_delete = False
    fields = (
        "position",
        "kind",
        "description",
        "tokens",
        "unit_price_per_mtok",
        "amount",
        "adjusts_period_start",
        "stripe_item_id",
    )
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Invoice)
class InvoiceAdmin(ReadOnly):
    list_display = (
        "__str__",
        "tenant",
        "period_start",
        "status",
        "total",
        "currency",
        "finalized_at",
        "paid_at",
        "stripe_invoice_id",
    )
    list_filter = ("status", "period_start")
    search_fields = ("number", "tenant__name", "stripe_invoice_id")
    inlines = [InvoiceLineInline]


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnly):
    list_display = ("at", "tenant", "invoice", "action", "actor_label", "reason")
    list_filter = ("action",)
    search_fields = ("tenant__name", "actor_label", "reason")


@admin.register(StripeOutbox)
class StripeOutboxAdmin(ReadOnly):
    list_display = ("pk", "kind", "invoice", "status", "attempts", "next_attempt_at", "last_error")
    list_filter = ("status", "kind")


@admin.register(StripeEvent)
class StripeEventAdmin(ReadOnly):
    list_display = ("id", "type", "received_at", "invoice", "outcome")
    list_filter = ("type",)
