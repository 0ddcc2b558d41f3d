"""Billing API: customers' invoices (scoped to their tenant and role), finance's invoice
desk and reconciliation (staff holding a finance permission), and the Stripe webhook
(``billing.webhooks``).

Customers: owners, admins and billing members see their tenant's invoices; a plain member
gets 403; anyone outside the tenant gets 404 (as for every tenant resource).
Finance: ``billing.view_reconciliation`` to list invoices across tenants and reconcile,
``billing.manage_invoices`` to finalize, mark paid or void (with a reason). Being staff
is not enough.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any
from uuid import UUID

from django.core.exceptions import PermissionDenied
from django.http import HttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from billing import selectors, services
from billing.models import Invoice, InvoiceStatus
from billing.periods import parse_period, period_label
from billing.pricing import round_line
from billing.reconciliation import reconcile
from fairway.api_errors import Conflict
from tenants import selectors as tenant_selectors
from tenants.models import Role, Tenant

INVOICE_READERS = (Role.OWNER, Role.ADMIN, Role.BILLING)
VIEW_FINANCE = "billing.view_reconciliation"
MANAGE_INVOICES = "billing.manage_invoices"


class LineOutput(serializers.Serializer):
    position = serializers.IntegerField()
    kind = serializers.CharField()
    description = serializers.CharField()
    model_version = serializers.CharField(source="model_version.name", default=None)
    token_type = serializers.CharField()
    tokens = serializers.IntegerField()
    unit_price_per_mtok = serializers.DecimalField(max_digits=12, decimal_places=6)
    amount = serializers.SerializerMethodField()
    adjusts_period = serializers.SerializerMethodField()

    def get_amount(self, line: Any) -> str:
        return _fmt(line.amount, line.invoice.currency)

    def get_adjusts_period(self, line: Any) -> str | None:
        return period_label(line.adjusts_period_start) if line.adjusts_period_start else None


def _fmt(amount: Any, currency: str) -> str:
    """Stored amounts carry 4 places; show them in the currency's minor unit."""
    return format(round_line(amount, currency), "f")


class InvoiceOutput(serializers.Serializer):
    id = serializers.IntegerField()
    number = serializers.CharField()
    tenant_id = serializers.UUIDField()
    period = serializers.CharField(source="period_label")
    period_start = serializers.DateTimeField()
    period_end = serializers.DateTimeField()
    status = serializers.CharField()
    currency = serializers.CharField()
    total = serializers.SerializerMethodField()
    finalized_at = serializers.DateTimeField(allow_null=True)
    paid_at = serializers.DateTimeField(allow_null=True)
    voided_at = serializers.DateTimeField(allow_null=True)
    payment_failed_at = serializers.DateTimeField(allow_null=True)

    def get_total(self, invoice: Invoice) -> str:
        return _fmt(invoice.total, invoice.currency)


class InvoiceDetailOutput(InvoiceOutput):
    lines = serializers.SerializerMethodField()
    adjustments = serializers.SerializerMethodField()

    def _lines(self, invoice: Invoice) -> list[Any]:
        cached = getattr(invoice, "_lines_cache", None)
        if cached is None:
            cached = list(selectors.invoice_lines(invoice=invoice))
            invoice._lines_cache = cached
        return cached

    def get_lines(self, invoice: Invoice) -> Any:
        return LineOutput(
            [ln for ln in self._lines(invoice) if ln.kind != "adjustment"], many=True
        ).data

    def get_adjustments(self, invoice: Invoice) -> Any:
        return LineOutput(
            [ln for ln in self._lines(invoice) if ln.kind == "adjustment"], many=True
        ).data


class FinanceInvoiceOutput(InvoiceDetailOutput):
    tenant = serializers.CharField(source="tenant.name")
    stripe_invoice_id = serializers.CharField()
    outbox = serializers.SerializerMethodField()

    def get_outbox(self, invoice: Invoice) -> list[dict[str, Any]]:
        return [
            {
                "id": row.pk,
                "kind": row.kind,
                "status": row.status,
                "attempts": row.attempts,
                "last_error": row.last_error,
            }
            for row in selectors.outbox_for_invoice(invoice=invoice)
        ]


# -- customers ----------------------------------------------------------------------------


def _customer_access(request: Request, tenant_id: UUID) -> Tenant:
    access = tenant_selectors.tenant_access(user=request.user, tenant_id=tenant_id)
    access.require(INVOICE_READERS, "see invoices")
    return access.tenant


class TenantInvoiceListApi(APIView):
    @extend_schema(responses=InvoiceOutput(many=True))
    def get(self, request: Request, tenant_id: UUID) -> Response:
        tenant = _customer_access(request, tenant_id)
        return Response(InvoiceOutput(selectors.invoice_list(tenant=tenant), many=True).data)


