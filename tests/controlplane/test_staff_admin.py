"""Only a superuser raises an account's powers in the admin: whoever may change users or
groups edits accounts, not their permissions, and only a superuser sees or revokes
management-API tokens (never their secret)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import Group, Permission
from django.test import Client
from rest_framework.test import APIClient

from tenants import services

from .conftest import grant

pytestmark = pytest.mark.django_db

ACCOUNT_MANAGER = (
    "auth.view_user",
    "auth.change_user",
    "auth.delete_user",
    "auth.view_group",
    "auth.change_group",
    "tenants.view_apitoken",
    "tenants.delete_apitoken",
)


def _login(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _user_form(user: Any, **changes: Any) -> dict[str, Any]:
    """The admin's user change form as a browser posts it."""
    joined = user.date_joined
    data: dict[str, Any] = {
        "username": user.username,
        "first_name": user.first_name,
        "last_name": user.last_name,
        "email": user.email,
        "is_active": "on",
        "date_joined_0": f"{joined:%Y-%m-%d}",
        "date_joined_1": f"{joined:%H:%M:%S}",
        "initial-date_joined_0": f"{joined:%Y-%m-%d}",
        "initial-date_joined_1": f"{joined:%H:%M:%S}",
    }
    if user.is_staff:
        data["is_staff"] = "on"
    data.update(changes)
    return data


def test_an_account_manager_edits_accounts_but_cannot_grant_powers(
    make_user: Callable[..., Any],
) -> None:
    manager = grant(make_user("accounts", is_staff=True), *ACCOUNT_MANAGER)
    admin = _login(manager)
    operate = Permission.objects.get(codename="operate", content_type__app_label="tenants")
    operators = Group.objects.create(name="operators")
    operators.permissions.add(operate)

    # Its own account: the name changes, the powers posted with it do not.
    url = f"/admin/auth/user/{manager.pk}/change/"
    page = admin.get(url)
    assert page.status_code == 200
    assert {"is_superuser", "groups", "user_permissions"} <= set(
        page.context["adminform"].readonly_fields
    )
    posted = _user_form(
        manager,
        first_name="Ada",
        is_superuser="on",
        groups=[operators.pk],
        user_permissions=[operate.pk],
    )
    assert admin.post(url, posted).status_code == 302
    manager.refresh_from_db()
    assert manager.first_name == "Ada"
    assert not manager.is_superuser
    assert not manager.groups.exists()
    assert not manager.user_permissions.filter(pk=operate.pk).exists()

    # Nor another's, nor a group's permissions.
    other = make_user("someone", is_staff=True)
    admin.post(
        f"/admin/auth/user/{other.pk}/change/",
        _user_form(other, is_superuser="on", user_permissions=[operate.pk]),
    )
    other.refresh_from_db()
    assert not other.is_superuser and not other.user_permissions.exists()
    mine = Group.objects.create(name="mine")
    assert admin.get(f"/admin/auth/group/{mine.pk}/change/").status_code == 200
    admin.post(
        f"/admin/auth/group/{mine.pk}/change/", {"name": "mine", "permissions": [operate.pk]}
    )
    assert not mine.permissions.exists()

    # A superuser's account is out of reach (its password would be a takeover) ...
    root = make_user("root", is_staff=True, is_superuser=True)
    shown = admin.get(f"/admin/auth/user/{root.pk}/change/")
    assert shown.status_code == 200 and not shown.context["has_change_permission"]  # read only
    assert admin.post(f"/admin/auth/user/{root.pk}/change/", _user_form(root)).status_code == 403
    assert admin.post(f"/admin/auth/user/{root.pk}/delete/", {"post": "yes"}).status_code == 403
    assert admin.post(f"/admin/auth/user/{root.pk}/password/", {}).status_code == 403
    root.refresh_from_db()
    assert root.is_active
    # ... and so are management-API tokens: revoking another account's access is a
    # superuser's call.
    token, _ = services.api_token_create(user=root)
    assert admin.get("/admin/tenants/apitoken/").status_code == 403
    assert admin.get("/admin/tenants/apitoken/add/").status_code == 403
    assert admin.get(f"/admin/tenants/apitoken/{token.pk}/change/").status_code == 403
    assert (
        admin.post(f"/admin/tenants/apitoken/{token.pk}/delete/", {"post": "yes"}).status_code
        == 403
    )
    assert services.api_token_revoke(token=token)  # it was still there


def test_a_superuser_still_grants_powers_and_sees_tokens(make_user: Callable[..., Any]) -> None:
    root = make_user("root", is_staff=True, is_superuser=True)
    admin = _login(root)
    someone = make_user("someone", is_staff=True)
    operate = Permission.objects.get(codename="operate", content_type__app_label="tenants")
    page = admin.post(
        f"/admin/auth/user/{someone.pk}/change/",
        _user_form(someone, user_permissions=[operate.pk]),
    )
    assert page.status_code == 302, page.context and page.context["adminform"].form.errors
    assert someone.user_permissions.filter(pk=operate.pk).exists()

    # Tokens: listed by prefix, never the token nor its digest; deleting one revokes it.
    token, secret = services.api_token_create(user=someone)
    listed = admin.get("/admin/tenants/apitoken/")
    assert listed.status_code == 200 and token.prefix.encode() in listed.content
    shown = admin.get(f"/admin/tenants/apitoken/{token.pk}/change/")
    assert shown.status_code == 200
    for page in (listed, shown):
        assert secret.encode() not in page.content
        assert token.token_hash.encode() not in page.content
    assert admin.get("/admin/tenants/apitoken/add/").status_code == 403  # issued by the API
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {secret}")
    assert api.get("/api/v1/tenants/").status_code == 200
    deleted = admin.post(f"/admin/tenants/apitoken/{token.pk}/delete/", {"post": "yes"})
    assert deleted.status_code == 302
    assert api.get("/api/v1/tenants/").status_code == 401
