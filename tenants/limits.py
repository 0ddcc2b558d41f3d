"""Effective limits: a plan's defaults per model family, replaced by a tenant's override.

A tenant may use a model family when its plan has default limits for it or the tenant has
an override for it; the gateway refuses families with no limits. A reserved floor only
applies on a plan with the ``reserved`` admission class, so a tenant moved off enterprise
loses its floor even if an old override still carries one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal
from uuid import UUID

from tenants.models import LIMIT_FIELDS, PlanModelLimit, Tenant, TenantModelLimit

Source = Literal["plan", "override"]


@dataclass(frozen=True, slots=True)
class EffectiveLimit:
    family: str
    source: Source
    rpm: int
    tpm: int
    max_context: int
    max_output: int
    kv_seconds_cap: int
    reserved_kv: int


def merge_limits(
    *,
    plan_limits: dict[str, dict[str, int]],
    overrides: dict[str, dict[str, int]],
    reserved_class: bool,
) -> dict[str, EffectiveLimit]:
    """Pure merge; families sorted so serialised records are byte-stable."""
    merged: dict[str, EffectiveLimit] = {}
    for family in sorted(set(plan_limits) | set(overrides)):
        source: Source = "override" if family in overrides else "plan"
        values = dict(overrides[family] if source == "override" else plan_limits[family])
        if not reserved_class:
            values["reserved_kv"] = 0
        merged[family] = EffectiveLimit(
            family=family, source=source, **{name: int(values[name]) for name in LIMIT_FIELDS}
        )
    return merged


def _rows_by_owner(
    rows: Iterable[dict[str, Any]], owner: str
) -> dict[Any, dict[str, dict[str, int]]]:
    out: dict[Any, dict[str, dict[str, int]]] = defaultdict(dict)
    for row in rows:
        out[row[owner]][str(row["family__name"])] = {name: int(row[name]) for name in LIMIT_FIELDS}
    return out


def effective_limits_for_tenants(
    tenants: Iterable[Tenant],
) -> dict[UUID, dict[str, EffectiveLimit]]:
    """Effective limits for many tenants in two queries (plans must be select_related)."""
    tenants = list(tenants)
    plan_ids = {t.plan_id for t in tenants}
    plan_rows = PlanModelLimit.objects.filter(plan_id__in=plan_ids).values(
        "plan_id", "family__name", *LIMIT_FIELDS
    )
    override_rows = TenantModelLimit.objects.filter(tenant__in=tenants).values(
        "tenant_id", "family__name", *LIMIT_FIELDS
    )
    by_plan = _rows_by_owner(plan_rows, "plan_id")
    by_tenant = _rows_by_owner(override_rows, "tenant_id")
    return {
        t.id: merge_limits(
            plan_limits=by_plan.get(t.plan_id, {}),
            overrides=by_tenant.get(t.id, {}),
            reserved_class=t.plan.is_reserved,
        )
        for t in tenants
    }


def effective_limits(tenant: Tenant) -> dict[str, EffectiveLimit]:
    return effective_limits_for_tenants([tenant])[tenant.id]
