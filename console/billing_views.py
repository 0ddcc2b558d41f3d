"""Invoice pages for customers and the finance desk, on top of ``billing``'s selectors and
services (every state change goes through them and leaves their audit row)."""

from __future__ import annotations

import csv
import io
from typing import Any

from django import forms as django_forms
from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from billing import selectors as billing
from billing import services as billing_services
from billing import stripe_sync
from billing.models import AuditEntry, Invoice, InvoiceStatus, LineKind
from billing.periods import month_start, parse_period, period_label, previous_month
from billing.pricing import round_line
from billing.reconciliation import reconcile
from console import access
from tenants.selectors import TenantAccess

CSV_COLUMNS = (
    "invoice",
    "tenant",
    "period",
    "status",
    "position",
    "kind",
    "description",
    "model_version",
    "token_type",
    "tokens",
    "unit_price_per_mtok",
    "amount",
    "currency",
    "adjusts_period",
)


def _split(invoice: Invoice) -> tuple[list[Any], list[Any]]:
    lines = list(billing.invoice_lines(invoice=invoice))
    return (
        [ln for ln in lines if ln.kind != LineKind.ADJUSTMENT],
        [ln for ln in lines if ln.kind == LineKind.ADJUSTMENT],
    )


def _amount(value: Any, currency: str) -> str:
    return format(round_line(value, currency), "f")


