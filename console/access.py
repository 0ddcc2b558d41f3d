"""Who may open which console page.

Customer pages are scoped to the signed-in user's memberships only: a tenant the user is not
a member of does not exist for them (404), whether or not they are staff. Operators and
finance staff have their own pages, gated by ``is_staff`` plus a permission: operators hold
``tenants.operate`` (``tenants.permissions``, the same check as the management API and the
admin), finance billing's own permissions (the ones its API checks). Staff alone opens none.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar, cast
from uuid import UUID

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse

from tenants import selectors
from tenants.models import Role, Tenant
from tenants.permissions import is_operator  # the operators' check, for pages and templates

# billing's permissions, as its finance API checks them.
FINANCE = "billing.view_reconciliation"
MANAGE_INVOICES = "billing.manage_invoices"

# Pages per role (the management API's role lists, plus billing members seeing invoices).
OVERVIEW_READERS = (Role.OWNER, Role.ADMIN, Role.BILLING, Role.MEMBER)
INVOICE_READERS = (Role.OWNER, Role.ADMIN, Role.BILLING)

ROLE_MEANINGS = {
    Role.OWNER: "Everything, including granting or removing the owner role. "
    "A tenant always keeps at least one owner.",
    Role.ADMIN: "Manage API keys and members (except owners); see usage, spend and invoices.",
    Role.BILLING: "See usage, spend and invoices; no API keys.",
    Role.MEMBER: "See API keys, usage and limits; cannot create or revoke keys.",
}

V = TypeVar("V", bound=Callable[..., HttpResponse])


def is_finance(user: Any) -> bool:
    return bool(user.is_active and user.is_staff and user.has_perm(FINANCE))


def can_manage_invoices(user: Any) -> bool:
    return bool(user.is_active and user.is_staff and user.has_perm(MANAGE_INVOICES))


def memberships(user: Any) -> list[tuple[Tenant, str]]:
    """The user's tenants (name order) with their role in each."""
    roles = selectors.tenant_roles_for_user(user=user)
    tenants = Tenant.objects.select_related("plan").filter(pk__in=roles).order_by("name")
    return [(t, roles[t.pk]) for t in tenants]


def tenant_access(user: Any, tenant_id: UUID) -> selectors.TenantAccess:
    roles = selectors.tenant_roles_for_user(user=user)
    if tenant_id not in roles:
        raise Http404  # not a member: indistinguishable from a tenant that does not exist
    tenant = Tenant.objects.select_related("plan").get(pk=tenant_id)
    return selectors.TenantAccess(tenant=tenant, role=roles[tenant_id])


def tenant_page(roles: tuple[str, ...], action: str) -> Callable[[V], V]:
    """A customer page: signed in, a member of the tenant in the URL, one of ``roles``."""

    def decorate(view: V) -> V:
        @login_required
        @wraps(view)
        def wrapper(request: HttpRequest, tenant_id: UUID, *args: Any, **kwargs: Any) -> Any:
            access = tenant_access(request.user, tenant_id)
            access.require(roles, action)
            request.access = access
            return view(request, access, *args, **kwargs)

        return cast(V, wrapper)

    return decorate


def staff_page(check: Callable[[Any], bool], what: str) -> Callable[[V], V]:
    def decorate(view: V) -> V:
        @login_required
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            if not check(request.user):
                raise PermissionDenied(f"Only {what} may open this page.")
            return view(request, *args, **kwargs)

        return cast(V, wrapper)

    return decorate


def operator_page(view: V) -> V:
    return staff_page(is_operator, "operators")(view)


def finance_page(view: V) -> V:
    return staff_page(is_finance, "finance staff")(view)
