"""Operator admin: plans, tenants (members and limit overrides inline), API keys.

An API key's hash is never shown. Keys created here go through the service, and the secret
is displayed once, in the body of the response to the creating request (``no-store``): never
in a message, since messages are kept in a cookie or the session between requests. Writes
push the read model through the signal hooks, like every other write path.

Every write here (adding, changing, deleting, the suspend / resume / revoke actions) needs an
operator (``tenants.permissions``) as well as the model's Django permission: a staff account
with view permissions only, such as finance's, reads these pages and changes nothing.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.cache import add_never_cache_headers

from tenants import services, staff_admin
from tenants.models import (
    ApiKey,
    ApiKeyModelLimit,
    Membership,
    Plan,
    PlanModelLimit,
    Tenant,
    TenantModelLimit,
)
from tenants.permissions import OperatorAdminMixin


class PlanModelLimitInline(OperatorAdminMixin, admin.TabularInline):
    model = PlanModelLimit
    extra = 0


@admin.register(Plan)
class PlanAdmin(OperatorAdminMixin, admin.ModelAdmin):
    list_display = ("name", "display_name", "admission_class", "base_fee", "currency", "created_at")
    inlines = [PlanModelLimitInline]


class MembershipInline(OperatorAdminMixin, admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


class TenantModelLimitInline(OperatorAdminMixin, admin.TabularInline):
    model = TenantModelLimit
    extra = 0
    verbose_name = "limit override"


@admin.register(Tenant)
class TenantAdmin(OperatorAdminMixin, admin.ModelAdmin):
    list_display = ("name", "plan", "suspended_at", "billing_email", "created_at", "id")
    list_filter = ("plan", ("suspended_at", admin.EmptyFieldListFilter))
    search_fields = ("name", "billing_email", "id", "stripe_customer_id")
    readonly_fields = ("id", "created_at", "updated_at", "suspended_at")
    inlines = [MembershipInline, TenantModelLimitInline]
    actions = ["suspend", "resume"]

    @admin.action(permissions=["change"], description="Suspend (their keys stop working at once)")
    def suspend(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        for tenant in queryset:
            services.tenant_set_suspended(tenant=tenant, suspended=True)
        self.message_user(request, f"Suspended {queryset.count()} tenant(s).")

    @admin.action(permissions=["change"], description="Resume")
    def resume(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        for tenant in queryset:
            services.tenant_set_suspended(tenant=tenant, suspended=False)
        self.message_user(request, f"Resumed {queryset.count()} tenant(s).")


class ApiKeyModelLimitInline(OperatorAdminMixin, admin.TabularInline):
    model = ApiKeyModelLimit
    extra = 0
    verbose_name = "key limit"
    fields = ("family", "rpm", "tpm", "max_concurrency")


@admin.register(ApiKey)
class ApiKeyAdmin(OperatorAdminMixin, admin.ModelAdmin):
    list_display = (
        "prefix",
        "name",
        "tenant",
        "scopes",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
    )
    list_filter = (("revoked_at", admin.EmptyFieldListFilter), "tenant__plan")
    search_fields = ("prefix", "name", "tenant__name")
    # key_hash is deliberately in no field list: operators never see it.
    readonly_fields = (
        "id",
        "prefix",
        "created_by",
        "created_at",
        "last_used_at",
        "revoked_at",
        "revoked_by",
    )
    actions = ["revoke"]

    def get_inlines(self, request: HttpRequest, obj: ApiKey | None = None) -> list[Any]:
        # Limits once the key exists: a new key is created by the service, not by the form.
        return [ApiKeyModelLimitInline] if obj is not None else []

    def get_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        if obj is None:
            return ["tenant", "name", "scopes", "expires_at"]
        return [
            "id",
            "tenant",
            "name",
            "prefix",
            "scopes",
            "created_by",
            "created_at",
            "last_used_at",
            "expires_at",
            "revoked_at",
            "revoked_by",
        ]

    def get_readonly_fields(
        self, request: HttpRequest, obj: ApiKey | None = None
    ) -> tuple[str, ...]:
        if obj is None:
            return ()
        return (*self.readonly_fields, "tenant", "scopes")

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        created, secret = services.api_key_create(
            tenant=obj.tenant,
            name=obj.name,
            scopes=obj.scopes,
            created_by=request.user,
            expires_at=obj.expires_at,
        )
        obj.pk = created.pk
        obj.__dict__.update({k: v for k, v in created.__dict__.items() if k != "_state"})
        obj._state.adding = False
        # Only on this request object, for response_add below: never stored.
        request._fairway_new_secret = secret

    def response_add(
        self, request: HttpRequest, obj: ApiKey, post_url_continue: str | None = None
    ) -> HttpResponse:
        secret = getattr(request, "_fairway_new_secret", None)
        if secret is None:
            return super().response_add(request, obj, post_url_continue)
        response = TemplateResponse(
            request,
            "admin/tenants/apikey/secret_once.html",
            {
                **self.admin_site.each_context(request),
                "key": obj,
                "secret": secret,
                "change_url": reverse("admin:tenants_apikey_change", args=[obj.pk]),
                "list_url": reverse("admin:tenants_apikey_changelist"),
                "opts": self.model._meta,
            },
        )
        add_never_cache_headers(response)  # includes no-store: no cache keeps the page
        return response

    @admin.action(permissions=["change"], description="Revoke (refused by every gateway at once)")
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        count = 0
        for api_key in queryset.filter(revoked_at__isnull=True):
            services.api_key_revoke(api_key=api_key, revoked_by=request.user)
            count += 1
        self.message_user(request, f"Revoked {count} key(s).")


# Staff accounts: only a superuser raises an account's powers (see the module).
staff_admin.register(admin.site)
