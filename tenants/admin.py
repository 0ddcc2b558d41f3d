"""Operator admin: plans, tenants (members and limit overrides inline), API keys.

An API key's hash is never shown. Keys created here go through the service, and the secret
is displayed once in the confirmation message. Writes push the read model through the
signal hooks, like every other write path.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from tenants import services
from tenants.models import ApiKey, Membership, Plan, PlanModelLimit, Tenant, TenantModelLimit


class PlanModelLimitInline(admin.TabularInline):
    model = PlanModelLimit
    extra = 0


@admin.register(Plan)
class PlanAdmin(admin.ModelAdmin):
    list_display = ("name", "display_name", "admission_class", "created_at")
    inlines = [PlanModelLimitInline]


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


class TenantModelLimitInline(admin.TabularInline):
    model = TenantModelLimit
    extra = 0
    verbose_name = "limit override"


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("name", "plan", "suspended_at", "billing_email", "created_at", "id")
    list_filter = ("plan", ("suspended_at", admin.EmptyFieldListFilter))
    search_fields = ("name", "billing_email", "id", "stripe_customer_id")
    readonly_fields = ("id", "created_at", "updated_at", "suspended_at")
    inlines = [MembershipInline, TenantModelLimitInline]
    actions = ["suspend", "resume"]

    @admin.action(description="Suspend (their keys stop working at once)")
    def suspend(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        for tenant in queryset:
            services.tenant_set_suspended(tenant=tenant, suspended=True)
        self.message_user(request, f"Suspended {queryset.count()} tenant(s).")

    @admin.action(description="Resume")
    def resume(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        for tenant in queryset:
            services.tenant_set_suspended(tenant=tenant, suspended=False)
        self.message_user(request, f"Resumed {queryset.count()} tenant(s).")


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
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
        messages.warning(request, f"Copy the secret now; it cannot be shown again: {secret}")

    @admin.action(description="Revoke (refused by every gateway at once)")
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        count = 0
        for api_key in queryset.filter(revoked_at__isnull=True):
            services.api_key_revoke(api_key=api_key, revoked_by=request.user)
            count += 1
        self.message_user(request, f"Revoked {count} key(s).")
