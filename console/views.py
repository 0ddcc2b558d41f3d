"""Customer pages: overview, API keys, usage, limits, members, sign-in.

Every page is scoped to a tenant the user is a member of (``access.tenant_page``) and
role-checked; every write calls one ``tenants.services`` function.
"""

from __future__ import annotations

import json
import secrets
from typing import Any
from uuid import UUID

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.db.models import Q
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods, require_POST

from catalog.models import ModelVersion
from console import access, forms, metrics
from console import selectors as console_selectors
from metering.http import UsageCsvRenderer
from metering.pages import DAY, HOUR
from metering.selectors import COST_READERS, USAGE_READERS
from tenants import selectors, services
from tenants.models import Role

TenantAccess = selectors.TenantAccess


def _tenant_url(name: str, access_: TenantAccess, **kwargs: Any) -> str:
    return reverse(f"console:{name}", kwargs={"tenant_id": access_.tenant.id, **kwargs})


@login_required
def home(request: HttpRequest) -> HttpResponse:
    """The user's first tenant, else the staff pages they may open, else an empty state."""
    mine = access.memberships(request.user)
    if mine:
        return redirect("console:overview", tenant_id=mine[0][0].id)
    if access.is_operator(request.user):
        return redirect("console:fleet")
    if access.is_finance(request.user):
        return redirect("console:finance-invoices")
    return render(request, "console/no_tenant.html")


# -- overview ------------------------------------------------------------------------------


@access.tenant_page(access.OVERVIEW_READERS, "see this tenant")
def overview(request: HttpRequest, acc: TenantAccess) -> HttpResponse:
    now = timezone.now()
    start = console_selectors.month_start(now)
    totals = console_selectors.usage_totals(tenant=acc.tenant, start=start, end=now.date())
    spend = (
        console_selectors.spend(tenant=acc.tenant, start=start, end=now.date())
        if acc.role in COST_READERS
        else None
    )
    limits = selectors.limit_list(tenant=acc.tenant)
    return render(
        request,
        "console/overview.html",
        {
            "totals": totals,
            "spend": spend,
            "month_start": start,
            "limits": limits,
            "latency": console_selectors.recent_latency(tenant=acc.tenant, now=now),
            "statuses": metrics.tenant_status_counts(str(acc.tenant.id)),
            "gateway_urls": settings.FAIRWAY_GATEWAY_METRICS_URLS,
            "api_base_url": settings.FAIRWAY_API_BASE_URL,
            "models": console_selectors.callable_models(limits=limits),
        },
    )


# -- API keys ------------------------------------------------------------------------------


def _keys_page(
    request: HttpRequest,
    acc: TenantAccess,
    form: forms.KeyCreateForm,
    *,
    created: Any = None,
    secret: str | None = None,
    status: int = 200,
) -> HttpResponse:
    now = timezone.now()
    keys = list(selectors.api_key_list(tenant=acc.tenant))
    own_limits = selectors.api_key_limits_by_key(tenant=acc.tenant)
    tenant_limits = selectors.limit_list(tenant=acc.tenant)
    response = render(
        request,
        "console/keys.html",
        {
            "keys": [(k, k.is_active(now), own_limits.get(k.id, [])) for k in keys],
            "tenant_limits": tenant_limits,
            "form": form,
            "can_write": acc.role in selectors.KEY_WRITERS,
            "created": created,
            "secret": secret,
            "api_base_url": settings.FAIRWAY_API_BASE_URL,
            # The quick start shows only with a new key's secret.
            "models": console_selectors.callable_models(limits=tenant_limits) if secret else [],
        },
        status=status,
    )
    if secret is not None:
        # The one response that carries the secret: never cached, never stored anywhere.
        response["Cache-Control"] = "no-store"
    return response


USED_FORMS = "console_used_key_forms"


def _new_key_form() -> forms.KeyCreateForm:
    return forms.KeyCreateForm(initial={"form_id": secrets.token_urlsafe(16)})


