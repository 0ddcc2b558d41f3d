"""Reads, always scoped to what the caller may see.

A tenant the caller does not belong to does not exist for them (404, never 403), so ids
cannot be probed across tenants. Operators (staff holding ``tenants.operate``, see
``tenants.permissions``) see every tenant; any other staff account is scoped to its own
memberships like everyone else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.core.exceptions import PermissionDenied
from django.db.models import Q, QuerySet
from django.http import Http404

from catalog.models import ModelFamily
from tenants.limits import EffectiveLimit, effective_limits
from tenants.models import (
    ApiKey,
    ApiKeyModelLimit,
    ApiToken,
    ApiTokenScheme,
    Membership,
    Role,
    Tenant,
)
from tenants.permissions import is_operator
from tenants.services import api_token_hash, api_token_hash_unlabelled

OPERATOR = "operator"
# Who may do what. Billing members see invoices only (billing/ checks its own pages), so they
# are in no list here. Operators pass every check.
KEY_READERS = (Role.OWNER, Role.ADMIN, Role.MEMBER)
KEY_WRITERS = (Role.OWNER, Role.ADMIN)
LIMIT_READERS = (Role.OWNER, Role.ADMIN, Role.MEMBER)
MEMBER_MANAGERS = (Role.OWNER, Role.ADMIN)
TENANT_EDITORS = (Role.OWNER, Role.ADMIN)

User = AbstractBaseUser | AnonymousUser


@dataclass(frozen=True, slots=True)
class TenantAccess:
    tenant: Tenant
    role: str  # a Role value, or OPERATOR

    @property
    def is_operator(self) -> bool:
        return self.role == OPERATOR

    def require(self, roles: tuple[str, ...], action: str) -> None:
        if not self.is_operator and self.role not in roles:
            raise PermissionDenied(f"Your role ({self.role}) may not {action}.")


def require_operator(*, user: Any, action: str) -> None:
    """For operator-only actions: checked before any tenant is looked up, so the answer (403)
    is the same for every tenant id and says nothing about which exist."""
    if not is_operator(user):
        raise PermissionDenied(
            f"Only operators (staff holding the tenants.operate permission) may {action}."
        )


def tenant_list_for_user(*, user: Any) -> QuerySet[Tenant]:
    tenants = Tenant.objects.select_related("plan").order_by("name")
    if is_operator(user):
        return tenants
    return tenants.filter(memberships__user=user)


def tenant_roles_for_user(*, user: Any) -> dict[Any, str]:
    return dict(Membership.objects.filter(user=user).values_list("tenant_id", "role"))


def tenant_access(*, user: Any, tenant_id: Any) -> TenantAccess:
    tenant = Tenant.objects.select_related("plan").filter(pk=tenant_id).first()
    if tenant is None:
        raise Http404
    if is_operator(user):
        return TenantAccess(tenant=tenant, role=OPERATOR)
    role = (
        Membership.objects.filter(tenant=tenant, user=user).values_list("role", flat=True).first()
    )
    if role is None:
        raise Http404  # not a member: indistinguishable from a tenant that does not exist
    return TenantAccess(tenant=tenant, role=role)


def api_key_list(*, tenant: Tenant) -> QuerySet[ApiKey]:
    return (
        ApiKey.objects.filter(tenant=tenant)
        .select_related("created_by")
        .order_by("-created_at", "-pk")
    )


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


@dataclass(frozen=True, slots=True)
class KeyLimit:
    """A key's own limits for one family next to what binds: the gateway enforces the key's
    and the tenant's, so the effective value is the smaller (a tenant 0 is unlimited)."""

    family: str
    rpm: int | None
    tpm: int | None
    max_concurrency: int | None
    tenant_rpm: int | None  # None: the tenant no longer has this family
    tenant_tpm: int | None

    @staticmethod
    def _tighter(key: int | None, tenant: int | None) -> int | None:
        if tenant is None:
            return 0  # no access at all
        if key is None:
            return tenant
        return key if tenant == 0 else min(key, tenant)

    @property
    def effective_rpm(self) -> int | None:
        return self._tighter(self.rpm, self.tenant_rpm)

    @property
    def effective_tpm(self) -> int | None:
        return self._tighter(self.tpm, self.tenant_tpm)


def _key_limit(row: ApiKeyModelLimit, tenant: EffectiveLimit | None) -> KeyLimit:
    return KeyLimit(
        family=row.family.name,
        rpm=row.rpm,
        tpm=row.tpm,
        max_concurrency=row.max_concurrency,
        tenant_rpm=None if tenant is None else tenant.rpm,
        tenant_tpm=None if tenant is None else tenant.tpm,
    )


def api_key_limit_list(*, api_key: ApiKey) -> list[KeyLimit]:
    tenant_limits = effective_limits(api_key.tenant)
    rows = ApiKeyModelLimit.objects.filter(api_key=api_key).select_related("family")
    return [
        _key_limit(row, tenant_limits.get(row.family.name)) for row in rows.order_by("family__name")
    ]


def api_key_limits_by_key(*, tenant: Tenant) -> dict[Any, list[KeyLimit]]:
    """Every key's own limits in the tenant (key id -> per family), in one query plus the
    tenant's limits: for a page listing all keys."""
    tenant_limits = effective_limits(tenant)
    rows = ApiKeyModelLimit.objects.filter(api_key__tenant=tenant).select_related("family")
    out: dict[Any, list[KeyLimit]] = {}
    for row in rows.order_by("family__name"):
        out.setdefault(row.api_key_id, []).append(
            _key_limit(row, tenant_limits.get(row.family.name))
        )
    return out


def api_key_limit_get(*, api_key: ApiKey, family: str) -> KeyLimit:
    limit = next((lim for lim in api_key_limit_list(api_key=api_key) if lim.family == family), None)
    if limit is None:
        raise Http404
    return limit


# -- management-API tokens ----------------------------------------------------------------


def api_token_for_secret(*, secret: str) -> ApiToken | None:
    """The token a caller presents, with its user, expired or not. Found by its digest in a
    unique index: the secret itself is never compared, so no timing says how much of it
    matched.

    Tokens issued before digests were labelled (``ApiTokenScheme.UNLABELLED``) are looked up
    under their own digest, and only among rows of that scheme, so a labelled row is never
    matched by the API keys' HMAC. They are accepted as they are until they expire rather
    than re-hashed on use: every token expires within ``FAIRWAY_API_TOKEN_MAX_AGE_H`` hours
    and the hourly task then deletes it, so the old scheme leaves the table by itself one
    maximum age after the upgrade, with no write on the authentication path (and no race
    between a token's concurrent requests) to get there. One more HMAC per request is all
    the fallback costs; once no unlabelled row is left, a later release can drop it."""
    match = Q(scheme=ApiTokenScheme.LABELLED, token_hash=api_token_hash(secret)) | Q(
        scheme=ApiTokenScheme.UNLABELLED, token_hash=api_token_hash_unlabelled(secret)
    )
    return ApiToken.objects.select_related("user").filter(match).first()
