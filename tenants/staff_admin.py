"""Staff accounts in the admin: nobody but a superuser can raise an account's powers.

Django's own user and group pages let whoever may change users or groups
(``auth.change_user``, ``auth.change_group``) grant any permission, superuser status
included, to any account, their own too. Here, for anyone but a superuser:

- an account's superuser flag, groups and own permissions, and a group's permissions, are
  read-only (the rest of the account, such as its name or active flag, stays editable with
  the model permission);
- a superuser's account cannot be changed or deleted (its password would be a takeover);
- the management-API token pages are closed. A superuser sees each token's prefix, user and
  times (never the token: only its digest is stored, and that is not shown either) and
  revokes tokens by deleting them; tokens are issued by the API only (``tenants.auth``).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User
from django.http import HttpRequest

from tenants.models import ApiToken

USER_POWERS = ("is_superuser", "groups", "user_permissions")


def _superuser(request: HttpRequest) -> bool:
    return bool(request.user.is_active and request.user.is_superuser)


class StaffUserAdmin(UserAdmin):
    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        fields = tuple(super().get_readonly_fields(request, obj))
        if obj is None or _superuser(request):
            return fields
        return fields + USER_POWERS

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and obj.is_superuser and not _superuser(request):
            return False
        return super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and obj.is_superuser and not _superuser(request):
            return False
        return super().has_delete_permission(request, obj)


class StaffGroupAdmin(GroupAdmin):
    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        fields = tuple(super().get_readonly_fields(request, obj))
        return fields if _superuser(request) else (*fields, "permissions")


class SuperuserApiTokenAdmin(admin.ModelAdmin):
    list_display = ("prefix", "user", "created_at", "last_used_at")
    list_select_related = ("user",)
    search_fields = ("prefix", "user__username", "user__email")
    # token_hash is deliberately in no field list.
    fields = ("prefix", "user", "created_at", "last_used_at")
    readonly_fields = fields

    def has_module_permission(self, request: HttpRequest) -> bool:
        return _superuser(request)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _superuser(request)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # issued by POST /api/v1/auth/token/, which shows the token once

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _superuser(request)  # deleting is revoking


def register(site: admin.AdminSite) -> None:
    """Replace Django's registrations (its apps' admins load first); add the tokens'."""
    for model, model_admin in (
        (User, StaffUserAdmin),
        (Group, StaffGroupAdmin),
        (ApiToken, SuperuserApiTokenAdmin),
    ):
        if site.is_registered(model):
            site.unregister(model)
        site.register(model, model_admin)