@never_cache
@require_http_methods(["GET", "POST"])
@access.tenant_page(selectors.KEY_READERS, "see API keys")
def keys(request: HttpRequest, acc: TenantAccess) -> HttpResponse:
    if request.method != "POST":
        return _keys_page(request, acc, _new_key_form())
    acc.require(selectors.KEY_WRITERS, "create API keys")
    form = forms.KeyCreateForm(request.POST)
    used: list[str] = request.session.get(USED_FORMS, [])
    if form.is_valid() and form.cleaned_data["form_id"] in used:
        messages.warning(
            request,
            "This form was already sent and its key created; its secret was shown once and "
            "cannot be shown again. If you did not copy it, revoke that key and create another.",
        )
        return redirect(_tenant_url("keys", acc))
    if form.is_valid():
        request.session[USED_FORMS] = [*used, form.cleaned_data["form_id"]][-20:]
        try:
            key, secret = services.api_key_create(
                tenant=acc.tenant,
                name=form.cleaned_data["name"],
                scopes=form.cleaned_data["scopes"],
                created_by=request.user,
                expires_at=form.expires_at(),
            )
        except ValidationError as exc:
            forms.apply_errors(form, exc)
        else:
            return _keys_page(request, acc, _new_key_form(), created=key, secret=secret)
    return _keys_page(request, acc, form, status=400)


@require_http_methods(["GET", "POST"])
@access.tenant_page(selectors.KEY_WRITERS, "revoke API keys")
def key_revoke(request: HttpRequest, acc: TenantAccess, key_id: UUID) -> HttpResponse:
    key = selectors.api_key_get(tenant=acc.tenant, key_id=key_id)
    if request.method == "POST":
        services.api_key_revoke(api_key=key, revoked_by=request.user)
        messages.success(request, f"Key “{key.name}” ({key.prefix}…) is revoked.")
        return redirect(_tenant_url("keys", acc))
    return render(request, "console/key_revoke.html", {"key": key})


def _tenant_ceilings(limit: Any) -> dict[str, int | None]:
    """The tenant's limits a key's form shows as help (None: the tenant lost the family)."""
    if limit is None:
        return {"tenant_rpm": None, "tenant_tpm": None}
    return {"tenant_rpm": limit.rpm, "tenant_tpm": limit.tpm}


def _key_limits_page(
    request: HttpRequest,
    acc: TenantAccess,
    key: Any,
    *,
    bound: forms.KeyLimitForm | None = None,
    status: int = 200,
) -> HttpResponse:
    """One key's own limits per model family next to its tenant's: every family the tenant
    may use, plus any the key still has limits for after the tenant lost it."""
    tenant_limits = {lim.family: lim for lim in selectors.limit_list(tenant=acc.tenant)}
    own = {lim.family: lim for lim in selectors.api_key_limit_list(api_key=key)}
    families = set(tenant_limits) | set(own) | ({bound.prefix} if bound and bound.prefix else set())
    rows = []
    for family in sorted(families):
        tenant, mine = tenant_limits.get(family), own.get(family)
        form = bound if bound is not None and bound.prefix == family else None
        if form is None:
            initial = {n: getattr(mine, n) for n in forms.KEY_LIMIT_FIELDS} if mine else {}
            form = forms.KeyLimitForm(initial=initial, prefix=family, **_tenant_ceilings(tenant))
        rows.append({"family": family, "tenant": tenant, "own": mine, "form": form})
    return render(
        request,
        "console/key_limits.html",
        {
            "key": key,
            "rows": rows,
            "can_write": acc.role in selectors.KEY_WRITERS and key.revoked_at is None,
        },
        status=status,
    )


@never_cache
@require_http_methods(["GET"])
@access.tenant_page(selectors.KEY_READERS, "see API keys")
def key_limits(request: HttpRequest, acc: TenantAccess, key_id: UUID) -> HttpResponse:
    key = selectors.api_key_get(tenant=acc.tenant, key_id=key_id)
    return _key_limits_page(request, acc, key)


