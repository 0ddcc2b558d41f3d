"""The reserved-floor over-subscription check, run by the services that change limits or plans.

An enterprise tenant's reserved KV floor (GiB·s) is capacity sold in advance: the reserved
pool of the family's current version must be able to carry the sum of every tenant's floor at
the planned over-subscription (``contracts.formulas.check_reserved_floors``). A save that would
add to the floors of a family whose pool cannot carry them is refused with a validation error
on ``reserved_kv``. A save that does not add to them (the same values again, a lower floor,
another field) is let through even while the pool is short, so an operator can always move
towards a healthy state, and so can a pool shrunk after the floors were sold.
"""

from __future__ import annotations

from collections.abc import Callable

from django.core.exceptions import ValidationError

from catalog.models import ModelFamily, ModelVersion
from contracts.formulas import ReservedPoolSizing, check_reserved_floors
from tenants.limits import effective_limits_for_tenants
from tenants.models import Tenant

GIB = 1024**3


def reserved_floors() -> dict[str, list[int]]:
    """Every tenant's effective reserved floor per family (only non-zero ones)."""
    tenants = Tenant.objects.select_related("plan").filter(plan__admission_class="reserved")
    floors: dict[str, list[int]] = {}
    for limits in effective_limits_for_tenants(tenants).values():
        for family, limit in limits.items():
            if limit.reserved_kv > 0:
                floors.setdefault(family, []).append(limit.reserved_kv)
    return floors


def floor_problem(
    family: str, floors: list[int], sizing: ReservedPoolSizing | None = None
) -> str | None:
    """What is wrong with selling ``floors`` on the family's reserved pool, or None."""
    version = (
        ModelVersion.objects.filter(family__name=family, is_current=True)
        .select_related("family")
        .first()
    )
    if version is None or not floors:
        return None
    pool_replicas = version.replicas.filter(pool="reserved", is_enabled=True).count()
    replica_kv_gib = version.kv_capacity_tokens * version.kv_bytes_per_token / GIB
    return check_reserved_floors(
        floors,
        pool_replicas=pool_replicas,
        replica_kv_gib=replica_kv_gib,
        sizing=sizing or ReservedPoolSizing(),
    )


def check_floors_after(
    change: Callable[[], object], *, families: list[ModelFamily] | None = None
) -> None:
    """Run ``change`` (inside the caller's transaction), then refuse it with a
    ValidationError when it added floor to a family whose reserved pool cannot carry it.
    The caller's atomic block rolls the change back."""
    before = reserved_floors()
    change()
    after = reserved_floors()
    names = {f.name for f in families} if families is not None else set(before) | set(after)
    for family in sorted(names):
        added = sum(after.get(family, [])) > sum(before.get(family, []))
        if added:
            problem = floor_problem(family, after[family])
            if problem is not None:
                raise ValidationError(
                    {"reserved_kv": f"{family}: {problem}. Add reserved-pool replicas first."}
                )
