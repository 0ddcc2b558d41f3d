from django.urls import path

from tenants import apis
from tenants.auth import ObtainExpiringToken

urlpatterns = [
    path("auth/token/", ObtainExpiringToken.as_view(), name="auth-token"),
    path("tenants/", apis.TenantListApi.as_view(), name="tenant-list"),
    path("tenants/<uuid:tenant_id>/", apis.TenantDetailApi.as_view(), name="tenant-detail"),
    path("tenants/<uuid:tenant_id>/members/", apis.MemberListApi.as_view(), name="member-list"),
    path(
        "tenants/<uuid:tenant_id>/members/<int:member_id>/",
        apis.MemberDetailApi.as_view(),
        name="member-detail",
    ),
    path("tenants/<uuid:tenant_id>/keys/", apis.KeyListApi.as_view(), name="key-list"),
    path(
        "tenants/<uuid:tenant_id>/keys/<uuid:key_id>/",
        apis.KeyDetailApi.as_view(),
        name="key-detail",
    ),
    path(
        "tenants/<uuid:tenant_id>/keys/<uuid:key_id>/revoke/",
        apis.KeyRevokeApi.as_view(),
        name="key-revoke",
    ),
    path(
        "tenants/<uuid:tenant_id>/keys/<uuid:key_id>/limits/",
        apis.KeyLimitListApi.as_view(),
        name="key-limit-list",
    ),
    path(
        "tenants/<uuid:tenant_id>/keys/<uuid:key_id>/limits/<str:model>/",
        apis.KeyLimitDetailApi.as_view(),
        name="key-limit-detail",
    ),
    path("tenants/<uuid:tenant_id>/limits/", apis.LimitListApi.as_view(), name="limit-list"),
    path(
        "tenants/<uuid:tenant_id>/limits/<str:model>/",
        apis.LimitDetailApi.as_view(),
        name="limit-detail",
    ),
]