@require_POST
@access.tenant_page(selectors.KEY_WRITERS, "change key limits")
def key_limit_set(
    request: HttpRequest, acc: TenantAccess, key_id: UUID, family: str
) -> HttpResponse:
    """Save (or, with every field empty or ``action=clear``, remove) one family's limits of
    one key: one service call, so an error writes nothing."""
    key = selectors.api_key_get(tenant=acc.tenant, key_id=key_id)
    family_obj = selectors.family_get(name=family)
    if family_obj is None:
        raise Http404
    back = _tenant_url("key-limits", acc, key_id=key.id)
    limit = next(
        (lim for lim in selectors.limit_list(tenant=acc.tenant) if lim.family == family), None
    )
    form = forms.KeyLimitForm(request.POST, prefix=family, **_tenant_ceilings(limit))
    if request.POST.get("action") == "clear" or (form.is_valid() and form.is_empty()):
        services.api_key_limit_clear(api_key=key, family=family_obj)
        messages.success(request, f"{family}: “{key.name}” now has only the tenant's limits.")
        return redirect(back)
    if form.is_valid():
        try:
            services.api_key_limit_set(api_key=key, family=family_obj, **form.values())
        except ValidationError as exc:
            forms.apply_errors(form, exc)
        else:
            messages.success(request, f"{family}: limits of “{key.name}” saved.")
            return redirect(back)
    return _key_limits_page(request, acc, key, bound=form, status=400)


# -- usage ---------------------------------------------------------------------------------


def _usage_query(request: HttpRequest, acc: TenantAccess) -> tuple[forms.UsageFilterForm, Any]:
    models = sorted(
        ModelVersion.objects.filter(family__name__in=_families(acc)).values_list("name", flat=True)
    )
    keys_ = console_selectors.key_names(tenant=acc.tenant)
    first, last = forms.default_range(timezone.now().date())
    data = request.GET.copy()
    data.setdefault("start", first.isoformat())
    data.setdefault("end", last.isoformat())
    data.setdefault("granularity", "day")
    form = forms.UsageFilterForm(data, models=models, keys=keys_)
    if not form.is_valid():
        return form, None
    c = form.cleaned_data
    width = HOUR if c["granularity"] == "hour" else DAY
    win = console_selectors.window(c["start"], c["end"], width)
    model_filter = [c["model"]] if c.get("model") else None
    key_filter = [UUID(c["key"])] if c.get("key") else None
    return form, (win, model_filter, key_filter, keys_)


def _families(acc: TenantAccess) -> list[str]:
    return [limit.family for limit in selectors.limit_list(tenant=acc.tenant)] or ["-"]


@access.tenant_page(USAGE_READERS, "see usage")
def usage(request: HttpRequest, acc: TenantAccess) -> HttpResponse:
    form, query = _usage_query(request, acc)
    context: dict[str, Any] = {"form": form}
    if query is not None:
        win, model_filter, key_filter, key_labels = query
        series = console_selectors.usage_series(
            tenant=acc.tenant, win=win, models=model_filter, api_key_ids=key_filter
        )
        common = {"tenant": acc.tenant, "win": win, "models": model_filter}
        by_model = console_selectors.usage_breakdown(
            group="model", api_key_ids=key_filter, **common
        )
        by_key = console_selectors.usage_breakdown(
            group="api_key_id", api_key_ids=key_filter, **common
        )
        context.update(
            {
                "chart": {
                    "hourly": win.width == HOUR,
                    "labels": series.labels,
                    "uncached": series.uncached,
                    "cached": series.cached,
                    "completion": series.completion,
                },
                "has_data": any(series.requests),
                "totals": sum((t for _, t in by_model), start=console_selectors.Totals()),
                "by_model": by_model,
                "by_key": [(key_labels.get(k, k), t) for k, t in by_key],
                "csv_query": request.GET.urlencode(),
            }
        )
    partial = request.headers.get("HX-Request") == "true"
    template = "console/partials/usage_body.html" if partial else "console/usage.html"
    return render(request, template, context, status=200 if query is not None else 400)


@access.tenant_page(USAGE_READERS, "see usage")
def usage_csv(request: HttpRequest, acc: TenantAccess) -> HttpResponse:
    """The usage API's CSV (grouped by model and key) for the chosen range: the same rows
    and bytes as ``/api/v1/tenants/<id>/usage/completions.csv?group_by=model,api_key_id``."""
    from metering.apis import UsagePageOutput  # the API's own serializer, not a copy
    from metering.selectors import usage_buckets

    form, query = _usage_query(request, acc)
    if query is None:
        return HttpResponse(
            json.dumps({"errors": form.errors.get_json_data()}),
            status=400,
            content_type="application/json",
        )
    win, model_filter, key_filter, _ = query
    buckets = usage_buckets(
        tenant=acc.tenant,
        window=win,
        group_by=("model", "api_key_id"),
        models=model_filter,
        api_key_ids=key_filter,
    )
    page = {"data": buckets, "has_more": False, "next_page": None}
    body = UsageCsvRenderer().render(UsagePageOutput(page).data)
    response = HttpResponse(body, content_type="text/csv; charset=utf-8")
    name = f"usage-{acc.tenant.id}-{win.start}-{win.end}.csv"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response


