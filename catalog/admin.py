"""Operator admin for the model registry: every write and the make-current action need an
operator (``tenants.permissions``) as well as the model's Django permission.

Prices: a version's form holds the three prices. Adding a version records its first price;
changing them records a ``catalog.services.price_change`` (from the current hour or a
later one, with a reason) — the version's price history is shown read-only below it and
under "Model prices"; nobody edits or deletes a price row (the database refuses too).
A change not yet in force can be withdrawn from its page under "Model prices" (with a
reason; ``catalog.services.price_change_withdraw``). Every price write here (a version's
first price, a change, a withdrawal) needs an operator with ``catalog.add_modelprice``,
the permission the prices API asks for: a version's other fields need only its change
permission, and without the price permission its price fields are shown read-only.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html

from catalog import services
from catalog.models import PRICE, ModelFamily, ModelPrice, ModelVersion, Replica
from catalog.selectors import price_in_force
from tenants.permissions import OperatorAdminMixin, is_operator

PRICE_FORM_FIELDS = {
    "price_prompt_per_mtok": "Prompt price per 1M tokens",
    "price_cached_prompt_per_mtok": "Cached prompt price per 1M tokens",
    "price_completion_per_mtok": "Completion price per 1M tokens",
}


class ModelVersionInline(OperatorAdminMixin, admin.TabularInline):
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
        "prefill_attention_share",
        "supports_tools",
        "tool_call_parser",
        "supports_structured_output",
        "max_n",
        "supports_logprobs",
        "max_top_logprobs",
    )
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a version needs its first price: add it on the version's own form


@admin.register(ModelFamily)
class ModelFamilyAdmin(OperatorAdminMixin, admin.ModelAdmin):
    list_display = ("name", "display_name", "created_at")
    search_fields = ("name",)
    inlines = [ModelVersionInline]


class ReplicaInline(OperatorAdminMixin, admin.TabularInline):
    model = Replica
    extra = 0


PRICE_COLUMNS = (
    "effective_from",
    "price_prompt_per_mtok",
    "price_cached_prompt_per_mtok",
    "price_completion_per_mtok",
    "currency",
    "actor_label",
    "reason",
    "created_at",
    "withdrawn_at",
    "withdrawn_by_label",
    "withdrawal_reason",
)


class ModelPriceInline(admin.TabularInline):
    """The version's price history, read-only."""

    model = ModelPrice
    fk_name = "version"
    fields = PRICE_COLUMNS
    readonly_fields = PRICE_COLUMNS
    extra = 0
    can_delete = False
    ordering = ("-effective_from",)
    verbose_name_plural = "price history (append-only)"

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def _price_field(name: str) -> forms.DecimalField:
    return forms.DecimalField(
        label=PRICE_FORM_FIELDS[name],
        max_digits=PRICE["max_digits"],
        decimal_places=PRICE["decimal_places"],
        min_value=Decimal(0),
    )


class ModelVersionForm(forms.ModelForm):
    """The version's fields plus its prices, which are not columns of the version: they
    become a ModelPrice row through the catalog's services on save."""

    price_prompt_per_mtok = _price_field("price_prompt_per_mtok")
    price_cached_prompt_per_mtok = _price_field("price_cached_prompt_per_mtok")
    price_completion_per_mtok = _price_field("price_completion_per_mtok")
    price_effective_from = forms.DateTimeField(
        required=False,
        label="New prices take effect from",
        help_text="Start of a UTC hour, not before the current one; empty: the current hour.",
    )
    price_change_reason = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        label="Why the prices change",
        help_text="Needed when the prices change (kept in the price history).",
    )

    class Meta:
        model = ModelVersion
        fields = "__all__"  # noqa: DJ007 - the admin's form; every version field is editable

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.current_price: ModelPrice | None = None
        if self.instance.pk:
            self.current_price = price_in_force(version=self.instance, at=timezone.now())
            if self.current_price is not None:
                for field in PRICE_FORM_FIELDS:
                    self.initial.setdefault(field, getattr(self.current_price, field))

    def prices(self) -> tuple[Decimal, Decimal, Decimal]:
        data = self.cleaned_data
        return (
            data["price_prompt_per_mtok"],
            data["price_cached_prompt_per_mtok"],
            data["price_completion_per_mtok"],
        )

    def prices_changed(self) -> bool:
        if self.current_price is None:
            return True
        return self.prices() != tuple(getattr(self.current_price, f) for f in PRICE_FORM_FIELDS)

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if any(f not in data for f in PRICE_FORM_FIELDS):
            return data  # a field error is shown already
        prompt, cached, _ = self.prices()
        if cached > prompt:
            self.add_error(
                "price_cached_prompt_per_mtok",
                "Cached prompt tokens cannot cost more than prompt tokens.",
            )
        if self.current_price is not None and self.prices_changed():
            try:
                data["price_effective_from"] = services.price_effective_hour(
                    data.get("price_effective_from")
                )
            except ValidationError as exc:
                self.add_error("price_effective_from", exc.messages)
            if not (data.get("price_change_reason") or "").strip():
                self.add_error("price_change_reason", "Say why the prices change.")
        return data


PRICE_PERMISSION = "catalog.add_modelprice"  # the prices API's, for every price write


def may_write_prices(request: HttpRequest) -> bool:
    return is_operator(request.user) and request.user.has_perm(PRICE_PERMISSION)