def invoice_csv(invoices: list[Invoice], filename: str) -> HttpResponse:
    """One row per invoice line, amounts in the currency's minor unit (as the API shows)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    for invoice in invoices:
        for line in billing.invoice_lines(invoice=invoice):
            writer.writerow(
                [
                    invoice.number or f"draft-{invoice.pk}",
                    invoice.tenant.name,
                    invoice.period_label,
                    invoice.status,
                    line.position,
                    line.kind,
                    _csv_text(line.description),
                    line.model_version.name if line.model_version else "",
                    line.token_type,
                    line.tokens,
                    format(line.unit_price_per_mtok, "f"),
                    _amount(line.amount, invoice.currency),
                    invoice.currency,
                    period_label(line.adjusts_period_start) if line.adjusts_period_start else "",
                ]
            )
    response = HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


def _csv_text(text: str) -> str:
    """No cell may start a spreadsheet formula."""
    return f"'{text}" if text[:1] in ("=", "+", "-", "@") else text


# -- customers ------------------------------------------------------------------------------


@access.tenant_page(access.INVOICE_READERS, "see invoices")
def invoices(request: HttpRequest, acc: TenantAccess) -> HttpResponse:
    return render(
        request,
        "console/invoices.html",
        {"invoices": list(billing.invoice_list(tenant=acc.tenant))},
    )


@access.tenant_page(access.INVOICE_READERS, "see invoices")
def invoice_detail(request: HttpRequest, acc: TenantAccess, invoice_id: int) -> HttpResponse:
    invoice = billing.invoice_get(invoice_id=invoice_id, tenant=acc.tenant)
    lines, adjustments = _split(invoice)
    return render(
        request,
        "console/invoice_detail.html",
        {"invoice": invoice, "lines": lines, "adjustments": adjustments, "finance": False},
    )


@access.tenant_page(access.INVOICE_READERS, "see invoices")
def invoice_download(request: HttpRequest, acc: TenantAccess, invoice_id: int) -> HttpResponse:
    invoice = billing.invoice_get(invoice_id=invoice_id, tenant=acc.tenant)
    return invoice_csv([invoice], f"invoice-{invoice.number or invoice.pk}.csv")


# -- finance --------------------------------------------------------------------------------


class FinanceFilter(django_forms.Form):
    period = django_forms.CharField(
        required=False, label="Month (YYYY-MM)", max_length=7,
        widget=django_forms.TextInput(attrs={"type": "month", "placeholder": "YYYY-MM"}),
    )  # fmt: skip
    status = django_forms.ChoiceField(
        required=False, choices=[("", "Any state"), *InvoiceStatus.choices], label="State"
    )

    def clean_period(self) -> Any:
        text = self.cleaned_data.get("period") or ""
        if not text:
            return None
        try:
            return parse_period(text)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None


class ReasonForm(django_forms.Form):
    action = django_forms.ChoiceField(
        choices=[("finalize", "finalize"), ("mark_paid", "mark paid"), ("void", "void")]
    )
    reason = django_forms.CharField(max_length=2000, label="Reason")


@access.finance_page
def finance_invoices(request: HttpRequest) -> HttpResponse:
    form = FinanceFilter(request.GET)
    rows: list[Invoice] = []
    if form.is_valid():
        rows = list(
            billing.invoice_list(
                status=form.cleaned_data["status"] or None,
                period_start=form.cleaned_data["period"],
            )
        )
        if request.GET.get("output") == "csv":
            label = (
                period_label(form.cleaned_data["period"]) if form.cleaned_data["period"] else "all"
            )
            return invoice_csv(rows, f"invoices-{label}.csv")
    return render(
        request,
        "console/finance/invoices.html",
        {
            "form": form,
            "invoices": rows,
            "query": request.GET.urlencode(),
            "stripe_sync": stripe_sync.enabled(),
        },
        status=200 if form.is_valid() else 400,
    )


def _finance_detail(
    request: HttpRequest, invoice: Invoice, form: ReasonForm | None = None, status: int = 200
) -> HttpResponse:
    lines, adjustments = _split(invoice)
    return render(
        request,
        "console/finance/invoice_detail.html",
        {
            "invoice": invoice,
            "lines": lines,
            "adjustments": adjustments,
            "finance": True,
            "audit": AuditEntry.objects.filter(invoice=invoice).order_by("at", "pk"),
            "outbox": billing.outbox_for_invoice(invoice=invoice),
            "stripe_sync": stripe_sync.enabled(),
            "can_manage": access.can_manage_invoices(request.user),
            "form": form or ReasonForm(),
            "period_over": timezone.now() >= invoice.period_end,
        },
        status=status,
    )


@access.finance_page
def finance_invoice(request: HttpRequest, invoice_id: int) -> HttpResponse:
    return _finance_detail(request, billing.invoice_get(invoice_id=invoice_id))


@require_POST
@access.finance_page
def finance_invoice_action(request: HttpRequest, invoice_id: int) -> HttpResponse:
    if not access.can_manage_invoices(request.user):
        raise PermissionDenied("Acting on invoices needs billing.manage_invoices.")
    invoice = billing.invoice_get(invoice_id=invoice_id)
    form = ReasonForm(request.POST)
    if not form.is_valid():
        return _finance_detail(request, invoice, form, status=400)
    actor = billing_services.Actor.of_user(request.user)
    reason = form.cleaned_data["reason"]
    act = {
        "finalize": billing_services.invoice_finalize,
        "mark_paid": billing_services.invoice_mark_paid,
        "void": billing_services.invoice_void,
    }[form.cleaned_data["action"]]
    try:
        invoice = act(invoice=invoice, actor=actor, reason=reason)
    except ValidationError as exc:
        form.add_error("reason" if "reason" in getattr(exc, "error_dict", {}) else None,
                       " ".join(exc.messages))  # fmt: skip
        return _finance_detail(request, billing.invoice_get(invoice_id=invoice_id), form, 409)
    messages.success(request, f"Invoice {invoice.number or invoice.pk} is now {invoice.status}.")
    return redirect("console:finance-invoice", invoice_id=invoice.pk)


@access.finance_page
def reconciliation(request: HttpRequest) -> HttpResponse:
    default = period_label(previous_month(month_start(timezone.now())))
    data = {"period": default, **request.GET.dict()}
    form = FinanceFilter(data)
    report = None
    if form.is_valid() and form.cleaned_data["period"] is not None:
        report = reconcile(period_start=form.cleaned_data["period"])
        if request.GET.get("output") == "csv":
            response = HttpResponse(report.to_csv(), content_type="text/csv; charset=utf-8")
            response["Content-Disposition"] = (
                f'attachment; filename="reconciliation-{report.period}.csv"'
            )
            return response
    return render(
        request,
        "console/finance/reconciliation.html",
        {"form": form, "report": report, "period": data["period"]},
        status=200 if report is not None else 400,
    )