class TenantInvoiceDetailApi(APIView):
    @extend_schema(responses=InvoiceDetailOutput)
    def get(self, request: Request, tenant_id: UUID, invoice_id: int) -> Response:
        tenant = _customer_access(request, tenant_id)
        invoice = selectors.invoice_get(invoice_id=invoice_id, tenant=tenant)
        return Response(InvoiceDetailOutput(invoice).data)


# -- finance ------------------------------------------------------------------------------


def _require(request: Request, perm: str) -> None:
    user = request.user
    if not (user.is_staff and user.is_active and user.has_perm(perm)):
        raise PermissionDenied(f"This needs a staff account with the {perm} permission.")


def _period(value: str | None, *, required: bool) -> datetime | None:
    if not value:
        if required:
            raise serializers.ValidationError({"period": ["Give the month as YYYY-MM."]})
        return None
    try:
        return parse_period(value)
    except ValueError as exc:
        raise serializers.ValidationError({"period": [str(exc)]}) from None


def _tenant_param(value: str | None) -> Tenant | None:
    if not value:
        return None
    try:
        return Tenant.objects.select_related("plan").get(pk=UUID(value))
    except (ValueError, Tenant.DoesNotExist):
        raise serializers.ValidationError({"tenant": [f"No tenant '{value}'."]}) from None


class FinanceInvoiceListApi(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("status", str, enum=InvoiceStatus.values),
            OpenApiParameter("period", str, description="YYYY-MM"),
            OpenApiParameter("tenant", str, description="tenant id"),
        ],
        responses=InvoiceOutput(many=True),
    )
    def get(self, request: Request) -> Response:
        _require(request, VIEW_FINANCE)
        status = request.query_params.get("status") or None
        if status and status not in InvoiceStatus.values:
            raise serializers.ValidationError(
                {
                    "status": [
                        f"Unknown status '{status}'; one of {', '.join(InvoiceStatus.values)}."
                    ]
                }
            )
        invoices = selectors.invoice_list(
            tenant=_tenant_param(request.query_params.get("tenant")),
            status=status,
            period_start=_period(request.query_params.get("period"), required=False),
        )
        return Response(InvoiceOutput(invoices, many=True).data)


class FinanceInvoiceDetailApi(APIView):
    @extend_schema(responses=FinanceInvoiceOutput)
    def get(self, request: Request, invoice_id: int) -> Response:
        _require(request, VIEW_FINANCE)
        return Response(FinanceInvoiceOutput(selectors.invoice_get(invoice_id=invoice_id)).data)


class ReasonInput(serializers.Serializer):
    reason = serializers.CharField(max_length=2000, allow_blank=False)


class _FinanceActionApi(APIView):
    """POST {"reason": …}: one state change by a finance user, 409 when not allowed."""

    # The service that makes the change; each subclass names its own.
    service: Callable[..., Invoice] = services.invoice_finalize

    @extend_schema(request=ReasonInput, responses=FinanceInvoiceOutput)
    def post(self, request: Request, invoice_id: int) -> Response:
        _require(request, MANAGE_INVOICES)
        if not isinstance(request.data, dict):
            raise serializers.ValidationError({"non_field_errors": ["Send a JSON object."]})
        data = ReasonInput(data=request.data)
        data.is_valid(raise_exception=True)
        invoice = selectors.invoice_get(invoice_id=invoice_id)
        try:
            invoice = type(self).service(
                invoice=invoice,
                actor=services.Actor.of_user(request.user),
                reason=data.validated_data["reason"],
            )
        except services.InvoiceStateError as exc:
            raise Conflict(" ".join(exc.messages), code=exc.code or "invalid_state") from None
        return Response(FinanceInvoiceOutput(invoice).data)


class FinanceInvoiceFinalizeApi(_FinanceActionApi):
    service = services.invoice_finalize


class FinanceInvoiceMarkPaidApi(_FinanceActionApi):
    service = services.invoice_mark_paid


class FinanceInvoiceVoidApi(_FinanceActionApi):
    service = services.invoice_void


class ReconciliationApi(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("period", str, required=True, description="YYYY-MM"),
            OpenApiParameter("tenant", str, description="tenant id; all tenants when absent"),
            # Not "format": DRF reserves that for renderer negotiation.
            OpenApiParameter("output", str, enum=["json", "csv"]),
        ],
        responses=dict,
    )
    def get(self, request: Request) -> Response | HttpResponse:
        _require(request, VIEW_FINANCE)
        period = _period(request.query_params.get("period"), required=True)
        assert period is not None
        tenant = _tenant_param(request.query_params.get("tenant"))
        fmt = request.query_params.get("output", "json")
        if fmt not in ("json", "csv"):
            raise serializers.ValidationError({"output": ["Use json or csv."]})
        report = reconcile(period_start=period, tenant=tenant)
        if fmt == "csv":
            response = HttpResponse(report.to_csv(), content_type="text/csv; charset=utf-8")
            response["Content-Disposition"] = (
                f'attachment; filename="reconciliation-{report.period}.csv"'
            )
            return response
        return Response(report.as_dict())
