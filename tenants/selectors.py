"""Reads, always scoped to what the caller may see.

A tenant the caller does not belong to does not exist for them (404, never 403), so ids
cannot be probed across tenants. Staff users are operators and see every tenant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404

from catalog.models import ModelFamily
from tenants.limits import EffectiveLimit, effective_limits
from tenants.models import ApiKey, Membership, Role, Tenant

STAFF = "staff"
# Who may do what (issue 2). Billing members see invoices only (billing issue), so they are
# in no list here. Staff pass every check.
KEY_READERS = (Role.OWNER, Role.ADMIN, Role.MEMBER)
KEY_WRITERS = (Role.OWNER, Role.ADMIN)
LIMIT_READERS = (Role.OWNER, Role.ADMIN, Role.MEMBER)
MEMBER_MANAGERS = (Role.OWNER, Role.ADMIN)
TENANT_EDITORS = (Role.OWNER, Role.ADMIN)

User = AbstractBaseUser | AnonymousUser


@dataclass(frozen=True, slots=True)
class TenantAccess:
    tenant: Tenant
    role: str  # a Role value, or STAFF

    @property
    def is_staff(self) -> bool:
        return self.role == STAFF

    def require(self, roles: tuple[str, ...], action: str) -> None:
        if not self.is_staff and self.role not in roles:
            raise PermissionDenied(f"Your role ({self.role}) may not {action}.")

    def require_staff(self, action: str) -> None:
        if not self.is_staff:
            raise PermissionDenied(f"Only operators may {action}.")


def _is_staff(user: Any) -> bool:
    return bool(getattr(user, "is_staff", False) and getattr(user, "is_active", False))


def tenant_list_for_user(*, user: Any) -> QuerySet[Tenant]:
    tenants = Tenant.objects.select_related("plan").order_by("name")
    if _is_staff(user):
        return tenants
    return tenants.filter(memberships__user=user)


def tenant_roles_for_user(*, user: Any) -> dict[Any, str]:
    return dict(Membership.objects.filter(user=user).values_list("tenant_id", "role"))


def tenant_access(*, user: Any, tenant_id: Any) -> TenantAccess:
    tenant = Tenant.objects.select_related("plan").filter(pk=tenant_id).first()
    if tenant is None:
        raise Http404
    if _is_staff(user):
        return TenantAccess(tenant=tenant, role=STAFF)
    role = (
        Membership.objects.filter(tenant=tenant, user=user).values_list("role", flat=True).first()
    )
    if role is None:
        raise Http404  # not a member: indistinguishable from a tenant that does not exist
    return TenantAccess(tenant=tenant, role=role)


def api_key_list(*, tenant: Tenant) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(tenant=tenant).select_related("created_by").order_by("-created_at")


def api_key_get(*, tenant: Tenant, key_id: Any) -> ApiKey:
    key = api_key_list(tenant=tenant).filter(pk=key_id).first()
    if key is None:
        raise Http404
    return key


def membership_list(*, tenant: Tenant) -> QuerySet[Membership]:
    return (
        Membership.objects.filter(tenant=tenant).select_related("user").order_by("user__username")
    )


def membership_get(*, tenant: Tenant, membership_id: Any) -> Membership:
    membership = membership_list(tenant=tenant).filter(pk=membership_id).first()
    if membership is None:
        raise Http404
    return membership


def limit_list(*, tenant: Tenant) -> list[EffectiveLimit]:
    return list(effective_limits(tenant).values())


def limit_get(*, tenant: Tenant, family: str) -> EffectiveLimit:
    limit = effective_limits(tenant).get(family)
    if limit is None:
        raise Http404
    return limit


def family_get(*, name: str) -> ModelFamily | None:
    return ModelFamily.objects.filter(name=name).first()
