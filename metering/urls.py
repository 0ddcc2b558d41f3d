from django.urls import path

from metering import apis

# No trailing slash: the paths are OpenAI's, so its SDKs work against /api/v1.
urlpatterns = [
    path(
        "tenants/<uuid:tenant_id>/usage/completions",
        apis.TenantUsageApi.as_view(),
        name="usage-completions",
    ),
    path(
        "tenants/<uuid:tenant_id>/usage/completions.csv",
        apis.TenantUsageCsvApi.as_view(),
        {"format": "csv"},
        name="usage-completions-csv",
    ),
    path("tenants/<uuid:tenant_id>/costs", apis.TenantCostsApi.as_view(), name="costs"),
    path(
        "organization/usage/completions",
        apis.OrganizationUsageApi.as_view(),
        name="organization-usage-completions",
    ),
    path(
        "organization/usage/completions.csv",
        apis.OrganizationUsageCsvApi.as_view(),
        {"format": "csv"},
        name="organization-usage-completions-csv",
    ),
    path("organization/costs", apis.OrganizationCostsApi.as_view(), name="organization-costs"),
]
