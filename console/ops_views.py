"""Operators' pages: the live fleet and every tenant's plan, suspension and limits."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from uuid import UUID

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST

from catalog.models import ModelFamily, Replica
from console import access, forms, metrics
from console import selectors as console_selectors
from tenants import selectors, services
from tenants.limits import effective_limits_for_tenants
from tenants.models import LIMIT_FIELDS, Tenant


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    replica: Replica
    scrape: metrics.Scrape

    @property
    def kv(self) -> float | None:
        return self.scrape.first(metrics.KV_USAGE)

    @property
    def kv_percent(self) -> float | None:
        return None if self.kv is None else round(self.kv * 100, 1)

    @property
    def running(self) -> float | None:
        return self.scrape.first(metrics.RUNNING)

    @property
    def waiting(self) -> float | None:
        return self.scrape.first(metrics.WAITING)


def _fleet_context() -> dict[str, Any]:
    replicas = list(
        Replica.objects.select_related("version", "version__family").order_by(
            "version__name", "pool", "name"
        )
    )
    scrapes = metrics.scrape_many([r.base_url for r in replicas], health=True)
    by_version: dict[str, list[ReplicaRow]] = {}
    for replica, scrape in zip(replicas, scrapes, strict=True):
        by_version.setdefault(replica.version.name, []).append(ReplicaRow(replica, scrape))
    admission = metrics.gateway_admission()
    return {
        "by_version": by_version,
        "admission": admission,
        "pipeline": metrics.usage_pipeline(),
        "dead_letters_24h": console_selectors.dead_letters_since(
            since=timezone.now() - timedelta(hours=24)
        ),
    }


@access.operator_page
def fleet(request: HttpRequest) -> HttpResponse:
    context = _fleet_context()
    partial = request.headers.get("HX-Request") == "true"
    template = "console/ops/partials/fleet_body.html" if partial else "console/ops/fleet.html"
    return render(request, template, context)


@access.operator_page
def tenants(request: HttpRequest) -> HttpResponse:
    rows = list(Tenant.objects.select_related("plan").order_by("name"))
    limits = effective_limits_for_tenants(rows)
    return render(
        request,
        "console/ops/tenants.html",
        {
            "rows": [
                (t, sum(1 for lim in limits[t.id].values() if lim.source == "override"))
                for t in rows
            ]
        },
    )


def _tenant(tenant_id: UUID) -> Tenant:
    tenant = Tenant.objects.select_related("plan").filter(pk=tenant_id).first()
    if tenant is None:
        raise Http404
    return tenant


def _tenant_page(
    request: HttpRequest,
    tenant: Tenant,
    *,
    plan_form: forms.TenantPlanForm | None = None,
    limit_forms: dict[str, forms.LimitForm] | None = None,
    status: int = 200,
) -> HttpResponse:
    current = {lim.family: lim for lim in selectors.limit_list(tenant=tenant)}
    families = list(ModelFamily.objects.order_by("name"))
    given = limit_forms or {}
    rows = []
    for family in families:
        limit = current.get(family.name)
        initial = {n: getattr(limit, n) for n in LIMIT_FIELDS} if limit else {}
        form = given.get(family.name) or forms.LimitForm(initial=initial, prefix=family.name)
        rows.append((family, limit, form))
    return render(
        request,
        "console/ops/tenant_detail.html",
        {
            "tenant": tenant,
            "plan_form": plan_form
            or forms.TenantPlanForm(
                initial={"plan": tenant.plan, "suspended": tenant.is_suspended}
            ),
            "rows": rows,
        },
        status=status,
    )


@require_http_methods(["GET", "POST"])
@access.operator_page
def tenant_detail(request: HttpRequest, tenant_id: UUID) -> HttpResponse:
    tenant = _tenant(tenant_id)
    if request.method != "POST":
        return _tenant_page(request, tenant)
    form = forms.TenantPlanForm(request.POST)
    if form.is_valid():
        try:
            if form.cleaned_data["plan"] != tenant.plan:
                tenant = services.tenant_change_plan(tenant=tenant, plan=form.cleaned_data["plan"])
            if form.cleaned_data["suspended"] != tenant.is_suspended:
                tenant = services.tenant_set_suspended(
                    tenant=tenant, suspended=form.cleaned_data["suspended"]
                )
        except ValidationError as exc:
            # The plan is what the operator chose; the floor check names reserved_kv.
            form.add_error("plan", " ".join(exc.messages))
        else:
            messages.success(request, f"{tenant.name}: plan and suspension saved.")
            return redirect("console:ops-tenant", tenant_id=tenant.id)
    return _tenant_page(request, _tenant(tenant_id), plan_form=form, status=400)


@require_POST
@access.operator_page
def tenant_limit(request: HttpRequest, tenant_id: UUID, family: str) -> HttpResponse:
    tenant = _tenant(tenant_id)
    family_obj = selectors.family_get(name=family)
    if family_obj is None:
        raise Http404
    if request.POST.get("action") == "clear":
        services.tenant_limit_clear(tenant=tenant, family=family_obj)
        messages.success(request, f"{family}: back to the plan's defaults.")
        return redirect("console:ops-tenant", tenant_id=tenant.id)
    form = forms.LimitForm(request.POST, prefix=family)
    if form.is_valid():
        try:
            services.tenant_limit_set(tenant=tenant, family=family_obj, **form.cleaned_data)
        except ValidationError as exc:
            forms.apply_errors(form, exc)
        else:
            messages.success(request, f"{family}: limits saved.")
            return redirect("console:ops-tenant", tenant_id=tenant.id)
    return _tenant_page(request, tenant, limit_forms={family: form}, status=400)
