"""Operator admin for the model registry."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from catalog import services
from catalog.models import ModelFamily, ModelVersion, Replica


class ModelVersionInline(admin.TabularInline):
    model = ModelVersion
    extra = 0
    fields = (
        "name",
        "is_current",
        "is_active",
        "context_length",
        "kv_bytes_per_token",
        "tpot_target_ms",
        "kv_capacity_tokens",
    )
    show_change_link = True


@admin.register(ModelFamily)
class ModelFamilyAdmin(admin.ModelAdmin):
    list_display = ("name", "display_name", "created_at")
    search_fields = ("name",)
    inlines = [ModelVersionInline]


class ReplicaInline(admin.TabularInline):
    model = Replica
    extra = 0


@admin.register(ModelVersion)
class ModelVersionAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "family",
        "is_current",
        "is_active",
        "context_length",
        "kv_bytes_per_token",
        "tpot_target_ms",
        "kv_capacity_tokens",
        "price_prompt_per_mtok",
        "price_cached_prompt_per_mtok",
        "price_completion_per_mtok",
    )
    list_filter = ("family", "is_current", "is_active")
    inlines = [ReplicaInline]
    actions = ["make_current"]

    @admin.action(description="Make current (the family alias resolves to it)")
    def make_current(self, request: HttpRequest, queryset: QuerySet[ModelVersion]) -> None:
        for version in queryset:
            services.version_make_current(version=version)
        self.message_user(request, f"Updated {queryset.count()} version(s).")


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin):
    list_display = ("name", "version", "base_url", "pool", "is_enabled")
    list_filter = ("version", "pool", "is_enabled")
