"""A member of tenant A gets 404 for every page and object of tenant B, and signing in is
rate-limited by django-axes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client, override_settings

from tenants import services
from tenants.models import Role, Tenant

pytestmark = pytest.mark.django_db


def test_a_member_of_a_gets_404_for_every_page_and_object_of_b(
    tenant_a: Tenant, tenant_b: Tenant, owner_a: Any, browser_for: Any, rm: Any
) -> None:
    key_b, _ = services.api_key_create(tenant=tenant_b, name="b's key")
    member_b = tenant_b.memberships.get(role=Role.OWNER)
    client = browser_for(owner_a)
    b = f"/t/{tenant_b.id}"
    gets = [
        f"{b}/",
        f"{b}/keys/",
        f"{b}/keys/{key_b.id}/revoke/",
        f"{b}/usage/",
        f"{b}/usage.csv",
        f"{b}/limits/",
        f"{b}/members/",
        f"{b}/members/{member_b.id}/remove/",
    ]
    for url in gets:
        assert client.get(url).status_code == 404, url
    posts = [
        (f"{b}/keys/", {"name": "x", "scopes": ["chat"]}),
        (f"{b}/keys/{key_b.id}/revoke/", {}),
        (f"{b}/members/", {"user": "owner-a", "role": "owner"}),
        (f"{b}/members/{member_b.id}/role/", {"role": "member"}),
        (f"{b}/members/{member_b.id}/remove/", {}),
    ]
    for url, data in posts:
        assert client.post(url, data).status_code == 404, url
    # Tenant A's pages with tenant B's object ids: 404 too.
    a = f"/t/{tenant_a.id}"
    assert client.get(f"{a}/keys/{key_b.id}/revoke/").status_code == 404
    assert client.post(f"{a}/keys/{key_b.id}/revoke/").status_code == 404
    assert client.post(f"{a}/members/{member_b.id}/role/", {"role": "member"}).status_code == 404
    assert client.get(f"{a}/members/{member_b.id}/remove/").status_code == 404
    # Nothing of B changed, and B's name appears nowhere in A's pages.
    key_b.refresh_from_db()
    assert key_b.revoked_at is None
    member_b.refresh_from_db()
    assert member_b.role == Role.OWNER
    for page in ("", "keys/", "usage/", "limits/", "members/"):
        assert "tenant-b" not in client.get(f"{a}/{page}").content.decode()


def test_anonymous_users_are_sent_to_sign_in(tenant_a: Tenant) -> None:
    for page in ("", "keys/", "usage/", "limits/", "members/"):
        response = Client().get(f"/t/{tenant_a.id}/{page}")
        assert response.status_code == 302 and "/login/" in response["Location"]
    for page in ("/ops/fleet/", "/ops/tenants/"):
        assert "/login/" in Client().get(page)["Location"]


def test_csrf_is_enforced_on_console_forms(tenant_a: Tenant, owner_a: Any) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(owner_a)
    assert client.post(f"/t/{tenant_a.id}/keys/", {"name": "x"}).status_code == 403


@override_settings(AXES_FAILURE_LIMIT=3)
def test_sign_in_locks_out_after_repeated_failures(make_user: Callable[..., Any]) -> None:
    make_user("victim")
    client = Client()
    for _ in range(2):
        failed = client.post("/login/", {"username": "victim", "password": "wrong"})
        assert failed.status_code == 200 and b"Please enter a correct username" in failed.content
    locked = client.post("/login/", {"username": "victim", "password": "wrong"})
    assert locked.status_code == 429 and b"Too many failed sign-in attempts" in locked.content
    # Even the right password is refused while locked out.
    right = client.post("/login/", {"username": "victim", "password": "pw-12345"})
    assert right.status_code == 429
    assert "_auth_user_id" not in client.session
    # Another address is not locked out by these failures.
    other = Client(REMOTE_ADDR="10.0.0.9")
    ok = other.post("/login/", {"username": "victim", "password": "pw-12345"})
    assert ok.status_code == 302


def test_sign_in_out_and_password_change(make_user: Callable[..., Any]) -> None:
    make_user("alice")
    client = Client(enforce_csrf_checks=False)
    assert client.post("/login/", {"username": "alice", "password": "pw-12345"}).status_code == 302
    changed = client.post(
        "/password/",
        {
            "old_password": "pw-12345",
            "new_password1": "a-new-Secret-77",
            "new_password2": "a-new-Secret-77",
        },
    )
    assert changed.status_code == 302 and changed["Location"] == "/password/done/"
    assert client.post("/logout/").status_code == 302
    assert (
        client.post("/login/", {"username": "alice", "password": "a-new-Secret-77"}).status_code
        == 302
    )


def test_error_pages_use_the_console_layout(
    tenant_a: Tenant, tenant_b: Tenant, owner_a: Any, browser_for: Any,
    member_of: Callable[..., Any],
) -> None:  # fmt: skip
    missing = browser_for(owner_a).get(f"/t/{tenant_b.id}/keys/")
    assert missing.status_code == 404 and b"Back to the console" in missing.content
    denied = browser_for(member_of(tenant_a, Role.MEMBER)).get(f"/t/{tenant_a.id}/members/")
    assert denied.status_code == 403 and b"may not manage members" in denied.content