# -- limits --------------------------------------------------------------------------------


@access.tenant_page(selectors.LIMIT_READERS, "see limits")
def limits(request: HttpRequest, acc: TenantAccess) -> HttpResponse:
    return render(
        request,
        "console/limits.html",
        {"limits": selectors.limit_list(tenant=acc.tenant), "plan": acc.tenant.plan},
    )


# -- members -------------------------------------------------------------------------------


def _members_page(
    request: HttpRequest, acc: TenantAccess, form: forms.MemberAddForm, status: int = 200
) -> HttpResponse:
    return render(
        request,
        "console/members.html",
        {
            "members": selectors.membership_list(tenant=acc.tenant),
            "form": form,
            "roles": [(Role(r).label, access.ROLE_MEANINGS[Role(r)]) for r in Role.values],
            "role_choices": Role.choices,
            "is_owner": acc.role == Role.OWNER,
        },
        status=status,
    )


def _check_owner_change(acc: TenantAccess, *roles: str) -> None:
    if Role.OWNER in roles:
        acc.require((Role.OWNER,), "grant, change or remove the owner role")


@require_http_methods(["GET", "POST"])
@access.tenant_page(selectors.MEMBER_MANAGERS, "manage members")
def members(request: HttpRequest, acc: TenantAccess) -> HttpResponse:
    if request.method != "POST":
        return _members_page(request, acc, forms.MemberAddForm())
    form = forms.MemberAddForm(request.POST)
    if form.is_valid():
        login = form.cleaned_data["user"]
        user = get_user_model().objects.filter(Q(username=login) | Q(email__iexact=login)).first()
        if user is None:
            form.add_error("user", "No account has this username or email.")
        else:
            _check_owner_change(acc, form.cleaned_data["role"])
            try:
                services.membership_add(
                    tenant=acc.tenant, user=user, role=form.cleaned_data["role"]
                )
            except ValidationError as exc:
                forms.apply_errors(form, exc)
                if form.errors.get("__all__") and not form.errors.get("user"):
                    form.add_error("user", form.errors.pop("__all__")[0])
            else:
                messages.success(request, f"{user.get_username()} was added.")
                return redirect(_tenant_url("members", acc))
    return _members_page(request, acc, form, status=400)


@require_POST
@access.tenant_page(selectors.MEMBER_MANAGERS, "manage members")
def member_role(request: HttpRequest, acc: TenantAccess, member_id: int) -> HttpResponse:
    membership = selectors.membership_get(tenant=acc.tenant, membership_id=member_id)
    form = forms.MemberRoleForm(request.POST)
    if form.is_valid():
        _check_owner_change(acc, membership.role, form.cleaned_data["role"])
        try:
            services.membership_change_role(membership=membership, role=form.cleaned_data["role"])
        except ValidationError as exc:
            messages.error(request, " ".join(exc.messages))
        else:
            messages.success(request, f"{membership.user} is now {membership.role}.")
    else:
        messages.error(request, "Pick a role from the list.")
    return redirect(_tenant_url("members", acc))


@require_http_methods(["GET", "POST"])
@access.tenant_page(selectors.MEMBER_MANAGERS, "manage members")
def member_remove(request: HttpRequest, acc: TenantAccess, member_id: int) -> HttpResponse:
    membership = selectors.membership_get(tenant=acc.tenant, membership_id=member_id)
    _check_owner_change(acc, membership.role)
    if request.method == "POST":
        try:
            services.membership_remove(membership=membership)
        except ValidationError as exc:
            messages.error(request, " ".join(exc.messages))
        else:
            messages.success(request, f"{membership.user} was removed.")
        return redirect(_tenant_url("members", acc))
    return render(request, "console/member_remove.html", {"membership": membership})
