from django.urls import path

from billing import apis, webhooks

urlpatterns = [
    path(
        "tenants/<uuid:tenant_id>/invoices/",
        apis.TenantInvoiceListApi.as_view(),
        name="tenant-invoice-list",
    ),
    path(
        "tenants/<uuid:tenant_id>/invoices/<int:invoice_id>/",
        apis.TenantInvoiceDetailApi.as_view(),
        name="tenant-invoice-detail",
    ),
    path("billing/invoices/", apis.FinanceInvoiceListApi.as_view(), name="finance-invoice-list"),
    path(
        "billing/invoices/<int:invoice_id>/",
        apis.FinanceInvoiceDetailApi.as_view(),
        name="finance-invoice-detail",
    ),
    path(
        "billing/invoices/<int:invoice_id>/finalize/",
        apis.FinanceInvoiceFinalizeApi.as_view(),
        name="finance-invoice-finalize",
    ),
    path(
        "billing/invoices/<int:invoice_id>/mark-paid/",
        apis.FinanceInvoiceMarkPaidApi.as_view(),
        name="finance-invoice-mark-paid",
    ),
    path(
        "billing/invoices/<int:invoice_id>/void/",
        apis.FinanceInvoiceVoidApi.as_view(),
        name="finance-invoice-void",
    ),
    path(
        "billing/reconciliation/", apis.ReconciliationApi.as_view(), name="billing-reconciliation"
    ),
    path("billing/stripe/webhook", webhooks.stripe_webhook, name="stripe-webhook"),
]
