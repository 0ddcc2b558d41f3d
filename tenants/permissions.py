"""Who is an operator: an active staff account holding ``tenants.operate``.

Being staff only lets an account sign in to staff surfaces (the Django admin, the staff pages
of the console); what it may do there comes from permissions. ``tenants.operate`` is the
operator's: create tenants, change their plans, limits and suspension, manage any tenant's
keys and members through the management API, and the fleet (catalog versions and replicas)
in the admin and the console. Finance holds billing's own permissions instead
(``billing.view_reconciliation``, ``billing.manage_invoices``), which do not make it an
operator. Grant ``tenants.operate`` per user or through a group (docs/operations.md,
"Staff roles and permissions").

The admin mixin below puts the same check on every write and action of the operators' admin
pages (tenants, plans, keys, limits, members, catalog versions and replicas), on top of
Django's per-model permissions.
"""

from __future__ import annotations

from typing import Any

from django.contrib.admin.options import BaseModelAdmin
from django.http import HttpRequest

OPERATE_CODENAME = "operate"
OPERATE = f"tenants.{OPERATE_CODENAME}"
OPERATE_NAME = "Operate tenants and the fleet: plans, limits, suspension, keys, replicas"


def is_operator(user: Any) -> bool:
    return bool(
        getattr(user, "is_active", False)
        and getattr(user, "is_staff", False)
        and user.has_perm(OPERATE)
    )


class OperatorAdminMixin(BaseModelAdmin):
    """Adding, changing and deleting need an operator as well as the model's own permission,
    and so does every action declared with ``permissions=["change"]`` (an action declared
    without permissions is open to anyone who may view the list); viewing needs only the
    model's view permission, as Django has it."""

    def has_add_permission(self, request: HttpRequest, *args: Any) -> bool:
        return is_operator(request.user) and super().has_add_permission(request, *args)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return is_operator(request.user) and super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return is_operator(request.user) and super().has_delete_permission(request, obj)