@admin.register(ModelVersion)
class ModelVersionAdmin(OperatorAdminMixin, admin.ModelAdmin):
    form = ModelVersionForm
    list_display = (
        "name",
        "family",
        "is_current",
        "is_active",
        "context_length",
        "kv_bytes_per_token",
        "tpot_target_ms",
        "kv_capacity_tokens",
        "prefill_attention_share",
        "price_now",
        "supports_tools",
        "supports_structured_output",
        "max_n",
        "supports_logprobs",
        "weights",
        "tensor_parallel_size",
    )
    list_filter = ("family", "is_current", "is_active", "supports_tools")
    inlines = [ModelPriceInline, ReplicaInline]
    actions = ["make_current"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        # a new version is added with its first price
        return super().has_add_permission(request) and may_write_prices(request)

    def get_form(self, request: HttpRequest, obj: Any = None, **kwargs: Any) -> Any:
        form = super().get_form(request, obj, **kwargs)
        if obj is None or may_write_prices(request):
            return form

        class PricesShown(form):  # type: ignore[misc,valid-type]
            """Prices shown, not changeable: disabled fields keep the prices in force, so
            ``prices_changed`` is false whatever is posted. (Per instance: the class's
            fields are shared with every other request's form.)"""

            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, **kw)
                for name in (*PRICE_FORM_FIELDS, "price_effective_from", "price_change_reason"):
                    self.fields[name].disabled = True

        return PricesShown

    @admin.display(description="price now (prompt / cached / completion per 1M)")
    def price_now(self, obj: ModelVersion) -> str:
        price = price_in_force(version=obj, at=timezone.now())
        if price is None:
            return "—"
        return (
            f"{price.price_prompt_per_mtok.normalize():f} / "
            f"{price.price_cached_prompt_per_mtok.normalize():f} / "
            f"{price.price_completion_per_mtok.normalize():f} {price.currency}"
        )

    def save_model(self, request: HttpRequest, obj: ModelVersion, form: Any, change: bool) -> None:
        assert isinstance(form, ModelVersionForm)
        changed = form.prices_changed()
        if changed and not may_write_prices(request):
            raise PermissionDenied  # the fields are disabled; refuse before writing anything
        super().save_model(request, obj, form, change)
        if not changed:
            return
        prompt, cached, completion = form.prices()
        who = {"actor": request.user, "actor_label": request.user.get_username()}
        if form.current_price is None:
            services.version_first_price(
                version=obj, prompt=prompt, cached_prompt=cached, completion=completion, **who
            )
            return
        services.price_change(
            version=obj,
            prompt=prompt,
            cached_prompt=cached,
            completion=completion,
            effective_from=form.cleaned_data["price_effective_from"],
            reason=form.cleaned_data["price_change_reason"],
            **who,
        )

    @admin.action(
        permissions=["change"], description="Make current (the family alias resolves to it)"
    )
    def make_current(self, request: HttpRequest, queryset: QuerySet[ModelVersion]) -> None:
        for version in queryset:
            services.version_make_current(version=version)
        self.message_user(request, f"Updated {queryset.count()} version(s).")


class PriceWithdrawForm(forms.Form):
    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 2}),
        label="Why the change is withdrawn",
        help_text="Kept in the price history with your name.",
    )


@admin.register(ModelPrice)
class ModelPriceAdmin(admin.ModelAdmin):
    """Every price change of every version, read-only (record changes on the version); a
    change not yet in force has a link to withdraw it."""

    list_display = ("version", *PRICE_COLUMNS)
    list_filter = ("version",)
    search_fields = ("version__name", "reason", "actor_label")
    date_hierarchy = "effective_from"
    readonly_fields = ("version", "replaces", "actor", *PRICE_COLUMNS, "withdrawn_by", "withdraw")

    def get_urls(self) -> list[URLPattern]:
        withdraw = path(
            "<int:price_id>/withdraw/",
            self.admin_site.admin_view(self.withdraw_view),
            name="catalog_modelprice_withdraw",
        )
        return [withdraw, *super().get_urls()]

    def may_withdraw(self, request: HttpRequest) -> bool:
        """Whoever may schedule a price change (the prices API's permission)."""
        return may_write_prices(request)

    @admin.display(description="withdraw")
    def withdraw(self, obj: ModelPrice) -> str:
        if obj.withdrawn_at is not None or obj.effective_from <= timezone.now():
            return "—"  # withdrawn, or in force (once): only a new price change supersedes it
        url = reverse("admin:catalog_modelprice_withdraw", args=[obj.pk])
        return format_html('<a href="{}">Withdraw this scheduled change</a>', url)

    def withdraw_view(self, request: HttpRequest, price_id: int) -> HttpResponse:
        price = get_object_or_404(ModelPrice, pk=price_id)
        if not self.may_withdraw(request):
            raise PermissionDenied
        form = PriceWithdrawForm(request.POST if request.method == "POST" else None)
        if form.is_valid():
            try:
                services.price_change_withdraw(
                    price=price,
                    actor=request.user,
                    actor_label=request.user.get_username(),
                    reason=form.cleaned_data["reason"],
                )
            except ValidationError as exc:
                form.add_error(None, exc.messages)
            else:
                self.message_user(request, f"Withdrew the price change {price}.")
                return redirect("admin:catalog_modelprice_change", price.pk)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Withdraw the price change {price}",
            "price": price,
            "form": form,
        }
        return TemplateResponse(request, "admin/catalog/modelprice/withdraw.html", context)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Replica)
class ReplicaAdmin(OperatorAdminMixin, admin.ModelAdmin):
    list_display = ("name", "version", "base_url", "pool", "is_enabled")
    list_filter = ("version", "pool", "is_enabled")
