from django.contrib.auth import views as auth_views
from django.urls import path, reverse_lazy

from console import billing_views, ops_views, views

app_name = "console"

tenant = "t/<uuid:tenant_id>/"

urlpatterns = [
    path("", views.home, name="home"),
    path(
        "login/",
        auth_views.LoginView.as_view(
            template_name="console/login.html", redirect_authenticated_user=True
        ),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path(
        "password/",
        auth_views.PasswordChangeView.as_view(
            template_name="console/password_change.html",
            success_url=reverse_lazy("console:password-done"),
        ),
        name="password",
    ),
    path(
        "password/done/",
        auth_views.PasswordChangeDoneView.as_view(template_name="console/password_done.html"),
        name="password-done",
    ),
    path(tenant, views.overview, name="overview"),
    path(f"{tenant}keys/", views.keys, name="keys"),
    path(f"{tenant}keys/<uuid:key_id>/revoke/", views.key_revoke, name="key-revoke"),
    path(f"{tenant}keys/<uuid:key_id>/limits/", views.key_limits, name="key-limits"),
    path(
        f"{tenant}keys/<uuid:key_id>/limits/<str:family>/",
        views.key_limit_set,
        name="key-limit-set",
    ),
    path(f"{tenant}usage/", views.usage, name="usage"),
    path(f"{tenant}usage.csv", views.usage_csv, name="usage-csv"),
    path(f"{tenant}limits/", views.limits, name="limits"),
    path(f"{tenant}members/", views.members, name="members"),
    path(f"{tenant}members/<int:member_id>/role/", views.member_role, name="member-role"),
    path(f"{tenant}members/<int:member_id>/remove/", views.member_remove, name="member-remove"),
    path(f"{tenant}invoices/", billing_views.invoices, name="invoices"),
    path(f"{tenant}invoices/<int:invoice_id>/", billing_views.invoice_detail, name="invoice"),
    path(
        f"{tenant}invoices/<int:invoice_id>.csv",
        billing_views.invoice_download,
        name="invoice-csv",
    ),
    path("finance/invoices/", billing_views.finance_invoices, name="finance-invoices"),
    path(
        "finance/invoices/<int:invoice_id>/",
        billing_views.finance_invoice,
        name="finance-invoice",
    ),
    path(
        "finance/invoices/<int:invoice_id>/action/",
        billing_views.finance_invoice_action,
        name="finance-invoice-action",
    ),
    path("finance/reconciliation/", billing_views.reconciliation, name="reconciliation"),
    path("ops/fleet/", ops_views.fleet, name="fleet"),
    path("ops/tenants/", ops_views.tenants, name="ops-tenants"),
    path("ops/tenants/<uuid:tenant_id>/", ops_views.tenant_detail, name="ops-tenant"),
    path(
        "ops/tenants/<uuid:tenant_id>/limits/<str:family>/",
        ops_views.tenant_limit,
        name="ops-tenant-limit",
    ),
]
